"""The name earlier releases documented for `flexmarl.runtime.params.channel`; import from there."""

from .params.channel import *  # noqa: F401,F403
from .params.channel import __all__  # noqa: F401

"""Built-in workflows by short name, for `run.workflow`.

Each built-in lives in its job module with everything else of that job (see
digit_chain.py); this table only names them. user_code.load_workflow looks names up
here before treating them as module or file paths.
"""

from __future__ import annotations

from . import digit_chain
from .workflow import Episode

WORKFLOWS: dict[str, Episode] = {"digit_chain": digit_chain.episode}


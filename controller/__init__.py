"""The FlexMARL controller: one asyncio process that decides, and the pieces it wires.

`Experiment` is imported when first asked for (PEP 562), so a command that needs one
module (`flexmarl replay`, `flexmarl samples`, `flexmarl view`) does not import the whole
controller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .run.experiment import Experiment

__all__ = ["Experiment"]


def __getattr__(name: str) -> Any:
    if name == "Experiment":
        from .run.experiment import Experiment

        return Experiment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

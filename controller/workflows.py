"""Built-in workflows by short name, for `run.workflow`.

Each built-in lives in its job module with everything else of that job (see
digit_chain.py); this table only names them.
"""

from __future__ import annotations

from . import digit_chain
from .workflow import Episode

WORKFLOWS: dict[str, Episode] = {"digit_chain": digit_chain.episode}


def get_workflow(name: str) -> Episode:
    if name not in WORKFLOWS:
        raise KeyError(f"unknown workflow {name!r} (built in: {', '.join(WORKFLOWS)})")
    return WORKFLOWS[name]

"""A workflow's reads of the data, tried before any worker starts.

`check_fields(workflow, dataset, agents, seed)` runs the episode function once on the
data's first row with a `DryContext`: the episode runs as written up to its first call of
anything but its row, its random generator and the agents' names and settings (an agent,
a tool, the OpenAI endpoint, a reward), which ends it quietly once its arguments are made. A field it read on the
way that no row of the data has raises the data's `MissingColumn` there, and
`check_fields` turns that into a `DataError`: one line naming the field, where the
workflow read it and the fields the rows have, before any worker starts or any model is
built. A field read only after the first agent call is found when an episode reads it
(`MissingColumn` stops the run then; `MissingField` fails that episode alone).

The dry run has a loop of its own, in a thread, and a time limit (DRY_READ_TIMEOUT_S),
so an episode that waits on something else first is simply left there. Anything else the
workflow raises is its own business, found with its traceback when the run's episodes run.

It knows the episode context only by the names a dry run may read (`DryContext`).
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any, Callable

from .data import DataError, Dataset, MissingColumn

# An episode reads its row first thing; a second is plenty for that, and a dry run past it
# is left where it waits.
DRY_READ_TIMEOUT_S = 1.0


class DryRunOver(BaseException):
    """The dry run reached what needs a worker; a BaseException, so the workflow's own
    `except Exception` does not take it for an error of its own."""


# The context's attributes that are values, not calls: reading one ends the dry run.
ENDS_ON_READ = frozenset({"openai_base_url", "openai_api_key"})


class DryContext:
    """What an episode may read in a dry run: its row, a random generator, the agents
    (name -> settings), the episode's names and seed. Calling anything else (an agent, a
    tool, the endpoint, a reward) ends the dry run, once its arguments are made: a row's
    field read in the arguments (`ctx.generate("solver", ctx.item["question"])`) is read."""

    def __init__(self, item: Any, agents: dict[str, Any], seed: int) -> None:
        self.item = item
        self.agents = agents
        self.rng = random.Random(seed)
        self.run_seed = seed
        self.episode_id = "dry-read"
        self.batch = 1
        self.trains = True
        self.eval_temperature = None

    def __getattr__(self, name: str) -> Any:
        if name in ENDS_ON_READ or name.startswith("_"):
            raise DryRunOver(name)

        def ends_the_dry_run(*args: Any, **kwargs: Any) -> Any:
            raise DryRunOver(name)

        return ends_the_dry_run


def check_fields(workflow: Callable[..., Any], dataset: Dataset, agents: dict[str, Any], seed: int) -> None:
    """Raises DataError when the episode, run dry on the data's first row, reads a field
    no row has (see the module docstring)."""
    outcome: list[BaseException] = []

    def dry() -> None:
        try:
            asyncio.run(asyncio.wait_for(workflow(DryContext(dataset.item(0), agents, seed)), DRY_READ_TIMEOUT_S))
        except BaseException as exc:  # noqa: BLE001 - everything but a missing column is the run's to report
            outcome.append(exc)

    thread = threading.Thread(target=dry, name="dry-read", daemon=True)
    thread.start()
    thread.join(DRY_READ_TIMEOUT_S + 1.0)
    missing = next((exc for exc in outcome if isinstance(exc, MissingColumn)), None)
    if missing is not None:
        raise DataError(str(missing)) from None

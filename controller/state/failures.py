"""What a user is shown when their code fails: the frame of theirs that raised, and the
error that stops a run that cannot learn.

`user_frame(exc)` and `user_traceback(exc)` (from runtime/tracebacks.py, which an
environment worker shares) are the user's frame that raised and their part of the
traceback.

`RunFailed` is the error that ends a run which cannot learn (too many failed episodes in a
step, or an agent with no sample in a step); its message carries the first failure's
user traceback and what to do.

`too_many_failures(...)` is the rule for a step's failed episodes (more than
`pipeline.max_failed_share` of them), with the error it raises; the episode producer and
the agents' pipelines both apply it, so whichever sees a hopeless step first says the same.

It does not know the workflow, the store or how failures are counted.
"""

from __future__ import annotations

from flexmarl.runtime.tracebacks import calling_user_frame, user_frame, user_traceback

__all__ = ["RunFailed", "calling_user_frame", "too_many_failures", "user_frame", "user_traceback"]


class RunFailed(RuntimeError):
    """The run cannot learn and was stopped; the message says why and what to do."""


def too_many_failures(step: int, failed: int, episodes: int, max_share: float, first: str) -> RunFailed | None:
    """The error that stops the run when more than `max_share` of a step's `episodes`
    failed (already, or in the end), `first` being the first failure; None otherwise."""
    if max_share >= 1.0 or failed <= max_share * episodes:
        return None
    return RunFailed(f"the run cannot learn: {failed} of the {episodes} episodes of step {step} failed, more than "
                     f"pipeline.max_failed_share = {max_share}. The first failure:\n{first}\n"
                     f"Fix the workflow (each failure is also logged above), or raise pipeline.max_failed_share "
                     f"(1.0: never stop) if failures are expected.")

"""Python's cyclic garbage collector around work that makes many objects and no cycles.

A collection walks every tracked container younger than its generation; a controller at
scale, or a replay of its log, holds hundreds of thousands of them (events, sample records,
lists of ids), none in a reference cycle. At the default thresholds (700, 10, 10) the
collector walks that heap again and again for nothing: a quarter of the controller's time at
1,024 instances, half of the time of reading a large event log. These two context managers
(also decorators) say what a piece of work needs, and restore what was set before it;
``set_apart`` is for a command that holds such a heap to its end.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator

# Passes rare enough not to matter, frequent enough to bound what real cycles keep alive.
RARE_THRESHOLDS = (50_000, 20, 10)


@contextlib.contextmanager
def rare_collections() -> Iterator[None]:
    """The collector at RARE_THRESHOLDS meanwhile: for long work that may make cycles."""
    before = gc.get_threshold()
    gc.set_threshold(*RARE_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No collection meanwhile: for bounded work that makes no cycles (decoding, counting)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def set_apart() -> Iterator[Callable[[], None]]:
    """Yields ``keep``: each call sets apart every object the collector tracks so far
    (``gc.freeze``), so that no later collection walks them; the block's end hands them
    back to the oldest generation. For a command that reads or makes a large acyclic heap
    once and holds it to its end (replay's events, then its summary), which every
    collection after it would otherwise walk again. Where objects were frozen before the
    block (by whoever owns them), ``keep`` does nothing."""
    owned = gc.get_freeze_count() == 0
    try:
        yield gc.freeze if owned else _nothing
    finally:
        if owned:
            gc.unfreeze()


def _nothing() -> None:
    pass

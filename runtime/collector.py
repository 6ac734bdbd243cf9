"""Python's cyclic garbage collector around work that makes many objects and no cycles.

A collection walks every tracked container younger than its generation; a controller at
scale, or a replay of its log, holds hundreds of thousands of them (events, sample records,
lists of ids), none in a reference cycle. At the default thresholds (700, 10, 10) the
collector walks that heap again and again for nothing: a quarter of the controller's time at
1,024 instances, half of the time of reading a large event log. These two context managers
(also decorators) say what a piece of work needs, and restore what was set before it;
``set_apart`` is for a command that holds such a heap to its end.

``swept`` is the same policy for a loop that is not an experiment's: the bench's helper
process of fake workers (controller/testing/fake_cluster.py), a thousand sessions in one heap
and a message every few microseconds, spent a sixth of its samples in the collector at the
default thresholds. A real worker keeps them once running: one session, tens of messages a
second, and a heap its engine or model makes after start-up (vLLM, torch), which a sweep
every few seconds would walk where the default passes rarely reach it; its engine's start
is ``building``'s.

Rare passes have a price: a cycle that dies after it has aged into the oldest generation
waits for a full collection, and at these thresholds, beside the million and more objects
the imports leave (torch, vLLM), that is minutes away, and seconds long. The collector counts
objects, not bytes: a cycle of a few hundred objects can hold a megabyte the C side
allocated (an HTTP client's TLS context with its certificate store, which every new
`openai.AsyncOpenAI` loads, is about 0.8 MiB). ``Sweeps`` bounds that for a long-running
loop: it sets the start-up heap apart once and collects the rest on a schedule.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import AsyncIterator, Callable, Iterator

log = logging.getLogger("flexmarl.collector")

# Passes rare enough not to matter, frequent enough to bound what real cycles keep alive.
RARE_THRESHOLDS = (50_000, 20, 10)

# Young passes as a backstop only, for a loop whose sweeps find it makes next to no cycles
# (`Sweeps` with `adapt`: an experiment's, `swept`'s). Its young generation is then what it
# has in flight (episodes' coroutines, tasks, contexts and futures, the router's parts),
# alive, not garbage, and it swells at every step as the step's episodes start: at
# RARE_THRESHOLDS the controller at 1,024 x 32 (chain, a 14 s window) made a young pass
# about every half second, each of 30-77 ms (counted in a shorter run: 67,000-141,000
# objects a pass), collecting nothing: a tenth of its CPU, its loop's lag p99 39-57 ms. The young count is
# allocations less deallocations (never below zero): a heap that swells and drains comes
# back near where it was and reaches this rarely; garbage that waits for the collector
# counts towards it.
BACKSTOP_THRESHOLDS = (1_000_000, 20, 10)

# A sweep that finds at least this many unreachable objects says the run makes cycles
# (episodes that open an HTTP client each: a finished one is a cycle of a few hundred
# objects holding about 0.8 MiB of its TLS store): young passes at RARE_THRESHOLDS again,
# which find most of them between sweeps. With the sweeps alone, a 64-client OpenAI-API
# job's controller grew 820 MiB a minute: each sweep found more and took longer, and the
# sweeps' CPU share spaced them further apart.
CYCLES_FOUND = 5_000


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


# Whether this process is one program's alone (`own_heap`): a worker process.
_OWNS_HEAP = False


def own_heap() -> None:
    """Says this process is one program's alone (`flexmarl worker`): `building` may then set
    what it builds apart from the collector. Elsewhere (tests, in-process runs) it never
    does: that would hold other code's objects out of every collection."""
    global _OWNS_HEAP
    _OWNS_HEAP = True


@contextlib.contextmanager
def building() -> Iterator[Callable[[], None]]:
    """Around the build of a heap the process then holds (an inference engine and the
    imports it needs): the collector's passes rare meanwhile. Where the process owns its
    heap (`own_heap`), the ``keep`` it yields sets apart everything tracked so far (call
    it after the imports: the library's own full collections while it builds then skip
    them), and so does the block's end, once it built; on entry, what an earlier build set
    apart is handed back (the engine it held may be the one this build replaces). Elsewhere
    ``keep`` does nothing and nothing is set apart.

    A vLLM engine's start made 1,700 young and 155 middle passes and 12 full ones, each of
    these walking the whole imported heap (up to 0.95 s): 4.1-4.5 s of a 12.4-13.1 s start.
    The cost of setting apart: a cycle among those objects that dies later is not collected
    until the next build hands them back (objects that die without a cycle are freed at
    once, as ever)."""
    owned = _OWNS_HEAP
    if owned:
        gc.unfreeze()
    with rare_collections():
        yield gc.freeze if owned else _nothing
    if owned:
        gc.freeze()


class Sweeps:
    """Full collections on a schedule, for a loop that runs for hours at RARE_THRESHOLDS
    beside code that makes cycles (episodes' HTTP clients, their requests' exceptions).

    `start()` (from the loop, once start-up is done) sets apart everything tracked so far
    (``gc.freeze``: the imports' objects, the run's set-up), so that a full collection
    walks only what the run made since; `run()` then collects `first_s` seconds later (so
    that `adapt` sets the young passes by what the run makes early: until a sweep has, a
    run at RARE_THRESHOLDS walks its in-flight heap about twice a second, 28-36 ms a pass
    at 1,024 x 32, the wide point's loop lag p99), then every `every_s` seconds,
    or less often where a collection's CPU time is more than `share` of the time between
    two (a heap that has grown large is walked less often, never more than that share of
    the loop's CPU). What cycles keep alive is then bounded by `every_s` seconds of their
    making, not by when the collector's own counts come round. With `adapt`, each sweep
    also sets the thresholds by what it found: RARE_THRESHOLDS where it found CYCLES_FOUND
    unreachable objects or more, BACKSTOP_THRESHOLDS where it found fewer (the young
    passes would walk what is in flight and find nothing). `stop()` hands the set-apart
    objects back (where `start()` set them apart: objects frozen by someone else before
    are left as they were); the thresholds are the caller's to restore.

    Consumes: nothing. Produces: `count`, `cpu_s`, `worst_s` (the collections' CPU time
    and the longest one's wall time, for benches), `found` (what the last one found
    unreachable). Waits for: its timer."""

    def __init__(self, every_s: float = 5.0, share: float = 0.02, *, adapt: bool = False,
                 first_s: float = 1.0) -> None:
        self.every_s = every_s
        self.first_s = first_s
        self.share = share
        self.adapt = adapt
        self.count = 0
        self.cpu_s = 0.0
        self.worst_s = 0.0
        self.found = 0
        self._owned = False

    def start(self) -> None:
        self._owned = gc.get_freeze_count() == 0
        if self._owned:
            gc.freeze()

    def sweep(self) -> float:
        """One full collection now; returns its CPU time (this thread's)."""
        started, cpu = time.perf_counter(), time.thread_time()
        self.found = gc.collect()
        took = time.thread_time() - cpu
        self.count += 1
        self.cpu_s += took
        self.worst_s = max(self.worst_s, time.perf_counter() - started)
        if self.adapt:
            young = RARE_THRESHOLDS if self.found >= CYCLES_FOUND else BACKSTOP_THRESHOLDS
            if gc.get_threshold() != young:
                log.debug("a full collection found %d unreachable objects: young passes at %d", self.found, young[0])
                gc.set_threshold(*young)
        return took

    async def run(self) -> None:
        import asyncio  # here, not above: `flexmarl replay` uses this module and starts without an event loop

        wait = self.first_s
        while True:
            await asyncio.sleep(wait)
            wait = max(self.every_s, self.sweep() / self.share)

    def stop(self) -> None:
        if self._owned:
            gc.unfreeze()
            self._owned = False
        if self.count:
            log.info("%d scheduled full collections: %.0f ms of CPU each on average, the longest %.0f ms", self.count,
                     1000 * self.cpu_s / self.count, 1000 * self.worst_s)


@contextlib.asynccontextmanager
async def swept(every_s: float = 5.0, share: float = 0.02, first_s: float = 1.0) -> AsyncIterator[Sweeps]:
    """A long-running loop's policy, for as long as the block runs on it: what is tracked
    now set apart, a full collection of the rest after `first_s` seconds, then every
    `every_s` (at most `share` of the loop's CPU) by a task of its own, and young passes at RARE_THRESHOLDS or, while
    the sweeps find next to no cycles, BACKSTOP_THRESHOLDS (`Sweeps` with `adapt`). The
    block's end stops the task, hands the set-apart heap back and restores the thresholds."""
    import asyncio  # as in `Sweeps.run`

    sweeps = Sweeps(every_s, share, adapt=True, first_s=first_s)
    with rare_collections():
        sweeps.start()
        task = asyncio.get_running_loop().create_task(sweeps.run(), name="collector")
        try:
            yield sweeps
        finally:
            task.cancel()
            sweeps.stop()

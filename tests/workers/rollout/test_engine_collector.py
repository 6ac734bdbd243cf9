"""A real vLLM engine's start and Python's collector (runtime/collector.py `building`): in a
worker process, few passes while it starts, and vLLM's own full collections meanwhile find
the imported heap set apart."""

import gc

from flexmarl.controller.run.model_resolution import resolve_model
from flexmarl.runtime import collector


def test_an_engine_starting_in_a_worker_process_makes_few_passes_and_its_full_ones_skip_the_imports(monkeypatch):
    from vllm import LLM  # noqa: F401  (imported first: the passes counted are the start's)

    from flexmarl.workers.rollout.engine import VllmEngine

    monkeypatch.setattr(collector, "_OWNS_HEAP", True)  # what `flexmarl worker` says of its process
    passes: list[tuple[int, int]] = []  # (generation, objects set apart when it started)

    def seen(phase, info):
        if phase == "start":
            passes.append((info["generation"], gc.get_freeze_count()))

    alive = len(gc.get_objects())
    gc.callbacks.append(seen)
    try:
        engine = VllmEngine(resolve_model("tiny:planner"), seed=0, max_model_len=64)
    finally:
        gc.callbacks.remove(seen)
    try:
        young = [p for p in passes if p[0] == 0]
        full = [p for p in passes if p[0] == 2]  # vLLM collects on its own while it starts
        # At the default thresholds a start made about 200 young passes in the test process
        # (about 860 in a fresh process that had imported vLLM).
        assert len(young) < 100, f"{len(young)} young passes while the engine started"
        # Each found the heap as it was before the start set apart (less what died since).
        assert full and all(frozen >= 0.9 * alive for _, frozen in full), (alive, full)
        engine.add("r", [1, 14, 5, 15], 3, 0.0, 0)
        done = []
        while engine.has_unfinished():
            done += engine.step()
        assert len(done) == 1 and len(done[0].token_ids) == 3  # and it generates
    finally:
        engine.close()
        gc.unfreeze()

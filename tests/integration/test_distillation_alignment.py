"""On-policy distillation end to end on the distillation job's own models (the digit
chain's planner as the student, examples/distill's sorter as its teacher): the student's
samples scored by the teacher in one prefill on a real vLLM engine, carried through the
workflow and the experience store into the trainer's samples, and the student's loss made
of them; against the teacher's and the student's logprob of each sampled token computed
directly with transformers.

What must hold: the teacher's logprob of output token j is the one its logits at position
len(prompt) - 1 + j give that token (the prefill's prompt logprobs are not shifted by
one); each token's advantage is -(log p_student - log p_teacher) of that token (plus the
reward's group-normalised advantage, which the teacher leaves as it is), per token, not
summed over the sample, and positive where the teacher finds the token likelier."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flexmarl.controller.episodes.workflow import AgentDefaults, EpisodeContext, run_episode  # noqa: E402
from flexmarl.controller.state.groups import output_of  # noqa: E402
from flexmarl.controller.state.store import ExperienceStore, group_advantages  # noqa: E402
from flexmarl.controller.tasks.digit_chain import make_query, planner_prompt, planner_reward  # noqa: E402
from flexmarl.runtime import protocol as p  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STUDENT, TEACHER = "tiny:planner", f"tiny:{ROOT / 'examples' / 'distill' / 'models.py'}:teacher"
GROUP, QUERIES, TOKENS = 8, 3, 3


@pytest.fixture(scope="module")
def paths():
    from flexmarl.controller.run.model_resolution import resolve_model

    torch.set_num_threads(1)
    return resolve_model(STUDENT), resolve_model(TEACHER)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def direct_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[j] | prompt + output[:j]) from the model's whole logits, [len(output)]."""
    logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return torch.stack([lp[len(prompt) - 1 + j, t] for j, t in enumerate(output)])


class Generator:
    """The rollout side: the student sampled with transformers at temperature 1; the
    teacher's scoring requests prefilled on a real vLLM engine."""

    def __init__(self, student, engine):
        self.student, self.engine, self.scored = student, engine, []

    async def generate(self, agent, group, after=""):
        if agent == "teacher":
            assert group.n == 1 and group.score_from >= 1
            self.scored.append(group)
            request = f"{group.key.sample(group.first)}/score"
            self.engine.add(request, group.prompt_ids, 1, 1.0, None, score_from=group.score_from)
            done = {}
            while self.engine.has_unfinished():
                done.update((c.request_id, c) for c in self.engine.step())
            c = done[request]
            return output_of([c.token_ids], [c.logprobs], finish_reason=c.finish_reason)
        rng = torch.Generator().manual_seed(group.seed)
        outputs, logprobs = [], []
        for _ in range(group.n):
            ids, lps = list(group.prompt_ids), []
            for _ in range(group.max_tokens):
                with torch.no_grad():
                    lp = torch.log_softmax(self.student(torch.tensor([ids])).logits[0, -1].float(), -1)
                token = int(torch.multinomial(lp.exp(), 1, generator=rng))
                ids.append(token)
                lps.append(float(lp[token]))
            outputs.append(ids[len(group.prompt_ids):])
            logprobs.append(lps)
        return output_of(outputs, logprobs)


@pytest.fixture(scope="module")
def scored(paths):
    """The trainer's samples of QUERIES episodes of the student (GROUP samples each), as
    the trainer reads the groups the store sends it, with the rewards each group was given."""
    import asyncio

    from flexmarl.controller.state.decisions import MicroBatchSize
    from flexmarl.workers.rollout.engine import VllmEngine
    from flexmarl.workers.trainer.batch import samples_of

    student_path, teacher_path = paths
    engine = VllmEngine(teacher_path, seed=0, max_model_len=0, settings=p.EngineSettings())
    store = ExperienceStore(["student", "teacher"], frozen=["teacher"], teachers={"student": "teacher"})
    agents = {"student": AgentDefaults(TOKENS, 1.0, GROUP, ignore_eos=True, teacher="teacher"),
              "teacher": AgentDefaults(TOKENS, 1.0, 1, ignore_eos=True, frozen=True)}
    gen = Generator(hf_model(student_path), engine)
    rewards = {}

    async def episode(ctx):
        query = make_query(ctx.rng)
        for s in await ctx.generate("student", planner_prompt(query)):
            ctx.reward(s, planner_reward(query, s.output_ids))
            rewards.setdefault(s.key, []).append(planner_reward(query, s.output_ids))

    async def episodes():
        for e in range(QUERIES):
            ctx = EpisodeContext(f"e{e}", 0, random.Random(e), store, gen, agents, run_seed=7)
            assert await run_episode(episode, ctx, 600.0) == ""

    try:
        asyncio.run(episodes())
    finally:
        engine.close()
    assert len(gen.scored) == QUERIES * GROUP  # one prefill per sample, nothing generated
    micro_batches = store.form_micro_batches("student", 0, MicroBatchSize(QUERIES * GROUP), True, False, 0)
    samples = samples_of([group for mb in micro_batches for group in mb.wire()])
    assert len(samples) == QUERIES * GROUP
    return samples, rewards


def test_the_teachers_logprobs_are_those_of_the_students_own_tokens_at_their_positions(paths, scored):
    samples, _ = scored
    teacher = hf_model(paths[1])
    shifted_apart = 0
    with torch.no_grad():
        for s in samples:
            want = direct_logprobs(teacher, list(s.prompt_ids), list(s.output_ids))
            assert list(s.teacher_logprobs) == pytest.approx(want.tolist(), abs=1e-4)
            # The same logits one position later (the classic off-by-one) give other values:
            # the comparison above tells the two apart.
            ids = torch.tensor([list(s.prompt_ids) + list(s.output_ids)])
            lp = torch.log_softmax(teacher(ids).logits[0].float(), -1)
            late = [lp[len(s.prompt_ids) + j, t].item() for j, t in enumerate(s.output_ids[:-1])]
            shifted_apart += any(abs(a - b) > 1e-2 for a, b in zip(late, s.teacher_logprobs))
    assert shifted_apart == len(samples)


def reference_loss(model, samples, beta, only, per_token=True):
    """The student's loss written out from transformers' logprobs: token t of sample i
    weighted by a_it = A_i - beta (log p_student - log p_teacher) of that token (A_i left
    out when `only`), seq_mean; with per_token=False, by the sample's mean of a_it instead
    (the sequence scalar a wrong implementation would make). (loss, KL summed, gradients)."""
    total, kl = torch.zeros(()), 0.0
    for s in samples:
        logp = direct_logprobs(model, list(s.prompt_ids), list(s.output_ids))
        assert logp.tolist() == pytest.approx(list(s.rollout_logprobs), abs=1e-4)  # the sampler's: the same weights
        teacher = torch.tensor(list(s.teacher_logprobs))
        a = (0.0 if only else s.advantage) - beta * (logp.detach() - teacher)
        if not per_token:
            a = a.mean().expand_as(a)
        total = total + (-a * logp).mean()
        kl += float((logp.detach() - teacher).sum())
    total.backward()
    return total, kl, {n: q.grad for n, q in model.named_parameters() if q.grad is not None}


def same(a, b) -> bool:
    return all(torch.allclose(a[n], b[n], rtol=1e-3, atol=1e-5) for n in b)


@pytest.mark.parametrize("only", [False, True], ids=["added-to-the-reward", "alone"])
def test_each_token_is_pushed_by_the_teachers_minus_the_students_logprob_of_it(paths, scored, only):
    from flexmarl.workers.trainer.loss import policy_loss

    samples, rewards = scored
    for group, rs in rewards.items():  # the reward's advantage: the group's normalisation alone
        got = [s.advantage for s in samples if s.key == group]
        assert got == pytest.approx(group_advantages(rs), abs=1e-6)
    beta = 0.5

    student = hf_model(paths[0])
    loss, sums = policy_loss(student, samples, p.LossOptions(teacher_coef=beta, teacher_only=only), False, 2.0)
    loss.backward()
    got = {n: q.grad.clone() for n, q in student.named_parameters() if q.grad is not None}

    total, kl, want = reference_loss(hf_model(paths[0]), samples, beta, only)
    assert float(loss) == pytest.approx(float(total.detach()), rel=1e-4, abs=1e-5)
    assert sums.teacher_kl == pytest.approx(kl, rel=1e-4, abs=1e-4)
    assert got.keys() == want.keys() and same(got, want)
    # The comparison tells the right rule from the wrong ones: the sign flipped (tokens
    # the teacher finds likelier pushed down) or the teacher's term made one scalar per sample.
    assert not same(got, reference_loss(hf_model(paths[0]), samples, -beta, only)[2])
    assert not same(got, reference_loss(hf_model(paths[0]), samples, beta, only, per_token=False)[2])

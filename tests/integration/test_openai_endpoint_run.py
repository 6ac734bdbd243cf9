"""Agent code that speaks the OpenAI API, trained by `flexmarl run` (a process of its own:
real controller, vLLM rollout worker, torch trainer) through the run's endpoint, with the
real `openai` client: a conversation continued across calls is trained token-exactly (the
sampler's and the trainer's logprobs agree to round-off in sync mode), `n` > 1 is one
group, and the endpoint's errors are what OpenAI clients expect. The slow ones: an agent
written for LangChain trains unchanged, and `flexmarl serve` answers with the trained
checkpoint."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import read_events

ROOT = Path(__file__).resolve().parents[2]
CRITIC = f"tiny:{ROOT}/examples/review_chain/models.py:verifier"

JOB = f'''
[run]
workflow = "flow.py:episode"
steps = STEPS

[cluster]
rollout_workers = 1
trainer_workers = 1

[pipeline]
queries_per_step = 2

[openai]
enabled = true

[agents.critic]
model = "{CRITIC}"
group_size = 2
max_tokens = 10
'''

# The user's code: an OpenAI client, nothing else of FlexMARL but the context it is given.
FLOW = '''
import json
from pathlib import Path

import openai

SEEN = Path(__file__).with_name("seen.jsonl")
ENDED_KEYS = []
ASK = [{"role": "user", "content": "Question: What is 2 + 3? Answer: 5"}]


async def expect_error(kind, call):
    try:
        await call
    except kind as exc:
        return exc.status_code, exc.body
    raise AssertionError(f"no {kind.__name__}")


async def episode(ctx):
    client = ctx.openai_client()
    first = await client.chat.completions.create(model="critic", messages=ASK, n=2,
                                                 extra_body={"return_token_ids": True})
    said = first.choices[0].message.content
    more = await client.chat.completions.create(
        model="critic", messages=ASK + [{"role": "assistant", "content": said}, {"role": "user", "content": "Sure?"}],
        extra_body={"return_token_ids": True})
    fact = {"first_prompt": first.prompt_token_ids, "first_ids": first.choices[0].token_ids,
            "choices": len(first.choices), "later_prompt": more.prompt_token_ids, "later_ids": more.choices[0].token_ids,
            "first_text": said}
    fact["unknown_model"] = await expect_error(openai.NotFoundError, client.chat.completions.create(
        model="critc", messages=ASK))
    fact["bad_field"] = await expect_error(openai.BadRequestError, client.chat.completions.create(
        model="critic", messages=ASK, max_tokens="ten"))
    if ENDED_KEYS:
        stale = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ENDED_KEYS[0], max_retries=0)
        fact["ended_key"] = await expect_error(openai.AuthenticationError, stale.chat.completions.create(
            model="critic", messages=ASK))
        await stale.close()
    ENDED_KEYS.append(ctx.openai_api_key)
    with SEEN.open("a") as f:
        f.write(json.dumps(fact) + "\\n")
    ctx.reward(first.id, [float("correct" in c.message.content) for c in first.choices])
'''


def flexmarl(*args, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_job(folder: Path, flow: str, steps: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.toml").write_text(JOB.replace("STEPS", str(steps)))
    (folder / "flow.py").write_text(flow)
    proc = flexmarl("run", str(folder / "job.toml"), "--out", str(folder / "run"), "--no-progress")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    assert "0 failed episodes" in out, out
    return folder / "run"


def test_a_conversation_continued_through_the_endpoint_trains_token_exactly_and_errors_are_openais(tmp_path):
    run = run_job(tmp_path, FLOW)
    facts = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(facts) == 2
    for f in facts:
        assert f["choices"] == 2
        # The later call went on from the engine's own ids of the first reply, then the
        # appended user message, never from its text tokenized again.
        start = f["first_prompt"] + f["first_ids"]
        assert f["later_prompt"][:len(start)] == start and len(f["later_prompt"]) > len(start)
        assert f["unknown_model"][0] == 404 and "one of critic" in f["unknown_model"][1]["message"]
        assert f["bad_field"][0] == 400 and f["bad_field"][1]["param"] == "max_tokens"
    assert [f["ended_key"][0] for f in facts if "ended_key" in f] == [401]
    # n = 2 is one group, and a continuation adds no group: one group per episode.
    events, _ = read_events(run / "events.log")
    opened = [e for e in events if isinstance(e, ev.GroupOpened)]
    assert [e.n for e in opened] == [2, 2]
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][0]
    # Sync mode: the weights that sampled are the ones trained, so the trainer's logprobs
    # of every sampled token (both turns) equal the sampler's to round-off.
    assert row["samples"] == 4 and row["logprob_abs_diff"] < 1e-4 and row["clip_frac"] == 0


LANGCHAIN_FLOW = '''
import json
from pathlib import Path

from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

SEEN = Path(__file__).with_name("seen.jsonl")


async def double_check(llm, question):
    """An agent written for LangChain: it asks, then asks again with its own answer in
    the conversation."""
    history = [HumanMessage(question)]
    history.append(await llm.ainvoke(history))
    history.append(HumanMessage("Sure?"))
    return (await llm.ainvoke(history)).content


async def episode(ctx):
    llm = ChatOpenAI(model="critic", base_url=ctx.openai_base_url, api_key=ctx.openai_api_key, max_retries=0)
    final = await double_check(llm, "Question: What is 2 + 3? Answer: 5")
    samples = ctx.samples("critic")
    with SEEN.open("a") as f:
        f.write(json.dumps({"final": final, "turns": [len(s.versions) for s in samples]}) + "\\n")
    ctx.reward_all("critic", lambda s: float("correct" in s.text))
'''


@pytest.mark.slow
def test_an_agent_written_for_langchain_trains_unchanged(tmp_path):
    run = run_job(tmp_path, LANGCHAIN_FLOW, steps=2)
    facts = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    # ChatOpenAI sends no n: the first call is a group of group_size; LangChain goes on
    # with the first choice, which the second call continues (two turns, one sample).
    assert len(facts) == 4 and all(f["turns"] == [2, 1] for f in facts)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["samples"] == 4 for r in rows)


@pytest.mark.slow
def test_flexmarl_serve_answers_with_the_trained_checkpoint(tmp_path):
    import openai

    run = run_job(tmp_path, FLOW)
    proc = flexmarl("serve", str(run), "--log-level", "WARNING")
    try:
        line = ""
        deadline = time.monotonic() + 600
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "serving critic (step 1 of" in line, proc.stderr.read()[-3000:] if proc.poll() is not None else line
        url = line.rsplit(" at ", 1)[1].strip()
        client = openai.OpenAI(base_url=url, api_key="anything", max_retries=0)
        answer = client.chat.completions.create(model="critic", messages=[
            {"role": "user", "content": "Question: What is 2 + 3? Answer: 5"}], n=3, max_tokens=10)
        assert len(answer.choices) == 3 and all(c.message.content for c in answer.choices)
        assert [m.id for m in client.models.list().data] == ["critic"]
        with pytest.raises(openai.NotFoundError, match="one of critic"):
            client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "hi"}])
    finally:
        proc.send_signal(2)  # Ctrl-C: the workers are shut down
        proc.wait(timeout=120)
    assert proc.returncode == 0

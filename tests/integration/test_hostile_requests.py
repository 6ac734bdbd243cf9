"""`flexmarl serve` (a process of its own: controller, vLLM rollout worker) under hostile
input, with a checkpoint trained here by `flexmarl run`: a 6 MiB message (under the body
cap) is refused before it is tokenized, so the loop the heartbeats share never stalls, the
worker stays and the memory with it; every malformed request is a 4xx in the OpenAI shape
with no traceback on the server's terminal; no answer names a file; the 401 names the
server's key; and a checkpoint whose files do not match its manifest is refused before
anything loads it."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flexmarl.controller.testing import faults as fm

ROOT = Path(__file__).resolve().parents[2]
CRITIC = f"tiny:{ROOT}/examples/review_chain/models.py:verifier"  # a model with a chat template
KEY = "sk-serve-test"

JOB = f'''
[run]
workflow = "flow.py:episode"
steps = 1

[cluster]
rollout_workers = 1
trainer_workers = 1

[transport]
heartbeat_timeout_s = 5.0

[pipeline]
queries_per_step = 2

[agents.critic]
model = "{CRITIC}"
group_size = 2
max_tokens = 6
'''

FLOW = '''
async def episode(ctx):
    samples = await ctx.chat("critic", [{"role": "user", "content": "Question: What is 2 + 3? Answer: 5"}])
    ctx.reward_all("critic", lambda s: float(len(s.text)))
'''

ASK = [{"role": "user", "content": "Question: What is 2 + 3? Answer: 5"}]


def flexmarl(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", *args], env=fm.env(**(env or {})),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "job.toml").write_text(JOB)
    (folder / "flow.py").write_text(FLOW)
    proc = flexmarl("run", str(folder / "job.toml"), "--out", str(folder / "run"), "--no-progress")
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    return folder / "run"


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory):
    """`flexmarl serve RUN` with a key: its process, URL and stderr file."""
    stderr = tmp_path_factory.mktemp("serve") / "serve.stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", "serve", str(trained)],
                                env=fm.env(FLEXMARL_OPENAI_KEY=KEY), cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                text=True)
    try:
        line, deadline = "", time.monotonic() + 600
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert " at http" in line, stderr.read_text()[-3000:]
        yield proc, line.rsplit(" at ", 1)[1].strip(), stderr
    finally:
        fm.interrupt(proc, timeout=120)


def test_flexmarl_serve_answers_hostile_requests_with_4xx_and_goes_on_serving_with_its_worker(served, trained):
    proc, url, stderr = served
    worker = next(int(line.split("pid ")[1].split(")")[0]) for line in stderr.read_text().splitlines()
                  if "started rollout worker serve-0 (pid" in line)
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        assert client.post("/chat/completions", json={"model": "critic", "messages": ASK}).status_code == 200
        memory = fm.rss_mib(proc.pid), fm.rss_mib(worker)
        huge = "7 " * fm.LARGE_PROMPT_CHARS  # 6 MiB of text: under openai.max_request_bytes
        answers = {
            "a 6 MiB message": client.post("/chat/completions", json={"model": "critic", "messages": [
                {"role": "user", "content": huge}]}),
            "a 6 MiB prompt": client.post("/completions", json={"model": "critic", "prompt": huge}),
            "n = 0": client.post("/chat/completions", json={"model": "critic", "messages": ASK, "n": 0}),
            "n = 1000": client.post("/chat/completions", json={"model": "critic", "messages": ASK, "n": 1000}),
            "an empty prompt": client.post("/completions", json={"model": "critic", "prompt": ""}),
            "JSON nested 100,000 deep": client.post("/chat/completions", content=(
                b'{"model": "critic", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
        }
        for what, answer in answers.items():
            assert answer.status_code == 400, (what, answer.text[:500])
            assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}, what
        assert answers["a 6 MiB message"].json()["error"]["message"].startswith("the prompt is at least")
        wrong = client.get("/models", headers={"authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401 and wrong.json()["error"]["message"] == (
            "this API key is not the server's: use the key in the environment variable FLEXMARL_OPENAI_KEY "
            "(openai.key_env) that the server was started with")
        models = client.get("/models")
        assert models.status_code == 200 and str(trained) not in models.text and "/" not in json.dumps(
            [m for m in models.json()["data"]])
        after = client.post("/chat/completions", json={"model": "critic", "messages": ASK, "n": 2})
        assert after.status_code == 200 and len(after.json()["choices"]) == 2  # the same worker serves on
    assert proc.poll() is None
    grown = fm.rss_mib(proc.pid) - memory[0], fm.rss_mib(worker) - memory[1]
    assert grown[0] < 200 and grown[1] < 200, grown  # a prompt never made is no memory
    err = stderr.read_text()
    for marker in (*fm.UNEXPECTED, "declared dead", "is gone"):
        assert marker not in err, err[-3000:]
    assert "controller silent" not in (trained / "serve-logs" / "serve-0.log").read_text()


def test_flexmarl_serve_refuses_a_checkpoint_whose_files_do_not_match_its_manifest(trained, tmp_path):
    run = shutil.copytree(trained, tmp_path / "run", symlinks=True)
    weights = run / "checkpoints" / "step-000001" / "critic" / "model.safetensors"
    fm.flip_byte(weights)
    for target in (run / "checkpoints" / "step-000001", run):
        proc = flexmarl("serve", str(target))
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-3000:]
        last = [line for line in err.splitlines() if line.strip()][-1]
        assert last.startswith("flexmarl: ") and f"{weights} does not match its checksum in the checkpoint's " \
                                                 "manifest" in last, err[-3000:]
        assert "serving" not in err and "Traceback" not in err

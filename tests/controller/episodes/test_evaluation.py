"""Evaluation with a fake rollout side: held-out rows, one greedy sample per call, eval
rows in metrics.jsonl, nothing trained."""

import asyncio
import json

from flexmarl.controller.episodes.data import DataOrder, Dataset
from flexmarl.controller.episodes.evaluation import Evaluator, evaluation_steps
from flexmarl.controller.records.metrics import MetricsLog
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.schedule import BatchSchedule
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config


class FakeGenerator:
    def __init__(self):
        self.requests = []

    async def generate(self, agent, group, after=""):
        self.requests.append(group)
        return output_of([[3]] * group.n, [[-0.1]] * group.n, 2)


def test_evaluation_steps_include_the_final_weights_and_optionally_the_start():
    assert evaluation_steps(0, 10, True) == []
    assert evaluation_steps(4, 10, False) == [4, 8, 10]
    assert evaluation_steps(5, 10, True) == [0, 5, 10]


async def test_eval_episodes_run_greedy_on_held_out_rows_and_write_eval_rows(tmp_path):
    cfg = load_config(None, ["run.steps=2", "eval.every=1", "eval.episodes=3", "agents.a.model='m'",
                             "agents.a.group_size=4", "agents.a.temperature=1.0"])
    rows = [{"x": 10}, {"x": 20}]
    data = Dataset(rows, DataOrder(2, 0, shuffle=False))
    seen = []

    async def episode(ctx):
        seen.append(ctx.item["x"])
        for s in await ctx.generate("a", [ctx.item["x"]]):
            ctx.reward(s, ctx.item["x"] / 20)

    gen, events = FakeGenerator(), []
    schedule = BatchSchedule(["a"], 2, 1, overlap=True, max_staleness=0)
    metrics = MetricsLog(tmp_path, ["a"], progress=False)
    evaluator = Evaluator(cfg, episode, gen, schedule, metrics, events.append, data)
    task = asyncio.ensure_future(evaluator.run())
    await asyncio.sleep(0.05)
    assert gen.requests == []  # waits for step 1 to be trained
    for batch in (1, 2):
        schedule.agent_stepped(batch)
    await asyncio.wait_for(task, 5)
    metrics.close()
    assert seen == [10, 20, 10] * 2  # eval rows in file order, cycled, at every evaluation
    assert len(gen.requests) == 6 and all(r.temperature == 0.0 for r in gen.requests)  # one greedy sample each
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["samples"]) for r in written] == [("eval", 1, 3), ("eval", 2, 3)]
    assert abs(written[0]["reward_mean"] - (0.5 + 1.0 + 0.5) / 3) < 1e-9
    assert metrics.reward_history() == {"a": []}  # eval rows are not training rewards
    assert [e.step for e in events if isinstance(e, ev.EvaluationDone)] == [1, 2]


async def test_an_eval_after_step_n_runs_at_version_n_and_its_rows_record_every_agents_versions(tmp_path):
    """The sync to version n + 1 waits for the evaluation after step n (in async mode the
    next step may be trained by then), so the evaluation measures version n."""
    cfg = load_config(None, ["run.steps=2", "eval.every=1", "eval.episodes=2", "agents.a.model='m'",
                             "agents.b.model='m'"])
    synced = {"a": 0, "b": 0}

    class AtSyncedVersion(FakeGenerator):
        async def generate(self, agent, group, after=""):
            await asyncio.sleep(0.01)
            return output_of([[3]] * group.n, [[-0.1]] * group.n, synced[agent])

    async def episode(ctx):
        for agent in ("a", "b"):
            for s in await ctx.generate(agent, [1]):
                ctx.reward(s, 1.0)

    events = []
    schedule = BatchSchedule(["a", "b"], 2, 1, overlap=True, max_staleness=1)
    metrics = MetricsLog(tmp_path, ["a", "b"], progress=False)
    evaluator = Evaluator(cfg, episode, AtSyncedVersion(), schedule, metrics, events.append, None)

    async def pipeline(agent):  # steps and syncs as AgentPipeline does, as fast as it can
        for version in (1, 2):
            await schedule.wait_to_sync(version)
            synced[agent] = version
            events.append(("synced", agent, version))
            schedule.agent_stepped(version)

    await asyncio.wait_for(asyncio.gather(evaluator.run(), pipeline("a"), pipeline("b")), 5)
    metrics.close()
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["agent"], r["versions"]) for r in written] == [
        (1, "a", {"a": [1], "b": [1]}), (1, "b", {"a": [1], "b": [1]}),
        (2, "a", {"a": [2], "b": [2]}), (2, "b", {"a": [2], "b": [2]})]
    order = [e if isinstance(e, tuple) else ("evaluated", e.step) for e in events]
    assert order.index(("evaluated", 1)) < order.index(("synced", "a", 2))
    assert order.index(("evaluated", 1)) < order.index(("synced", "b", 2))

"""The workflow API with a fake rollout side (the other end of the socket)."""

import asyncio
import random

import pytest

from flexmarl.controller.episodes.workflow import (
    BRANCH,
    AgentDefaults,
    EpisodeContext,
    GroupPlace,
    ToolPool,
    group_place,
    request_seed,
    run_episode,
)
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.store import DROPPED, READY, ExperienceStore
from flexmarl.runtime.keys import GroupKey


def every_sample(store):
    """Every sample the store holds (the test looks inside it)."""
    return [v for key in store._groups for v in store.views(key)]


class FakeGenerator:
    def __init__(self, delay=0.0):
        self.delay = delay
        self.batches = []

    async def generate(self, agent, group, after=""):
        self.batches.append((agent, [group.key.sample(j) for j in range(group.n)]))
        await asyncio.sleep(self.delay)
        return output_of([[(group.seed + j) % 10] * group.max_tokens for j in range(group.n)],
                         [[-1.0] * group.max_tokens] * group.n)


def make_ctx(store, gen, episode_id="e0"):
    agents = {"a": AgentDefaults(2, 1.0, 3), "b": AgentDefaults(1, 1.0, 2)}
    return EpisodeContext(episode_id, 0, random.Random(0), store, gen, agents, run_seed=7)


async def chain(ctx):
    first = await ctx.generate("a", [1, 2])
    for s in first:
        ctx.reward(s, 1.0 if s.output_ids[0] % 2 else 0.0)
    seconds = await asyncio.gather(*(ctx.generate("b", s.output_ids) for s in first))
    for group in seconds:
        for s in group:
            ctx.reward(s, 0.5)


async def test_episode_chains_agents_and_makes_every_group_trainable():
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()
    assert await run_episode(chain, make_ctx(store, gen), 5.0) == ""
    assert store.ready_samples("a", 0) == 3 and store.ready_samples("b", 0) == 6
    assert all(s.status == READY and s.versions == [0] for s in every_sample(store))


async def test_a_reward_function_that_raises_drops_the_episode_and_the_run_goes_on():
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()

    async def broken(ctx):
        await ctx.generate("a", [1])
        raise ZeroDivisionError("reward bug")

    why = await run_episode(broken, make_ctx(store, gen), 5.0)
    assert "ZeroDivisionError: reward bug" in why
    assert all(s.status == DROPPED for s in every_sample(store))
    assert await run_episode(chain, make_ctx(store, gen, "e1"), 5.0) == ""


async def test_an_episode_that_hangs_past_its_timeout_is_dropped():
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator(delay=10.0)
    why = await run_episode(chain, make_ctx(store, gen), 0.2)
    assert "timed out" in why
    assert store.count("a", DROPPED) == 3


async def test_asking_for_an_unconfigured_agent_names_it():
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()

    async def typo(ctx):
        await ctx.generate("plannr", [1])

    assert "'plannr', which is not configured" in await run_episode(typo, make_ctx(store, gen), 5.0)


@pytest.mark.parametrize("call", [lambda ctx: ctx.generate("plannr", "sort 3 1 2"),
                                  lambda ctx: ctx.chat("plannr", [{"role": "user", "content": "hi"}])])
async def test_an_unconfigured_agent_in_any_ctx_call_names_the_configured_ones(call):
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()

    async def typo(ctx):
        await call(ctx)

    why = await run_episode(typo, make_ctx(store, gen), 5.0)
    assert "UnknownAgent: workflow asked for agent 'plannr', which is not configured (agents: a, b)" in why


async def test_a_failed_episode_names_the_users_file_and_line_and_keeps_their_traceback():
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()

    async def typo(ctx):
        row = {"q": "1 2"}
        return row["question"]

    ctx = make_ctx(store, gen)
    why = await run_episode(typo, ctx, 5.0)
    line = typo.__code__.co_firstlineno + 2
    assert why == f"episode e0 failed: KeyError: 'question' (at {__file__}:{line} in typo)"
    assert f'File "{__file__}", line {line}, in typo' in ctx.failure
    assert ctx.failure.endswith("KeyError: 'question'")
    assert "asyncio" not in ctx.failure and "controller/episodes/workflow.py" not in ctx.failure


async def test_an_episode_that_forgets_a_reward_is_dropped_not_reported_as_success():
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()

    async def forgetful(ctx):
        await ctx.generate("a", [1])

    assert "without rewarding" in await run_episode(forgetful, make_ctx(store, gen), 5.0)
    assert store.count("a", DROPPED) == 3


def test_request_seeds_depend_only_on_run_seed_and_the_samples_key():
    g, h = GroupKey("e0", "a", "1f-0"), GroupKey("e0", "a", "1f-1")
    assert request_seed(1, g, 1) == request_seed(1, GroupKey("e0", "a", "1f-0"), 1)
    assert request_seed(1, g, 1) != request_seed(2, g, 1)
    assert request_seed(1, g, 1) != request_seed(1, h, 1)


def test_a_groups_members_get_consecutive_seeds_and_later_turns_their_own():
    g = GroupKey("e0", "a", "1f")
    base = request_seed(3, g)
    assert [request_seed(3, g, i) for i in range(4)] == [base + i for i in range(4)]
    assert request_seed(3, GroupKey("e0", "a", "2f")) != base  # another group, another base
    later = request_seed(3, g, 1, turn=1)  # a sample's second turn: hashed whole
    assert later not in {base + i for i in range(4)} and 0 <= later < 2**31


def test_seeds_from_typed_keys_are_the_seeds_the_string_ids_drew():
    """A run draws the same tokens as before keys were typed: a group's seeds come from the
    name its string id was, a later turn's from `SAMPLE@TURN`."""
    import zlib

    g = GroupKey("s1q0", "solver", "1a2b3c4d-b0.1-2")
    assert str(g) == "s1q0/solver-1a2b3c4d-b0.1-2"
    assert request_seed(3, g, 5) == (zlib.crc32(b"3:s1q0/solver-1a2b3c4d-b0.1-2") & 0x3FFFFFFF) + 5
    assert request_seed(3, g, 1, turn=2) == zlib.crc32(b"3:s1q0/solver-1a2b3c4d-b0.1-2/1@2") & 0x7FFFFFFF


# ---------------------------------------------------------------- failures and determinism


async def test_a_failing_episode_cancels_its_other_branches_and_leaves_nothing_in_flight():
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator(delay=0.05)
    opened_after_failure = []

    async def branching(ctx):
        async def failing():
            await ctx.generate("a", [1])
            raise RuntimeError("tool crashed")

        async def slow():
            await ctx.generate("a", [2])
            await asyncio.sleep(0.2)  # still running when its sibling fails
            opened_after_failure.append(True)
            for s in await ctx.generate("b", [3]):
                ctx.reward(s, 1.0)

        await asyncio.gather(failing(), slow())

    why = await run_episode(branching, make_ctx(store, gen), 5.0)
    assert "tool crashed" in why
    await asyncio.sleep(0.4)  # a surviving branch would open its group by now
    assert opened_after_failure == []
    assert all(s.status == DROPPED for s in every_sample(store)) and every_sample(store)


async def test_a_closed_episode_refuses_to_generate():
    from flexmarl.controller.episodes.workflow import EpisodeClosed

    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()
    ctx = make_ctx(store, gen)
    await ctx.close("failed earlier")
    with pytest.raises(EpisodeClosed, match="failed earlier"):
        await ctx.generate("a", [1])


async def test_group_ids_and_seeds_follow_the_call_not_which_branch_finishes_first():
    def run(delays):
        store, gen = ExperienceStore(["a", "b"]), FakeGenerator()

        async def episode(ctx):
            async def branch(prompt, delay):
                await asyncio.sleep(delay)  # an environment call of varying latency
                for s in await ctx.generate("b", prompt):
                    ctx.reward(s, 0.0)

            await asyncio.gather(branch([4, 4], delays[0]), branch([5, 5], delays[1]), branch([4, 4], 0.0))

        return store, gen, episode

    seen = []
    for delays in ((0.01, 0.05), (0.05, 0.01)):
        store, gen, episode = run(delays)
        assert await run_episode(episode, make_ctx(store, gen), 5.0) == ""
        seen.append({(tuple(s.prompt_ids.tolist()), s.key) for s in every_sample(store)})
        seeds = {(s.key, s.member): request_seed(7, s.key, s.member) for s in every_sample(store)}
        assert len(set(seeds.values())) == len(seeds)
    assert seen[0] == seen[1]


def test_a_group_key_reads_back_into_its_episode_and_branch_whatever_the_agents_name():
    ctx = make_ctx(ExperienceStore(["a"]), FakeGenerator(), "s3q7")
    for agent in ("a", "b-b1", "0000000a"):
        for branch in ((), (0,), (1, 0), (12, 3, 4)):
            for _ in range(2):  # the second identical call: another occurrence
                token = BRANCH.set(branch)
                key = ctx.group_key(agent, [5, 6])
                BRANCH.reset(token)
                assert group_place(key) == GroupPlace("s3q7", branch), key
    assert group_place(GroupKey("", "a", "junk")) is None  # an old log's group of no known grammar
    assert group_place(GroupKey("e", "a", "0000000a-bx-0")) is None


async def test_a_group_of_one_is_refused():
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()
    with pytest.raises(ValueError, match="at least 2"):
        await make_ctx(store, gen).generate("a", [1], n=1)


# ---------------------------------------------------------------- tools off the event loop


async def test_a_slow_blocking_tool_times_out_its_episode_without_stalling_the_others():
    import concurrent.futures
    import time

    pool = concurrent.futures.ThreadPoolExecutor(2)
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()
    finished = []

    def slow_tool(seconds):
        time.sleep(seconds)  # blocking: would freeze every episode if run on the loop
        return "done"

    async def uses_tool(ctx, seconds):
        result = await ctx.call(slow_tool, seconds, timeout=0.3)
        for s in await ctx.generate("a", [1]):
            ctx.reward(s, 1.0)
        finished.append((ctx.episode_id, result, time.monotonic()))

    def ctx(i):
        c = make_ctx(store, gen, episode_id=f"e{i}")
        c.tools = ToolPool(pool)
        return c

    t0 = time.monotonic()
    slow, fast = await asyncio.gather(run_episode(lambda c: uses_tool(c, 2.0), ctx(0), 5.0),
                                      run_episode(lambda c: uses_tool(c, 0.01), ctx(1), 5.0))
    assert "did not return within 0.3s" in slow and fast == ""
    assert [f[:2] for f in finished] == [("e1", "done")]
    assert finished[0][2] - t0 < 1.0  # the fast episode never waited for the slow tool
    pool.shutdown(wait=False)


async def test_an_async_tool_is_awaited_with_its_timeout():
    store, gen = ExperienceStore(["a", "b"]), FakeGenerator()
    ctx = make_ctx(store, gen)

    async def tool(x):
        await asyncio.sleep(0.01)
        return x * 2

    assert await ctx.call(tool, 21) == 42
    with pytest.raises(TimeoutError):
        await ctx.call(asyncio.sleep, 1.0, timeout=0.05)


async def test_identical_prompts_from_two_concurrent_branches_get_the_same_seeds_whichever_calls_first():
    """Two branches send agent "a" the same prompt; which one calls first is decided by
    the test (as latency would decide it). Each branch draws the same seeds either way."""

    async def seeds_by_branch(first: str) -> dict:
        store = ExperienceStore(["a"])
        released = {"left": asyncio.Event(), "right": asyncio.Event()}
        seeds = {}
        gen = FakeGenerator()

        async def branch(ctx, name):
            await released[name].wait()
            samples = await ctx.generate("a", [4, 2])
            seeds[name] = [request_seed(7, s.key, s.member) for s in samples]
            for s in samples:
                ctx.reward(s, 0.0)
            if name == first:
                released["right" if first == "left" else "left"].set()

        async def episode(ctx):
            released[first].set()
            await asyncio.gather(branch(ctx, "left"), branch(ctx, "right"))

        assert await run_episode(episode, make_ctx(store, gen), 5.0) == ""
        assert [agent for agent, _ in gen.batches] == ["a", "a"]
        assert gen.batches[0][1][0].startswith("e0/") and seeds[first] != []
        return seeds

    left_first, right_first = await seeds_by_branch("left"), await seeds_by_branch("right")
    assert left_first == right_first
    assert left_first["left"] != left_first["right"]


async def test_a_frozen_agents_samples_need_no_reward_and_are_served_when_the_episode_ends():
    from flexmarl.runtime import events as ev

    events = []
    store = ExperienceStore(["a", "judge"], emit=events.append, frozen=["judge"])
    ctx = EpisodeContext("e0", 1, random.Random(0), store, FakeGenerator(),
                         {"a": AgentDefaults(2, 1.0, 2), "judge": AgentDefaults(1, 1.0, 2, frozen=True)}, run_seed=7)

    async def judged(ctx):
        answers = await ctx.generate("a", [1, 2])
        for a in answers:
            verdicts = await ctx.generate("judge", a.output_ids)
            ctx.reward(a, float(verdicts[0].output_ids[0] % 2))
            ctx.reward(verdicts[1], 1.0)  # a reward given to a frozen agent's sample is recorded, not trained
            assert verdicts[0].status == "pending"  # until its episode ends

    assert await run_episode(judged, ctx, 5.0) == ""
    assert store.ready_samples("a", 1) == 2 and store.ready_samples("judge", 1) == 0
    assert store.count("judge", "served") == 4 and store.kept_views("judge") == []
    served = [e for e in events if isinstance(e, ev.GroupServed)]
    assert [(e.agent, e.n, e.rewards) for e in served] == [("judge", 2, [1.0]), ("judge", 2, [1.0])]


async def test_a_failed_episode_drops_its_frozen_agents_groups_too():
    store = ExperienceStore(["a", "judge"], frozen=["judge"])
    ctx = EpisodeContext("e0", 1, random.Random(0), store, FakeGenerator(),
                         {"a": AgentDefaults(2, 1.0, 2), "judge": AgentDefaults(1, 1.0, 2, frozen=True)}, run_seed=7)

    async def broken(ctx):
        await ctx.generate("judge", [3])
        raise ValueError("bug")

    assert "bug" in await run_episode(broken, ctx, 5.0)
    assert store.count("judge", "dropped") == 2 and store.count("judge", "served") == 0


class ScoringGenerator(FakeGenerator):
    """A teacher's engine too: a scoring group gets -0.25 per scored id, at version 3."""

    async def generate(self, agent, group, after=""):
        if group.score_from >= 0:
            self.batches.append((agent, group.key, group.prompt_ids, group.score_from))
            scored = group.prompt_ids[group.score_from:]
            return output_of([scored], [[-0.25] * len(scored)], version=3)
        return await super().generate(agent, group, after)


async def test_a_distilled_agents_samples_are_scored_by_its_teacher_before_they_are_trainable():
    from flexmarl.controller.state.decisions import MicroBatchSize
    from flexmarl.runtime import events as ev
    from flexmarl.runtime import protocol

    events, gen = [], ScoringGenerator()
    store = ExperienceStore(["s", "t"], emit=events.append, frozen=["t"], teachers={"s": "t"})
    ctx = EpisodeContext("e0", 1, random.Random(0), store, gen,
                         {"s": AgentDefaults(3, 1.0, 2, teacher="t"), "t": AgentDefaults(1, 1.0, 2, frozen=True)},
                         run_seed=7)

    async def student(ctx):
        for s in await ctx.generate("s", [1, 2]):
            ctx.reward(s, float(s.output_ids[0] % 2))
        assert store.ready_samples("s", 1) == 0  # rewarded, not yet scored: not trainable

    assert await run_episode(student, ctx, 5.0) == ""
    assert store.ready_samples("s", 1) == 2
    scoring = [b for b in gen.batches if len(b) == 4]
    assert [(agent, prompt[:2], start) for agent, _, prompt, start in scoring] == [("t", [1, 2], 2)] * 2
    assert [key for _, key, _, _ in scoring] == [store.kept_views("s")[0].key] * 2  # the student's group names them
    (mb,) = store.form_micro_batches("s", 1, MicroBatchSize(2), True, False, 0)
    (group,) = mb.wire()  # the teacher's logprobs travel as a column of the group, packed as its outputs
    assert group.teacher_logprobs == protocol.packed(protocol.LOGPROB_TYPECODE, [-0.25] * 6)
    scored = [e for e in events if isinstance(e, ev.TeacherScored)]
    assert [(e.agent, e.teacher, e.batch, e.versions) for e in scored] == [("s", "t", 1, [3, 3])]
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("TeacherScored") < kinds.index("GroupComplete")


class TopKScoringGenerator(FakeGenerator):
    """A teacher's engine that also answers a scoring group's top k: at each scored position
    ids 0..k-1 (`short`: one position fewer), logprob -(rank + 1)."""

    def __init__(self, short=False):
        super().__init__()
        self.asked, self.short = [], short

    async def generate(self, agent, group, after=""):
        from flexmarl.controller.state.groups import GroupOutput
        from flexmarl.runtime import protocol

        if group.score_from < 0:
            return await super().generate(agent, group, after)
        self.asked.append(group.score_top_k)
        scored, k = group.prompt_ids[group.score_from:], group.score_top_k
        positions = len(scored) - self.short
        return GroupOutput([(protocol.GroupResult(
            group.key, group.first, 0, [len(scored)], protocol.packed("i", scored),
            protocol.packed("f", [-0.25] * len(scored)), ["score"], turn=group.turn,
            top_ids=protocol.packed("i", list(range(k)) * positions),
            top_logprobs=protocol.packed("f", [-(r + 1.0) for r in range(k)] * positions)), "w")])


@pytest.mark.parametrize("short", [False, True], ids=["whole", "a-position-short"])
async def test_a_teachers_top_k_travels_with_the_group_to_the_trainer(short):
    from flexmarl.controller.state.decisions import MicroBatchSize
    from flexmarl.runtime import protocol

    gen = TopKScoringGenerator(short)
    store = ExperienceStore(["s", "t"], frozen=["t"], teachers={"s": "t"})
    ctx = EpisodeContext("e0", 1, random.Random(0), store, gen,
                         {"s": AgentDefaults(3, 1.0, 2, teacher="t", teacher_top_k=2),
                          "t": AgentDefaults(1, 1.0, 2, frozen=True)}, run_seed=7)

    async def student(ctx):
        for s in await ctx.generate("s", [1, 2]):
            ctx.reward(s, 1.0)

    why = await run_episode(student, ctx, 5.0)
    assert gen.asked == [2, 2]  # each member's scoring asks for the agent's top k
    if short:
        assert "the teacher's top-2 arrays hold 4 ids and 4 logprobs for 3 output ids" in why
        return
    assert why == ""
    (mb,) = store.form_micro_batches("s", 1, MicroBatchSize(2), True, False, 0)
    (group,) = mb.wire()  # k per output id, packed as the outputs, member after member
    assert group.teacher_top_ids == protocol.packed(protocol.TOKEN_TYPECODE, [0, 1] * 6)
    assert group.teacher_top_logprobs == protocol.packed(protocol.LOGPROB_TYPECODE, [-1.0, -2.0] * 6)


async def test_the_running_task_is_read_as_asyncio_reads_it_in_a_task_and_in_a_callback():
    from flexmarl.controller.episodes.workflow import _current_task

    loop = asyncio.get_running_loop()
    seen = []

    async def branch():
        seen.append((_current_task(loop), asyncio.current_task()))
        loop.call_soon(lambda: seen.append((_current_task(loop), None)))  # a callback: no task runs it
        await asyncio.sleep(0.01)

    await asyncio.gather(branch(), branch())
    assert len(seen) == 4
    for mine, asyncios in seen:
        assert mine is asyncios
    assert seen[0][0] is not seen[1][0]

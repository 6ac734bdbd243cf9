"""Level 2 routing: the decision functions over plain numbers, and the rollout client that
routes whole groups, sends everything bound for one instance in one message, keeps a
conversation's turns on one instance and re-issues what a dead instance left unfinished."""

import asyncio
import gc
import random

import pytest
from fake_rollout import FakeServer, until

from flexmarl.controller.episodes.workflow import AgentDefaults, EpisodeContext
from flexmarl.controller.rollout.router import RolloutClient, coalesces, route_group, split_sizes, stays
from flexmarl.controller.state.instances import RolloutInstances
from flexmarl.controller.state.store import ExperienceStore
from flexmarl.runtime import protocol
from flexmarl.runtime.bases import whole_models
from flexmarl.runtime.keys import GroupKey
from flexmarl.workers.rollout.worker import RolloutHandler


def client_over(server, assignment, **options):
    """A rollout client whose instances serve `assignment` (agent -> workers, in order)."""
    instances = RolloutInstances(whole_models(list(assignment)))
    for agent, workers in assignment.items():
        for w in workers:
            instances.serve(w, agent, "placed by the test")
    server.on_died.append(lambda info: instances.died(info.worker_id))
    return RolloutClient(server, instances, **options)


def group(call, n=4, prompt=(1, 2), max_tokens=4, agent="a", seed=0, member=0, turn=0):
    return protocol.GenGroup(GroupKey("e", agent, call), agent, n, list(prompt), max_tokens, 1.0, seed, member,
                             turn=turn)


def made(output):
    """Per part of a group's output, in member order: its first member, size, version and instance."""
    return [(r.first, len(r.lengths), r.version, worker) for r, worker in output.parts]


def ctx_over(client, agents=("a",), group_size=8):
    defaults = {a: AgentDefaults(4, 1.0, group_size) for a in agents}
    return EpisodeContext("e0", 1, random.Random(0), ExperienceStore(list(agents)), client, defaults, run_seed=7)


def test_a_group_goes_to_the_less_loaded_of_two_instances_and_ties_to_the_first_in_order():
    rng, load = random.Random(0), {"r0": 100.0, "r1": 10.0, "r2": 10.0}.__getitem__
    assert route_group("least_loaded", ["r0", "r1"], load, 0, rng) == "r1"
    assert route_group("least_loaded", ["r1", "r2"], load, 0, rng) == "r1"
    picks = {route_group("least_loaded", ["r0", "r1", "r2"], load, 0, rng) for _ in range(50)}
    assert picks == {"r1", "r2"}  # whichever two are drawn, r0 loses
    assert [route_group("round_robin", ["r0", "r1"], load, turn, rng) for turn in range(3)] == ["r0", "r1", "r0"]
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        route_group("fastest", ["r0"], load, 0, rng)
    with pytest.raises(ValueError, match="no instance"):
        route_group("least_loaded", [], load, 0, rng)


def test_least_loaded_draws_two_distinct_instances_each_pair_alike():
    # Loads alike: the first in routing order of the two drawn takes the group, so instance i
    # of n takes 2 (n - 1 - i) / (n (n - 1)) of them, and the last none (the two are distinct).
    rng, n, draws = random.Random(3), 5, 40_000
    names = [f"r{i}" for i in range(n)]
    picks = [route_group("least_loaded", names, lambda w: 1.0, 0, rng) for _ in range(draws)]
    shares = [picks.count(w) / draws for w in names]
    expected = [2 * (n - 1 - i) / (n * (n - 1)) for i in range(n)]
    assert shares[-1] == 0
    assert all(abs(got - want) < 0.01 for got, want in zip(shares, expected)), (shares, expected)


def test_an_unknown_routing_policy_fails_the_client_at_once():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        RolloutClient(FakeServer([]), RolloutInstances(whole_models(["a"])), within_agent="fastest")


def test_a_group_is_split_only_above_an_instances_fair_share_into_contiguous_parts_of_at_least_min_part():
    assert split_sizes(8, 80, 40, 2, min_part=16) == [8]  # small groups stay whole, whatever the load
    assert split_sizes(64, 640, 1000, 4, min_part=16) == [64]  # within the fair share
    assert split_sizes(64, 640, 160, 4, min_part=16) == [16, 16, 16, 16]
    assert split_sizes(50, 500, 100, 8, min_part=16) == [17, 17, 16]  # no part under min_part
    assert split_sizes(64, 640, 160, 1, min_part=16) == [64]


def test_a_later_turn_stays_on_its_instance_within_the_bound():
    assert stays(30.0, 0.0, 40.0) and stays(100.0, 50.0, 1.0)
    assert not stays(300.0, 50.0, 40.0)


async def test_a_group_of_8_over_2_instances_lands_on_one_and_reaches_the_engine_as_one_request():
    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r0", "r1"]})
    ctx = ctx_over(client)
    task = asyncio.ensure_future(ctx.generate("a", [1, 2, 3], n=8))
    await until(lambda: server.sent)
    (worker, msg), = server.sent  # one message, to one instance
    (sent,) = msg.groups
    assert worker == "r0" and (sent.n, sent.first, sent.prompt_ids) == (8, 0, [1, 2, 3])
    server.answer(msg.request_id)
    samples = await task
    assert [s.output_ids.tolist() for s in samples] == [[7]] * 8

    class GroupingEngine:  # the engine's side: how requests are added
        added = []

        def add(self, request_id, prompt_ids, max_tokens, temperature, seed, n=1, **_):
            self.added.append((n, list(prompt_ids), seed))
            return -1

    handler = RolloutHandler()
    handler.engine, handler.agent = GroupingEngine(), "a"
    assert handler._start(msg) is None
    (n, prompt, seed), = GroupingEngine.added  # one engine request of 8 samples
    assert n == 8 and prompt == [1, 2, 3] and seed == sent.seed


async def test_a_second_turn_of_an_episode_goes_to_the_instance_of_its_first():
    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r0", "r1"]})
    ctx = ctx_over(client, group_size=2)
    task = asyncio.ensure_future(ctx.generate("a", [1, 2]))
    await until(lambda: len(server.sent) == 1)
    assert server.sent[0][0] == "r0"
    server.answer(server.sent[0][1].request_id)
    first, second = await task
    client.owner.add_work("r0", 5.0)  # another episode's work: by load alone r1 would take the turn
    turn = asyncio.ensure_future(ctx.continue_ids(first, [5]))
    await until(lambda: len(server.sent) == 2)
    worker, msg = server.sent[1]
    sent = msg.groups[0]
    assert worker == "r0" and (sent.key, sent.first, sent.turn) == (first.key, first.member, 1)
    server.answer(msg.request_id)
    assert (await turn).output_ids.tolist() == [7, 5, 7] and client.affinity == {"kept": 1, "moved": 0}


async def test_a_later_turn_leaves_an_instance_loaded_past_the_bound_or_no_longer_serving_the_agent():
    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r0", "r1"]})
    turn = group("g0", n=1, turn=1)
    client.owner.add_work("r0", 500.0)
    task = asyncio.ensure_future(client.generate("a", turn, after="r0"))
    await until(lambda: len(server.sent) == 1)
    assert server.sent[0][0] == "r1"
    server.answer(server.sent[0][1].request_id)
    await task
    client.owner.work_done("r0", 500.0)
    client.owner.leave("r0", "a", "moved by the test")
    task = asyncio.ensure_future(client.generate("a", group("g0", n=1, member=1, turn=1), after="r0"))
    await until(lambda: len(server.sent) == 2)
    assert server.sent[1][0] == "r1" and client.affinity == {"kept": 0, "moved": 2}
    server.answer(server.sent[1][1].request_id)
    await task


async def test_everything_bound_for_one_instance_in_one_loop_turn_goes_in_one_message():
    server = FakeServer(["r0"])
    client = client_over(server, {"a": ["r0"], "b": ["r0"]})  # r0 serves both (a base's agents, say)
    calls = [client.generate("a", group("g0")), client.generate("a", group("g1")),
             client.generate("b", group("g2", agent="b"))]
    tasks = [asyncio.ensure_future(c) for c in calls]
    await until(lambda: server.sent)
    await asyncio.sleep(0)
    (worker, msg), = server.sent
    assert [g.key.call for g in msg.groups] == ["g0", "g1", "g2"] and [g.agent for g in msg.groups] == ["a", "a", "b"]
    server.answer(msg.request_id)
    for task in tasks:
        assert (await task).n == 4
    assert client.outstanding["r0"] == 0


def test_a_group_shares_its_agents_instance_of_the_same_turn_only_within_the_slack():
    assert coalesces(100.0, 0.0, 256.0) and coalesces(356.0, 100.0, 256.0)
    assert not coalesces(357.0, 100.0, 256.0)
    assert not coalesces(0.0, 0.0, 0.0)  # 0: the rule alone


async def sent_for(groups, workers=4, **options):
    """The messages (instance, call names) the groups, all queued in one loop turn, went out in."""
    names = [f"r{i}" for i in range(workers)]
    server = FakeServer(names)
    client = client_over(server, {"a": names}, **options)
    tasks = [asyncio.ensure_future(client.generate("a", g)) for g in groups]
    await until(lambda: server.sent)
    await asyncio.sleep(0)
    sent = [(w, [g.key.call for g in m.groups]) for w, m in server.sent]
    for _, m in server.sent:
        server.answer(m.request_id)
    assert [(await t).n for t in tasks] == [g.n for g in groups]
    assert sum(client.outstanding.values()) == 0
    return sent


async def test_small_groups_of_one_turn_share_a_message_large_ones_and_round_robin_spread():
    small = [group(f"s{i}", n=4, prompt=(1, 2), max_tokens=4) for i in range(8)]  # 24 tokens each
    (worker, calls), = await sent_for(small)
    assert calls == [f"s{i}" for i in range(8)]  # 8 x 24 = 192 tokens: within 256 of an idle instance
    spread = await sent_for(small, coalesce_tokens=0)
    assert len(spread) > 1 and sorted(c for _, calls in spread for c in calls) == sorted(f"s{i}" for i in range(8))
    assert len(await sent_for(small, coalesce_tokens=48)) >= 3  # at most three groups to an instance (72 over 0)
    large = [group(f"l{i}", n=4, prompt=range(1, 101), max_tokens=100) for i in range(4)]  # 800 tokens each
    assert await sent_for(large[:2], workers=2) == [("r0", ["l0"]), ("r1", ["l1"])]  # 800 over 0: the idle one
    assert len(await sent_for(small, within_agent="round_robin")) == 4  # the static baseline, untouched


async def test_a_large_group_splits_into_contiguous_parts_that_keep_their_seeds_and_come_back_in_order():
    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r0", "r1"]})
    task = asyncio.ensure_future(client.generate("a", group("big", n=32, seed=100)))
    await until(lambda: len(server.sent) == 2)
    parts = {w: m.groups[0] for w, m in server.sent}
    assert [(p.first, p.n, p.seed) for p in (parts["r0"], parts["r1"])] == [(0, 16, 100), (16, 16, 116)]
    server.answer(server.sent[1][1].request_id, version=2)
    server.answer(server.sent[0][1].request_id, version=1)
    out = await task
    assert out.n == 32 and made(out) == [(0, 16, 1, "r0"), (16, 16, 2, "r1")]


async def test_groups_on_a_dead_instance_are_reissued_to_a_live_instance_of_the_agent():
    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r0", "r1"]})
    task = asyncio.ensure_future(client.generate("a", group("g", n=3)))
    await until(lambda: len(server.sent) == 1)
    assert server.sent[0][0] == "r0"
    server.kill("r0")
    await until(lambda: len(server.sent) == 2)
    worker, msg = server.sent[1]
    assert worker == "r1" and [(g.key.call, g.n) for g in msg.groups] == [("g", 3)]
    server.answer(msg.request_id)
    assert made(await task) == [(0, 3, 0, "r1")]
    assert client.reissued == 3 and client.outstanding["r0"] == 0 and client.outstanding["r1"] == 0


async def test_a_group_whose_instances_keep_dying_fails_instead_of_being_reissued_forever():
    from flexmarl.controller.rollout.router import RequestsFailed

    workers = [f"r{i}" for i in range(5)]
    server = FakeServer(workers)
    client = client_over(server, {"a": list(workers)})
    task = asyncio.ensure_future(client.generate("a", group("g", n=1)))
    for attempt in range(client.max_attempts):
        await until(lambda: len(server.sent) == attempt + 1)
        server.kill(server.sent[-1][0])  # e.g. a request that crashes every engine it reaches
    with pytest.raises(RequestsFailed, match=f"failed on {client.max_attempts} instances in a row"):
        await task
    assert len(server.sent) == client.max_attempts  # never sent to a fourth instance
    assert sum(w.alive for w in server.registry.workers.values()) == 5 - client.max_attempts


async def test_a_refused_group_fails_alone_and_is_never_reissued():
    from flexmarl.controller.rollout.router import RequestRefused

    server = FakeServer(["r0"])
    client = client_over(server, {"a": ["r0"]})
    good = asyncio.ensure_future(client.generate("a", group("ok")))
    bad = asyncio.ensure_future(client.generate("a", group("long", prompt=[1] * 99)))
    await until(lambda: len(server.sent) == 1)  # both in one message
    server.answer(server.sent[0][1].request_id, refuse=frozenset({"long"}))
    assert (await good).n == 4
    with pytest.raises(RequestRefused, match="refused e/a-long: prompt too long"):
        await bad
    await asyncio.sleep(0.01)
    assert len(server.sent) == 1 and client.refused == 1 and client.reissued == 0
    assert client.outstanding["r0"] == 0


async def test_a_cancelled_group_is_aborted_on_its_instance_comes_back_once_and_is_never_reissued():
    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r0"]})
    doomed = asyncio.ensure_future(client.generate("a", group("doomed", n=3)))
    kept = asyncio.ensure_future(client.generate("a", group("kept")))
    await until(lambda: len(server.sent) == 1)
    request = server.sent[0][1].request_id
    doomed.cancel()  # its episode was abandoned
    await until(lambda: len(server.sent) == 2)
    worker, abort = server.sent[1]
    assert worker == "r0" and isinstance(abort, protocol.AbortGroups)
    assert [(k.call, f, t) for k, f, t in zip(abort.keys, abort.firsts, abort.turns)] == [("doomed", 0, 0)]
    assert client.outstanding["r0"] > 0  # its work counts until it comes back
    server.answer(request, aborted=frozenset({"doomed"}))
    assert (await kept).n == 4 and doomed.cancelled()
    assert client.refused == 0 and client.aborted == 1 and client.outstanding["r0"] == 0
    # Its instance dies with the abort in flight: what it held is never routed again.
    client.owner.serve("r1", "a", "placed by the test")
    lost = asyncio.ensure_future(client.generate("a", group("lost")))
    await until(lambda: len(server.sent) == 3)
    lost.cancel()
    await until(lambda: len(server.sent) == 4 and isinstance(server.sent[3][1], protocol.AbortGroups))
    unretrieved: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
    server.kill("r0")
    await asyncio.sleep(0.01)
    assert len(server.sent) == 4 and client.reissued == 0
    assert client.outstanding["r0"] == 0 and client.outstanding["r1"] == 0
    server.sent.clear()
    server.streams.clear()
    gc.collect()  # the dead message's future, gone: its WorkerDied was read, so nothing is reported
    assert unretrieved == []


async def test_an_instance_removed_from_the_assignment_gets_no_new_groups():
    server = FakeServer(["r0", "r1"])
    client = client_over(server, {"a": ["r1"]})  # r0 is draining for a move
    tasks = [asyncio.ensure_future(client.generate("a", group(f"g{i}"))) for i in range(16)]
    await until(lambda: len(server.sent) >= 1)
    assert {w for w, _ in server.sent} == {"r1"}
    for _, msg in list(server.sent):
        server.answer(msg.request_id)
    assert len(await asyncio.gather(*tasks)) == 16


async def test_a_group_waits_for_an_instance_to_serve_its_agent_then_goes_there():
    server = FakeServer(["r0"])
    client = client_over(server, {"a": []})
    task = asyncio.ensure_future(client.generate("a", group("g")))
    await asyncio.sleep(0.05)
    assert server.sent == []
    client.owner.serve("r0", "a", "joined")
    await asyncio.sleep(0.25)  # the waiting group looks every 0.1 s
    server.answer(server.sent[0][1].request_id)
    assert made(await task) == [(0, 4, 0, "r0")]


async def test_prompt_tokens_and_prefix_cache_hits_are_counted_per_agent_for_first_and_later_turns():
    server = FakeServer(["r0"])
    client = client_over(server, {"a": ["r0"]})
    first = asyncio.ensure_future(client.generate("a", group("g", n=4, prompt=[1] * 10)))
    later = asyncio.ensure_future(client.generate("a", group("g", n=1, prompt=[1] * 30, turn=1), after="r0"))
    await until(lambda: server.sent)
    server.answer(server.sent[0][1].request_id, cached=8)
    await asyncio.gather(first, later)
    # vLLM counts a group's cached prompt once: its first member is counted as finding none
    assert client.prompt_counts["a"] == {"prompt_tokens": 40, "cached_tokens": 24, "turn_prompt_tokens": 30,
                                         "turn_cached_tokens": 8}


async def test_requests_wait_for_an_instance_while_one_is_restarting_and_then_the_run_stops_saying_why():
    from flexmarl.controller.rollout.router import NoInstance
    from flexmarl.controller.state.failures import RunFailed

    server = FakeServer(["r0"])
    client = client_over(server, {"a": ["r0"]})
    client.instance_wait_s = 0.3
    restarting = [True]
    client.instance_expected = lambda: restarting[0]
    server.kill("r0")
    server.registry.workers["r0"].why_gone = "no heartbeat for 10.7s (timeout 10.0s)"
    client.owner.died("r0")
    task = asyncio.ensure_future(client.generate("a", group("g")))
    await asyncio.sleep(0.6)  # past instance_wait_s: still waiting, a restart is under way
    assert not task.done()
    restarting[0] = False  # the restart gave up (or none is coming): the wait runs out
    with pytest.raises(NoInstance) as info:
        await task
    assert isinstance(info.value, RunFailed)  # the run's failure, not the episode's
    assert str(info.value) == ("the run stopped: no rollout instance could be made to serve agent 'a' for 0.3s: none "
                               "is being restarted or admitted; gone: r0 (no heartbeat for 10.7s (timeout 10.0s)). See the workers' "
                               "logs in the run directory's logs/ folder")

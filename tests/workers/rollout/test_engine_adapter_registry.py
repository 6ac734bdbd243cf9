"""The engine's adapter bookkeeping without an engine: a version stays while a request
uses it and goes with its last one, the newest always stays, ids are never reused, and a
version past the capacity is refused before anything changes."""

import pytest

from flexmarl.workers.rollout.engine_adapters import AdapterRegistry, AdapterSlotsFull, ResidentAdapter


def load(reg, agent, version):
    reg.check_room(agent, version)
    adapter = ResidentAdapter(agent, version, reg.reserve_id(), f"/mem/{agent}{version}")
    reg.add(adapter)
    return reg.retire()


def test_an_old_version_goes_with_the_last_request_that_uses_it():
    reg = AdapterRegistry(capacity=2)
    load(reg, "a", 0)
    reg.use("r1", reg.resolve("a")), reg.use("r2", reg.resolve("a", 0))
    assert load(reg, "a", 1) == []  # version 0 is in use
    assert reg.resident() == [("a", 0), ("a", 1)] and reg.resolve("a").version == 1
    reg.release("r1")
    assert reg.retire() == []
    reg.release("r2")
    assert [r.name for r in reg.retire()] == ["a@0"]
    assert reg.resident() == [("a", 1)]


def test_the_newest_version_stays_unused_and_an_unused_old_one_goes_at_once():
    reg = AdapterRegistry(capacity=2)
    load(reg, "a", 0)
    assert reg.retire() == []
    assert [r.name for r in load(reg, "a", 1)] == ["a@0"]


def test_a_version_past_the_capacity_is_refused_and_nothing_changes():
    reg = AdapterRegistry(capacity=2)
    load(reg, "a", 0), load(reg, "b", 0)
    reg.use("r", reg.resolve("a"))
    with pytest.raises(AdapterSlotsFull, match="a@1 does not fit"):
        reg.check_room("a", 1)
    assert reg.resident() == [("a", 0), ("b", 0)]
    assert load(reg, "b", 1)[0].name == "b@0"  # b's old version was unused: room for its new one
    with pytest.raises(ValueError, match="not newer"):
        reg.check_room("b", 1)


def test_ids_are_never_reused_and_names_tell_versions_apart():
    reg = AdapterRegistry(capacity=4)
    load(reg, "a", 0), load(reg, "a", 1), load(reg, "a", 2)
    held = reg.resolve("a")
    assert (held.name, held.lora_id) == ("a@2", 3)
    with pytest.raises(KeyError, match="version 0 is not loaded"):
        reg.resolve("a", 0)


def test_a_request_issued_under_a_retired_version_runs_under_the_newer_one_never_an_older():
    reg = AdapterRegistry(capacity=4)
    load(reg, "a", 1)
    load(reg, "a", 2)  # version 1 unused: retired
    assert reg.serving("a", 1).version == 2  # the instance moved ahead during a sync
    assert reg.serving("a", 2).version == 2 and reg.serving("a").version == 2
    with pytest.raises(KeyError, match="version 3 is not loaded"):
        reg.serving("a", 3)  # behind what the request was issued under: refused


def test_a_move_puts_a_new_version_in_the_newest_ones_slot_and_notes_where_each_request_moved():
    reg = AdapterRegistry(capacity=2)
    load(reg, "a", 0), load(reg, "b", 0)
    slot = reg.resolve("a").lora_id
    reg.use("r", reg.resolve("a")), reg.use("q", reg.resolve("b"))
    so_far = {"r": {0: 5, 2: 4}}  # sample 1 finished before the move
    moved, old = reg.move("a", 1, "/mem/a1", lambda request: so_far[request])
    assert (moved.name, moved.lora_id, moved.path, old) == ("a@1", slot, "/mem/a1", "/mem/a0")
    assert reg.resident() == [("a", 1), ("b", 0)] and reg.retire() == []  # no room needed, nothing to retire
    so_far["r"] = {0: 7}
    reg.move("a", 3, "/mem/a3", lambda request: so_far[request])
    with pytest.raises(ValueError, match="not newer"):
        reg.move("a", 3, "/mem/again", lambda request: {})
    moves = reg.release("r")
    assert moves.token_versions([8, 3, 6]) == [0] * 5 + [1] * 2 + [3] + [0] * 3 + [0] * 4 + [1] * 2
    assert reg.release("q") is None  # never moved: its version throughout
    assert reg.release("r") is None

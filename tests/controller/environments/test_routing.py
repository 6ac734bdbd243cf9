"""Where an environment call goes: the routing rules over plain counts."""

from flexmarl.controller.environments import routing


def test_a_call_goes_to_the_worker_with_the_fewest_calls_in_flight_per_process():
    assert routing.least_loaded({"env-0": 4, "env-1": 3}, {"env-0": 2, "env-1": 1}) == "env-0"  # 2 per process vs 3
    assert routing.least_loaded({"env-0": 1}, {"env-0": 2, "env-1": 2}) == "env-1"  # one it never sent to


def test_ties_go_to_the_first_worker_by_id_so_the_same_counts_choose_the_same():
    assert routing.least_loaded({}, {"env-1": 2, "env-0": 2}) == "env-0"
    assert routing.place_session({}, {}, {"env-1": 2, "env-0": 2}) == "env-0"


def test_no_worker_set_up_routes_nowhere():
    assert routing.least_loaded({"env-0": 0}, {}) is None
    assert routing.place_session({}, {}, {}) is None


def test_a_session_opens_where_fewest_sessions_live_then_where_load_is_least():
    capacity = {"env-0": 2, "env-1": 2, "env-2": 2}
    assert routing.place_session({"env-0": 1, "env-1": 0, "env-2": 0}, {"env-1": 3}, capacity) == "env-2"
    assert routing.place_session({"env-0": 1, "env-1": 1, "env-2": 1}, {"env-0": 1}, capacity) == "env-1"


def test_only_a_stateless_call_with_tries_left_is_sent_again_after_its_worker_died():
    assert routing.retry_after_loss(tries=1, retries=1, in_session=False)
    assert not routing.retry_after_loss(tries=2, retries=1, in_session=False)  # sent twice: its last try
    assert not routing.retry_after_loss(tries=1, retries=0, in_session=False)  # retries off: it fails
    assert not routing.retry_after_loss(tries=1, retries=5, in_session=True)  # its state died with the worker

"""The staleness rule (runtime/staleness.py): a sample's lag counts its oldest turn, and
the bound k admits a lag of exactly k."""

from hypothesis import given
from hypothesis import strategies as st

from flexmarl.runtime.staleness import lag, too_stale


def test_a_single_turn_sample_lags_by_the_versions_between_its_policy_and_the_trainer():
    assert lag(5, [5]) == 0
    assert lag(5, [3]) == 2


def test_a_conversation_lags_by_its_oldest_turn():
    assert lag(7, [6, 4, 7]) == 3
    assert lag(7, iter([6, 4, 7])) == 3  # any iterable of versions, read once


def test_the_bound_admits_a_lag_of_exactly_k_and_refuses_one_more():
    assert not too_stale(5, [3], max_staleness=2)
    assert too_stale(5, [2], max_staleness=2)


def test_k_zero_admits_only_samples_of_the_trainers_own_version():
    assert not too_stale(4, [4, 4], max_staleness=0)
    assert too_stale(4, [4, 3], max_staleness=0)


@given(st.integers(0, 50), st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(0, 5))
def test_a_sample_is_too_stale_exactly_when_any_of_its_turns_is(trainer_version, versions, k):
    assert too_stale(trainer_version, versions, k) == any(trainer_version - v > k for v in versions)

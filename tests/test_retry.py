"""RetryPolicy: the delay of each back-off strategy, the cap, and jitter that only ever shortens."""

from __future__ import annotations

import random

import pytest

from taskflow.engine.retry import RetryPolicy
from taskflow.models import RetryStrategy, ScheduleCfg


def const(value: float):  # noqa: ANN201
    """A `rand` that always returns `value`, so every delay is exact."""
    return lambda: value


def test_fixed_waits_the_interval_every_time() -> None:
    policy = RetryPolicy(RetryStrategy.FIXED, interval=7.0, max_interval=100.0, jitter=0.0)
    assert [policy.next_delay(n, const(0.5)) for n in range(1, 6)] == [7.0] * 5


def test_exponential_doubles_from_the_interval_up_to_the_cap() -> None:
    policy = RetryPolicy(RetryStrategy.EXPONENTIAL, interval=10.0, max_interval=100.0, jitter=0.0)
    assert [policy.next_delay(n, const(0.5)) for n in range(1, 8)] == [10.0, 20.0, 40.0, 80.0, 100.0, 100.0, 100.0]


@pytest.mark.parametrize("strategy", RetryStrategy.values)
def test_any_attempt_number_a_task_allows_gets_a_capped_delay(strategy: str) -> None:
    # A task may allow up to 2**31 - 1 retries; 2 ** 1024 used to overflow converting to a float,
    # and the state machine raised instead of retrying.
    policy = RetryPolicy(strategy, interval=10.0, max_interval=3600.0, jitter=0.0)
    assert [policy.next_delay(n, const(0.5)) for n in (1025, 5000, 2**31 - 1)] == [
        10.0 if strategy == RetryStrategy.FIXED else 3600.0
    ] * 3


def test_polynomial_follows_sidekiqs_formula() -> None:
    # n^4 + 15 + rand * 30 * (n + 1), with rand = 0.5.
    policy = RetryPolicy(RetryStrategy.POLYNOMIAL, interval=999.0, max_interval=10**9, jitter=0.0)
    expected = [n**4 + 15 + 0.5 * 30 * (n + 1) for n in range(1, 9)]
    assert [policy.next_delay(n, const(0.5)) for n in range(1, 9)] == expected
    assert expected[:3] == [46.0, 76.0, 156.0]
    # The spread is Sidekiq's own: rand = 0 gives the bare polynomial, the interval plays no part.
    assert policy.base_delay(3, const(0.0)) == 81 + 15


def test_polynomial_is_capped_too() -> None:
    policy = RetryPolicy(RetryStrategy.POLYNOMIAL, max_interval=500.0, jitter=0.0)
    assert policy.next_delay(10, const(0.0)) == 500.0


def test_attempt_zero_or_negative_counts_as_the_first_retry() -> None:
    policy = RetryPolicy(RetryStrategy.EXPONENTIAL, interval=3.0, max_interval=100.0, jitter=0.0)
    assert policy.next_delay(0, const(0.0)) == policy.next_delay(-2, const(0.0)) == 3.0


@pytest.mark.parametrize("strategy", list(RetryStrategy))
def test_jitter_only_shortens_and_never_exceeds_the_cap(strategy: str) -> None:
    policy = RetryPolicy(strategy, interval=4.0, max_interval=60.0, jitter=0.25)
    rng = random.Random(1234)
    for attempt in range(1, 12):
        for _ in range(50):
            value = rng.random()
            capped = min(policy.base_delay(attempt, const(value)), 60.0)
            delay = policy.next_delay(attempt, const(value))
            assert capped * 0.75 <= delay <= capped <= 60.0
    # The extremes: rand = 0 takes nothing off, rand = 1 takes off the whole jitter fraction.
    for value, kept in ((0.0, 1.0), (1.0, 0.75)):
        top = min(policy.base_delay(20, const(value)), 60.0)
        assert policy.next_delay(20, const(value)) == pytest.approx(top * kept)


def test_jitter_spreads_delays_of_tasks_that_failed_together() -> None:
    policy = RetryPolicy(RetryStrategy.EXPONENTIAL, interval=10.0, max_interval=3600.0, jitter=0.5)
    rng = random.Random(7)
    delays = {round(policy.next_delay(3, rng.random), 6) for _ in range(20)}
    assert len(delays) > 10
    assert all(20.0 <= d <= 40.0 for d in delays)


def test_full_jitter_never_goes_negative() -> None:
    policy = RetryPolicy(RetryStrategy.FIXED, interval=5.0, max_interval=10.0, jitter=1.0)
    assert policy.next_delay(1, const(0.999999)) >= 0.0
    assert policy.next_delay(1, const(1.0)) == 0.0


def test_unknown_strategy_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown retry strategy"):
        RetryPolicy("lunar", interval=1.0).next_delay(1, const(0.0))


def test_policy_comes_from_the_types_schedule_config() -> None:
    cfg = ScheduleCfg(
        task_type="x",
        retry_strategy=RetryStrategy.FIXED,
        retry_interval=2.5,
        max_retry_interval=9.0,
        retry_jitter=0.3,
    )
    assert RetryPolicy.for_config(cfg) == RetryPolicy(RetryStrategy.FIXED, 2.5, 9.0, 0.3)

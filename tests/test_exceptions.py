"""The handler signals check what they carry when they are raised (no database needed)."""

from __future__ import annotations

import pytest

from taskflow import InvalidTask, NextStage, PermanentFailure, Snooze, exceptions
from taskflow.engine import validation

YEAR = 365 * 24 * 3600


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Snooze(float("inf")), "Snooze delay must be a number of seconds from 0 to 31536000 (a year); got inf"),
        (lambda: Snooze(float("nan")), "Snooze delay"),
        (lambda: Snooze(-1), "Snooze delay"),
        (lambda: Snooze(YEAR + 1), "Snooze delay"),
        (lambda: Snooze(10**400), "Snooze delay"),
        (lambda: Snooze("5"), "Snooze delay"),
        (lambda: Snooze(True), "Snooze delay"),
        (lambda: Snooze(1, reason=404), "Snooze reason must be a string of at most 4000 characters; got 404"),
        (lambda: PermanentFailure(404), "PermanentFailure reason must be a string of at most 4000 characters; got 404"),
        (lambda: PermanentFailure(None), "PermanentFailure reason"),
        (lambda: PermanentFailure("x" * 4001), "PermanentFailure reason"),
        (lambda: NextStage("two", priority=500), "NextStage priority must be an integer from -100 to 100; got 500"),
        (lambda: NextStage("two", priority=-101), "NextStage priority"),
        (lambda: NextStage("two", priority=1.5), "NextStage priority"),
        (lambda: NextStage("two", priority=True), "NextStage priority"),
        (lambda: NextStage("s" * 101), "NextStage stage must be a string of at most 100 characters"),
        (lambda: NextStage(7), "NextStage stage"),
        (lambda: NextStage("two", delay=float("inf")), "NextStage delay"),
        (lambda: NextStage("two", context={"at": object()}), "NextStage context must be JSON-serialisable"),
        (lambda: NextStage("two", context={"x": float("nan")}), "NextStage context must be JSON-serialisable"),
        (lambda: NextStage("two", context=nested(100_000)), "NextStage context must be JSON-serialisable"),
    ],
)
def test_a_malformed_signal_raises_invalid_task_naming_the_problem(make, message) -> None:
    with pytest.raises(InvalidTask) as raised:
        make()
    assert str(raised.value).startswith(message)


def test_a_long_value_is_shown_shortened_in_the_message() -> None:
    with pytest.raises(InvalidTask) as raised:
        PermanentFailure("x" * 5000)
    assert len(str(raised.value)) < 200


def test_well_formed_signals_keep_their_values() -> None:
    snooze = Snooze(2, "busy")
    assert (snooze.delay, snooze.reason, str(snooze)) == (2.0, "busy", "busy")
    assert Snooze(YEAR).delay == YEAR and Snooze(0).reason == ""
    assert PermanentFailure("gone").reason == "gone"
    step = NextStage("s" * 100, context={"n": [1, 2]}, delay=1.5, priority=-100)
    assert (step.stage, step.context, step.delay, step.priority) == ("s" * 100, {"n": [1, 2]}, 1.5, -100)
    assert NextStage("", priority=100).priority == 100 and NextStage("b").priority is None


def test_the_signals_priority_range_is_the_enqueue_range() -> None:
    # exceptions.py cannot import the engine (the engine imports it), so the range is written twice.
    assert (exceptions.MIN_PRIORITY, exceptions.MAX_PRIORITY) == (validation.MIN_PRIORITY, validation.MAX_PRIORITY)

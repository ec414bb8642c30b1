"""Errors raised by taskflow, and the control-flow signals a handler may raise."""

from __future__ import annotations

import json
from typing import Any


class TaskflowError(Exception):
    """Base class of every taskflow error."""


class InvalidTask(TaskflowError, ValueError):
    """An enqueue request is malformed; nothing was written."""


class StaleVersion(TaskflowError):
    """A newer version of the same task identity already exists."""

    def __init__(self, task_type: str, key: str, version: int, newest: int) -> None:
        self.task_type, self.key, self.version, self.newest = task_type, key, version, newest
        super().__init__(f"{task_type}/{key}: version {version} is older than the newest known version {newest}")


class InvalidSchedule(TaskflowError, ValueError):
    """A periodic schedule is malformed (bad cron, time zone, interval, ...); `field` names the culprit."""

    def __init__(self, message: str, field: str = "") -> None:
        self.field = field
        super().__init__(message)


class UnknownTaskType(TaskflowError):
    """No handler is registered for a task type."""


class LeaseLost(TaskflowError):
    """This attempt no longer owns its task (it was rescued or stopped): stop working on it.

    Raised by ctx.heartbeat() and ctx.save_checkpoint(); let it propagate, nothing is written for a lost attempt.
    """


class TaskControl(Exception):  # noqa: N818 - these are signals, not errors
    """Raised by a handler (usually through its context) to end an attempt in a chosen way.

    Each signal checks its arguments when it is created and raises InvalidTask if one is malformed,
    so the mistake shows up in the handler's own traceback and fails only that task.
    """


# Bounds of what a signal may carry. A delay past a year is a bug (and datetimes overflow near year
# 9999); reasons end up in status_msg. Kept here rather than imported from engine.validation, which
# imports this module; tests check that the priority range is the same as validation's.
MAX_DELAY = 365 * 24 * 3600.0
MAX_REASON = 4000
MAX_STAGE = 100
MIN_PRIORITY, MAX_PRIORITY = -100, 100


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _seconds(signal: str, value: object) -> float:
    seconds = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = None
    if seconds is None or not 0 <= seconds <= MAX_DELAY:  # NaN fails the comparison too
        raise InvalidTask(
            f"{signal} delay must be a number of seconds from 0 to {MAX_DELAY:.0f} (a year); got {_shown(value)}"
        )
    return seconds


def _reason(signal: str, value: object) -> str:
    if not isinstance(value, str) or len(value) > MAX_REASON:
        raise InvalidTask(f"{signal} reason must be a string of at most {MAX_REASON} characters; got {_shown(value)}")
    return value


class Snooze(TaskControl):
    """Run the task again after `delay` seconds without using up an attempt."""

    def __init__(self, delay: float, reason: str = "") -> None:
        self.delay, self.reason = _seconds("Snooze", delay), _reason("Snooze", reason)
        super().__init__(reason or f"snoozed for {delay}s")


class PermanentFailure(TaskControl):
    """Fail the task now, whatever retries are left."""

    def __init__(self, reason: str) -> None:
        self.reason = _reason("PermanentFailure", reason)
        super().__init__(reason)


class NextStage(TaskControl):
    """Requeue the task at its next stage, with a fresh retry budget."""

    def __init__(
        self,
        stage: str,
        *,
        context: Any = None,
        delay: float = 0.0,
        priority: int | None = None,
    ) -> None:
        if not isinstance(stage, str) or len(stage) > MAX_STAGE:
            raise InvalidTask(
                f"NextStage stage must be a string of at most {MAX_STAGE} characters; got {_shown(stage)}"
            )
        if priority is not None and (
            isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY
        ):
            raise InvalidTask(
                f"NextStage priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}; got {_shown(priority)}"
            )
        try:
            json.dumps(context, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidTask(f"NextStage context must be JSON-serialisable: {exc}") from None
        self.stage, self.context, self.delay, self.priority = stage, context, _seconds("NextStage", delay), priority
        super().__init__(f"next stage {stage!r}")


# Why an attempt ended without an exception of its own: named in the attempt's schedule-log entry
# (and so in a django.tasks result's errors) the way a handler's exception class is.
class AttemptTimedOut(TaskflowError):
    """The attempt ran past its deadline without a heartbeat, and taskwatch took it away."""


class WorkerLost(TaskflowError):
    """The worker running the attempt stopped heartbeating, and taskwatch took the attempt away."""


class AttemptInterrupted(TaskflowError):
    """The worker stopped (its grace period ended) before the attempt finished."""


class TaskStopped(TaskflowError):
    """An operator, a newer version or an expiry rule stopped the task."""


class InvalidResult(InvalidTask, TypeError):
    """A task returned a value that is not JSON: the task fails at once, since a retry would do the same."""


def class_path(exc: BaseException | type[BaseException]) -> str:
    """The importable path of an exception's class, e.g. "builtins.ValueError"."""
    cls = exc if isinstance(exc, type) else type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"

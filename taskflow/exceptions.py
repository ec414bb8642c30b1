"""Errors raised by taskflow, and the control-flow signals a handler may raise."""

from __future__ import annotations

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


class UnknownTaskType(TaskflowError):
    """No handler is registered for a task type."""


class LeaseLost(TaskflowError):
    """This attempt no longer owns its task (it was rescued or stopped): stop working on it.

    Raised by ctx.heartbeat() and ctx.save_checkpoint(); let it propagate, nothing is written for a lost attempt.
    """


class TaskControl(Exception):  # noqa: N818 - these are signals, not errors
    """Raised by a handler (usually through its context) to end an attempt in a chosen way."""


class Snooze(TaskControl):
    """Run the task again after `delay` seconds without using up an attempt."""

    def __init__(self, delay: float, reason: str = "") -> None:
        self.delay, self.reason = float(delay), reason
        super().__init__(reason or f"snoozed for {delay}s")


class PermanentFailure(TaskControl):
    """Fail the task now, whatever retries are left."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
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
        self.stage, self.context, self.delay, self.priority = stage, context, float(delay), priority
        super().__init__(f"next stage {stage!r}")

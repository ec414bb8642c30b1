"""What a handler receives: the task's data and the calls it may make during its attempt."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NoReturn

from ..engine import attempts
from ..engine.attempts import ClaimedTask
from ..exceptions import NextStage, PermanentFailure, Snooze


class TaskContext:
    """The running attempt of one task, handed to its handler."""

    def __init__(self, task: ClaimedTask) -> None:
        self._task = task
        self.task_id = task.id
        self.task_type = task.task_type
        self.key = task.key
        self.version = task.version
        self.priority = task.priority
        self.payload = task.payload
        self.attempt = task.attempt
        self.max_retries = task.max_retries
        self.stage = task.stage
        self.context = task.context
        self.checkpoint = task.checkpoint
        self.trace_id = task.trace_id
        self.worker_id = task.worker_id

    @property
    def stop_requested(self) -> bool:
        """True once this attempt was taken away (an operator stopped the task, or it was rescued).

        Seen within about a second with Redis, else at the worker's next liveness beat. A long
        handler should check it between steps and return: whatever it reports now is refused.
        """
        return self._task.stop_requested.is_set()

    @property
    def deadline(self) -> datetime:
        """When this attempt times out unless the handler heartbeats or saves a checkpoint."""
        return self._task.lease_expires_at

    def heartbeat(self) -> None:
        """Extend this attempt's deadline by its timeout; raises LeaseLost if the task was taken away."""
        attempts.heartbeat(self._task)

    def save_checkpoint(self, value: Any) -> None:
        """Persist progress (JSON) so a later attempt can resume; also extends the deadline."""
        attempts.heartbeat(self._task, checkpoint=value)
        self.checkpoint = value

    def snooze(self, delay: float, reason: str = "") -> NoReturn:
        """End this attempt and run again after `delay` seconds (0 to a year), without using up an attempt.

        Like fail() and next_stage(), raises InvalidTask instead when an argument is malformed; the
        worker then fails the task with that message.
        """
        raise Snooze(delay, reason)

    def fail(self, reason: str) -> NoReturn:
        """Fail the task permanently, whatever retries remain."""
        raise PermanentFailure(reason)

    def next_stage(
        self, stage: str, *, context: Any = None, delay: float = 0.0, priority: int | None = None
    ) -> NoReturn:
        """Requeue the task at `stage` (optionally with new context, delay and priority)."""
        raise NextStage(stage, context=context, delay=delay, priority=priority)

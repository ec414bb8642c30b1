"""taskflow: asynchronous work run from your own database, every task a row you can see and steer.

Public API: `enqueue`, `enqueue_many`, `handler`, and the handler signals `Snooze`,
`PermanentFailure` and `NextStage` (also raised by TaskContext's snooze/fail/next_stage).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .exceptions import (
    InvalidTask,
    NextStage,
    PermanentFailure,
    Snooze,
    StaleVersion,
    TaskflowError,
    UnknownTaskType,
)
from .registry import handler

if TYPE_CHECKING:
    from .models import Task

__all__ = [
    "InvalidTask",
    "NextStage",
    "PermanentFailure",
    "Snooze",
    "StaleVersion",
    "TaskflowError",
    "UnknownTaskType",
    "enqueue",
    "enqueue_many",
    "handler",
]


def enqueue(task_type: str, payload: Any = None, **options: Any) -> Task:
    """Create a task; see taskflow.enqueueing.enqueue."""
    from .enqueueing import enqueue as _enqueue

    return _enqueue(task_type, payload, **options)


def enqueue_many(requests: Any) -> list[Task]:
    """Create many tasks in one transaction; see taskflow.enqueueing.enqueue_many."""
    from .enqueueing import enqueue_many as _enqueue_many

    return _enqueue_many(requests)

"""taskflow: asynchronous work run from your own database, every task a row you can see and steer.

Public API: `enqueue`, `enqueue_many`, `handler`; the operator operations `terminate`,
`retry_now`, `reschedule`, `set_priority` and `set_max_retries` (each returning an
`OperationResult`); `periodic` (declare a periodic schedule in code); the handler signals
`Snooze`, `PermanentFailure` and `NextStage` (also raised by TaskContext's snooze/fail/next_stage);
and the errors.

Importing this package imports no Django model: the engine is loaded on first use, so a remote
worker can register handlers without Django settings or a database.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from importlib import import_module
from typing import TYPE_CHECKING, Any

from .engine.registry import handler
from .exceptions import (
    InvalidTask,
    LeaseLost,
    NextStage,
    PermanentFailure,
    Snooze,
    StaleVersion,
    TaskflowError,
    UnknownTaskType,
)

if TYPE_CHECKING:
    from .engine.operations import (
        OperationResult,
        reschedule,
        retry_now,
        set_max_retries,
        set_priority,
        terminate,
    )
    from .engine.periodic import periodic
    from .models import Task

# Loaded on first use (module __getattr__), so `import taskflow` stays free of the ORM.
_LAZY = {
    name: "taskflow.engine.operations"
    for name in ("OperationResult", "terminate", "retry_now", "reschedule", "set_priority", "set_max_retries")
}
_LAZY["periodic"] = "taskflow.engine.periodic"

__all__ = [
    "InvalidTask",
    "LeaseLost",
    "OperationResult",
    "NextStage",
    "PermanentFailure",
    "Snooze",
    "StaleVersion",
    "TaskflowError",
    "UnknownTaskType",
    "enqueue",
    "enqueue_many",
    "handler",
    "periodic",
    "reschedule",
    "retry_now",
    "set_max_retries",
    "set_priority",
    "terminate",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'taskflow' has no attribute {name!r}")


def enqueue(
    task_type: str,
    payload: Any = None,
    *,
    key: str = "",
    version: int = 0,
    priority: int = 0,
    run_after: datetime | timedelta | float | None = None,
    max_retries: int | None = None,
    timeout: int | None = None,
    stage: str = "",
    user_id: str = "",
    context: Any = None,
    trace_id: str = "",
    retry_same_host: int = 0,
) -> Task:
    """Create a task in the caller's transaction, or return/replace the one with the same identity.

    The returned task's `enqueue_outcome` is "created", "existing" or "replaced". Raises
    InvalidTask (nothing written) or StaleVersion (a newer version of this key exists).
    """
    from .engine.enqueueing import enqueue as _enqueue

    return _enqueue(
        task_type,
        payload,
        key=key,
        version=version,
        priority=priority,
        run_after=run_after,
        max_retries=max_retries,
        timeout=timeout,
        stage=stage,
        user_id=user_id,
        context=context,
        trace_id=trace_id,
        retry_same_host=retry_same_host,
    )


def enqueue_many(requests: Any) -> list[Task]:
    """Create many tasks in one transaction; see taskflow.enqueueing.enqueue_many."""
    from .engine.enqueueing import enqueue_many as _enqueue_many

    return _enqueue_many(requests)

"""taskflow: asynchronous work run from your own database, every task a row you can see and steer.

Public API: `enqueue`, `enqueue_many`, `handler`, `get_task` (wherever the task lives now: the
task table or a history table, see docs/rolling.md); the operator operations `terminate`,
`retry_now`, `reschedule`, `set_priority` and `set_max_retries` (each returning an
`OperationResult`); `periodic` (declare a periodic schedule in code); the handler signals
`Snooze`, `PermanentFailure` and `NextStage` (also raised by TaskContext's snooze/fail/next_stage);
`TaskContext` (what a handler receives);
and the errors. `__version__` is the package's version.

Importing this package imports no Django model: the engine is loaded on first use, so a remote
worker can register handlers without Django settings or a database.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from importlib import import_module, metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

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
from .runtime.context import TaskContext

if TYPE_CHECKING:
    from .engine.enqueueing import TaskSpec
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


def _version() -> str:
    """pyproject.toml's version: read from it in a source checkout, else from the installed package's metadata."""
    # The checkout first: an older installed copy of taskflow must not name the code running from here.
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "taskflow":
            return str(project["version"])
    try:
        return metadata.version("taskflow")
    except metadata.PackageNotFoundError:  # copied in without being installed
        return "0+unknown"


__version__ = _version()

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
    "TaskContext",
    "TaskflowError",
    "UnknownTaskType",
    "__version__",
    "enqueue",
    "enqueue_many",
    "get_task",
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
    depends_on: Iterable[int | Task] = (),
    on_dependency_failure: Literal["stop", "run"] = "stop",
) -> Task:
    """Create a task in the caller's transaction, or return/replace the one with the same identity.

    The returned task's `enqueue_outcome` is "created", "existing" or "replaced". Raises
    InvalidTask (nothing written) or StaleVersion (a newer version of this key exists).
    With `depends_on` the task waits until those tasks have succeeded (docs/dependencies.md).
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
        depends_on=depends_on,
        on_dependency_failure=on_dependency_failure,
    )


def enqueue_many(requests: Iterable[Mapping[str, Any] | TaskSpec]) -> list[Task]:
    """Create many tasks in one transaction, all or none: each request holds `enqueue`'s arguments by name."""
    from .engine.enqueueing import enqueue_many as _enqueue_many

    return _enqueue_many(requests)


def get_task(task_id: int) -> Task:
    """The task with this id, from the task table or a kept history table; raises Task.DoesNotExist."""
    from .engine.rolling import get_task as _get_task

    return _get_task(task_id)

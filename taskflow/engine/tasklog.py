"""Log records about one task carry its `task_id` and `trace_id`.

The worker runs each handler inside `running(task)`, so every record logged meanwhile in that
thread (by the handler, its libraries or taskflow) is about that task; the engine's lines about
one task outside a handler pass `extra=about(task)`. `TaskLogFilter`, put on a logging handler,
gives every record both attributes ("-" when it is about no task), so a formatter may always use
`%(task_id)s` and `%(trace_id)s`:

    "filters": {"task": {"()": "taskflow.engine.tasklog.TaskLogFilter"}},
    "handlers": {"console": {..., "filters": ["task"]}},
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

NONE = "-"


class _Task(Protocol):
    id: int
    trace_id: str


_current: ContextVar[tuple[int, str] | None] = ContextVar("taskflow_current_task", default=None)


@contextmanager
def running(task: _Task) -> Iterator[None]:
    """Mark the records logged in this context (thread) as being about `task`."""
    token = _current.set((task.id, task.trace_id or NONE))
    try:
        yield
    finally:
        _current.reset(token)


def about(task: _Task) -> dict[str, Any]:
    """`extra` for a log call about `task` made outside its handler."""
    return {"task_id": task.id, "trace_id": task.trace_id or NONE}


def current() -> tuple[int, str] | None:
    """(task id, trace id) of the task whose handler runs in this context, if any."""
    return _current.get()


class TaskLogFilter(logging.Filter):
    """Adds `task_id` and `trace_id` to every record (keeping values given by `extra`); never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "task_id"):
            task = _current.get()
            record.task_id, record.trace_id = task if task else (NONE, NONE)
        elif not hasattr(record, "trace_id"):
            record.trace_id = NONE
        return True

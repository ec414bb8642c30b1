"""taskflow as a `django.tasks` backend: `@task` functions become taskflow tasks.

Configure it in Django's TASKS setting::

    TASKS = {"default": {"BACKEND": "taskflow.backends.TaskflowBackend"}}

A function's task type is its module path (with `:<queue>` for a queue other than "default"), its
payload the JSON-normalised args and kwargs; `manage.py taskworker` runs it. Enqueueing joins the
caller's transaction: the task commits or rolls back with the caller's data. See docs/django-tasks.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.db import transaction
from django.tasks import DEFAULT_TASK_BACKEND_ALIAS, task_backends
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import Task, TaskError, TaskResult, TaskResultStatus
from django.tasks.exceptions import InvalidTask, InvalidTaskBackend, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from . import exceptions
from .engine import djangotasks
from .engine.attempts import Outcome, past_attempts
from .engine.validation import parse_task_id
from .models import Status
from .models import Task as TaskRow

# taskflow's statuses as Django's four. A status not listed here (one added later) is not final,
# so it reads as READY.
STATUSES: dict[str, TaskResultStatus] = {
    Status.WAITING: TaskResultStatus.READY,  # for its dependencies (docs/dependencies.md)
    Status.PENDING: TaskResultStatus.READY,  # also while waiting for a retry
    Status.PROCESSING: TaskResultStatus.RUNNING,
    Status.SUCCESS: TaskResultStatus.SUCCESSFUL,
    Status.FAILED: TaskResultStatus.FAILED,
    Status.STOPPED: TaskResultStatus.FAILED,
}
UNKNOWN_STATUS = TaskResultStatus.READY

logger = logging.getLogger("taskflow.backends")


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskflowTask(Task):
    """A django.tasks Task with taskflow's options: `@task(max_retries=5, timeout=60)` and `with_key()`."""

    max_retries: int | None = None  # None: the task type's ScheduleCfg.max_retry_num
    timeout: int | None = None  # seconds per attempt; None: the type's max_processing_time
    key: str | None = None  # identity for idempotent enqueue (see with_key)
    version: int = 0
    depends_on: tuple[str, ...] = ()  # task ids this one waits for (see after)
    on_dependency_failure: str = "stop"

    def __post_init__(self) -> None:
        # Explicit base call: a slots dataclass is a new class, which zero-argument super() misses.
        Task.__post_init__(self)
        djangotasks.register(self.module_path)

    def with_key(self, key: str, version: int = 0) -> TaskflowTask:
        """A copy whose enqueue uses this identity: an unfinished task with it is returned, not duplicated."""
        return replace(self, key=key, version=version)

    def after(self, *results: TaskResult | str | int, on_failure: str = "stop") -> TaskflowTask:
        """A copy whose enqueue waits until these tasks (results or ids) have succeeded; see docs/dependencies.md.

        If one fails or is stopped the new task is stopped too, or runs anyway with `on_failure="run"`.
        """
        ids = tuple(str(r.id) if isinstance(r, TaskResult) else str(r) for r in results)
        return replace(self, depends_on=ids, on_dependency_failure=on_failure)


class TaskflowBackend(BaseTaskBackend):
    """Stores django.tasks tasks as taskflow tasks, run by `manage.py taskworker`."""

    task_class = TaskflowTask
    supports_defer = True
    supports_priority = True  # Django's -100..100 is taskflow's, higher first in both
    supports_get_result = True
    supports_async_task = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # Tasks this backend found valid, with their task type. A task is frozen and the backend's
        # QUEUES fixed (a change of TASKS makes new backends), so the answer cannot change: a
        # function enqueued again and again is not inspected again each time.
        self._valid: dict[tuple[Task, bool], str] = {}

    def validate_task(self, task: Task) -> None:
        self._task_type(task)

    def _task_type(self, task: Task) -> str:
        """The task type of a valid task; InvalidTask otherwise."""
        known = (task, settings.USE_TZ)
        task_type = self._valid.get(known)
        if task_type is not None:
            return task_type
        super().validate_task(task)
        try:
            task_type = djangotasks.task_type_for(task.module_path, task.queue_name)
            if isinstance(task, TaskflowTask):
                djangotasks.validate_options(task.max_retries, task.timeout, task.key, task.version)
        except exceptions.InvalidTask as exc:
            raise InvalidTask(str(exc)) from None
        if len(self._valid) >= 10_000:  # many distinct run_after values, say
            self._valid.clear()
        self._valid[known] = task_type
        return task_type

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Store the task in the caller's transaction; task_enqueued is sent once it commits.

        Raises TypeError for arguments that are not JSON, InvalidTask, and taskflow's StaleVersion
        when a newer version of the task's key exists (see TaskflowTask.with_key).
        """
        task_type = self._task_type(task)
        payload = self._payload(task, args, kwargs)
        try:
            row = djangotasks.enqueue(
                task_type=task_type,
                payload=payload,
                priority=int(task.priority),  # Django allows 3.0
                run_after=task.run_after,
                max_retries=getattr(task, "max_retries", None),
                timeout=getattr(task, "timeout", None),
                key=getattr(task, "key", None),
                version=getattr(task, "version", 0),
                depends_on=getattr(task, "depends_on", ()),
                on_dependency_failure=getattr(task, "on_dependency_failure", "stop"),
            )
        except exceptions.InvalidTask as exc:  # e.g. arguments too large to store; nothing was written
            raise InvalidTask(str(exc)) from None
        if row.enqueue_outcome == djangotasks.EXISTING:
            return self.task_result(row, task)
        # What task_result(row, task) gives for a task not yet run, without reading its history.
        result = TaskResult(
            task=task,
            id=str(row.id),
            status=STATUSES[row.status],
            enqueued_at=row.created_at,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=payload["args"],
            kwargs=payload["kwargs"],
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        transaction.on_commit(lambda: task_enqueued.send(type(self), task_result=result))
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """The stored task as a TaskResult; TaskResultDoesNotExist for an unknown id (or one no task can have)."""
        task_id = parse_task_id(result_id)
        if task_id is None:
            raise TaskResultDoesNotExist(result_id)
        row = djangotasks.read_task(task_id)
        if row is None:
            raise TaskResultDoesNotExist(result_id)
        return self.task_result(row)

    def _payload(self, task: Task, args: Any, kwargs: Any) -> dict[str, Any]:
        payload = {"args": normalize_json(args), "kwargs": normalize_json(kwargs)}
        if self.alias != DEFAULT_TASK_BACKEND_ALIAS:
            payload["backend"] = self.alias
        if task.run_after is not None:
            # As requested: the row's run_after moves with every retry.
            payload["run_after"] = task.run_after.isoformat()
        return payload

    def task_result(self, row: TaskRow | SimpleNamespace, task: Task | None = None) -> TaskResult:
        """A TaskResult reflecting a stored task (a row or djangotasks.read_task; `task`: the one just enqueued)."""
        status = STATUSES.get(row.status, UNKNOWN_STATUS)
        attempts = past_attempts(row.schedule_log)
        if row.status == Status.STOPPED and attempts and attempts[-1].outcome == Outcome.SUCCESS:
            status = TaskResultStatus.SUCCESSFUL  # a success past its retention is stopped, not failed
        worker_ids = [a.worker_id for a in attempts]
        if row.status == Status.PROCESSING:
            worker_ids.append(row.worker_id)
        # The log keeps the last few attempts only: older ones count, with their worker unknown.
        worker_ids = [""] * (row.attempts - len(worker_ids)) + worker_ids
        errors = [_error(a.exception, a.error, a.traceback) for a in attempts if a.failed]
        last_failed = bool(attempts) and attempts[-1].failed
        if row.status == Status.STOPPED and status == TaskResultStatus.FAILED and not (
            attempts and attempts[-1].outcome == Outcome.TERMINATED
        ):
            errors.append(_error(exceptions.class_path(exceptions.TaskStopped), row.status_msg))
        elif row.status == Status.FAILED and not last_failed:
            errors.append(_error(exceptions.class_path(exceptions.TaskflowError), row.status_msg))
        payload = row.payload if isinstance(row.payload, dict) else {}
        result = TaskResult(
            task=task or self._stored_task(row, payload),
            id=str(row.id),
            status=status,
            enqueued_at=row.created_at,
            started_at=attempts[0].started_at if attempts else row.started_at,
            last_attempted_at=row.started_at or (attempts[-1].started_at if attempts else None),
            finished_at=row.finished_at if status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED) else None,
            args=payload.get("args", []),
            kwargs=payload.get("kwargs", {}),
            backend=self.alias,
            errors=errors,
            worker_ids=worker_ids,
        )
        if status == TaskResultStatus.SUCCESSFUL:
            object.__setattr__(result, "_return_value", row.result)
        return result

    def _stored_task(self, row: TaskRow | SimpleNamespace, payload: dict[str, Any]) -> Task:
        module_path, queue_name = djangotasks.split_task_type(row.task_type)
        try:
            defined = import_string(module_path)
        except (ImportError, ValueError):
            raise TaskResultDoesNotExist(f"task {row.id} ({row.task_type}) is not a django.tasks task") from None
        if not isinstance(defined, Task):
            raise TaskResultDoesNotExist(f"task {row.id} ({row.task_type}) is not a django.tasks task")
        run_after = payload.get("run_after")
        changes: dict[str, Any] = {
            "priority": row.priority,
            "queue_name": queue_name,
            "backend": self.alias,
            "run_after": datetime.fromisoformat(run_after) if run_after else None,
            "max_retries": row.max_retries,
            "timeout": row.timeout,
            "key": row.key,
            "version": row.version,
        }
        # Not replace(): the stored task was valid when enqueued, and a later change to QUEUES must
        # not make its result unreadable.
        stored = object.__new__(type(defined))
        for f in fields(defined):
            object.__setattr__(stored, f.name, changes.get(f.name, getattr(defined, f.name)))
        return stored


def send_task_finished(rows: list[TaskRow]) -> None:
    """Send Django's task_finished for these ended django.tasks tasks (after the commit that ended them).

    Called by the engine wherever a task ends (djangotasks.announce_finished), so the signal goes
    out once per ending, whoever ended it: the worker, taskwatch, an operator, a remote worker.
    """
    for row in rows:
        payload = row.payload if isinstance(row.payload, dict) else {}
        try:
            backend = task_backends[payload.get("backend") or DEFAULT_TASK_BACKEND_ALIAS]
        except InvalidTaskBackend:
            continue  # its alias left TASKS: no backend to speak for it
        if not isinstance(backend, TaskflowBackend):
            continue
        try:
            result = backend.task_result(row)
        except TaskResultDoesNotExist:
            continue  # its function is gone
        # Robust: the task has ended and committed; a receiver's error must not undo the caller's work.
        for receiver, error in task_finished.send_robust(type(backend), task_result=result):
            if isinstance(error, Exception):
                logger.error("task_finished receiver %r failed", receiver, exc_info=error)


djangotasks.on_finished(send_task_finished)


def _error(exception_class_path: str, message: str, traceback: str = "") -> TaskError:
    path = exception_class_path or exceptions.class_path(exceptions.TaskflowError)
    return TaskError(exception_class_path=path, traceback=traceback or f"{path}: {message}\n")

"""Running `django.tasks` functions in the worker: one handler serving every django task type.

The handler turns an attempt into what Django's own backends do around a task: the TaskResult and
TaskContext the function sees, the `task_started` signal (sender: the backend's class; the engine
sends `task_finished` where the task's end is written), and Django's failure semantics. Everything
else (retries, timeouts, limits, reporting) is the worker's as for any handler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from inspect import iscoroutinefunction
from typing import Any

from django.tasks import DEFAULT_TASK_BACKEND_ALIAS, task_backends
from django.tasks.base import TaskContext as DjangoTaskContext
from django.tasks.exceptions import InvalidTaskBackend
from django.tasks.signals import task_started
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from ..engine import djangotasks, registry
from ..exceptions import InvalidResult
from .context import TaskContext


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgressTaskContext(DjangoTaskContext):
    """Django's TaskContext, plus `progress(done, total, message="")` as taskflow's own handlers have it."""

    attempt_context: TaskContext = field(repr=False, compare=False)

    def progress(self, done: float, total: float, message: str = "") -> None:
        """Say how far this run got; shown by the console and the API (see TaskContext.progress)."""
        self.attempt_context.progress(done, total, message)

    async def aprogress(self, done: float, total: float, message: str = "") -> None:
        """progress() for an `async def` task: a due write runs in a thread, so the event loop runs on."""
        await self.attempt_context.aprogress(done, total, message)


def run_django_task(ctx: TaskContext) -> Any:
    """The handler of every django.tasks task type with a plain function: call it as Django's backends would.

    `task_finished` is not sent here: it goes out where the task's end is written, once that
    commits (the backend's send_task_finished), so it is sent once whoever ends the task.
    """
    task, result, call_args = _start(ctx)
    return _json_result(task, task.call(*call_args, **result.kwargs))


async def arun_django_task(ctx: TaskContext) -> Any:
    """The handler of django.tasks task types with an `async def` function: awaited on the worker's event loop.

    What touches the database (reading the task, `task_started`'s receivers) runs in a thread.
    """
    task, result, call_args = await asyncio.to_thread(_start, ctx)
    return _json_result(task, await task.acall(*call_args, **result.kwargs))


def _start(ctx: TaskContext) -> tuple[Any, Any, list[Any]]:
    """Read the task as a result, send `task_started`; (task, result, positional arguments to call it with)."""
    backend = _backend(ctx.payload)
    # The stored task as a result (RUNNING, this attempt's worker last): what signals and the
    # function's context see, as a get_result() would show it now.
    row = djangotasks.read_task(ctx.task_id)
    if row is None:  # cannot be while this attempt holds the task; not worth a confusing AttributeError
        raise LookupError(f"task {ctx.task_id} is gone")
    result = backend.task_result(row)
    task = result.task
    task_started.send(type(backend), task_result=result)
    if task.takes_context:
        return task, result, [ProgressTaskContext(task_result=result, attempt_context=ctx), *result.args]
    return task, result, list(result.args)


def _json_result(task: Any, value: Any) -> Any:
    try:
        return normalize_json(value)
    except (TypeError, ValueError) as exc:
        raise InvalidResult(f"the return value of {task.module_path} is not JSON: {exc}") from exc


def select_task_types(types: Iterable[str], queues: Iterable[str]) -> list[str]:
    """The task types a worker serves, its django task types given run_django_task as their handler.

    `types`: task types, django.tasks module paths, and module paths with a queue ("path:queue")
    (none: every handler and every django task);
    `queues`: Django queue names (none: the queues of the TaskflowBackend aliases in TASKS, and
    any queue if one of them allows any). With queues and no types, only django tasks are served.
    """
    wanted = list(dict.fromkeys(types))
    queue_names = list(dict.fromkeys(queues))
    known = set(djangotasks.known_module_paths())
    explicit: list[str] = []  # django task types named with their queue ("shop.tasks.send:emails")
    if wanted:
        module_paths = [t for t in wanted if t in known]
        explicit = [t for t in wanted if t not in known and djangotasks.is_django_task(t)]
        others = [t for t in wanted if t not in known and t not in explicit]
    else:
        module_paths = sorted(known)
        others = [] if queue_names else [t for t in registry.registered_types() if not djangotasks.is_django_task(t)]
    if queue_names and not module_paths:
        raise ValueError("--queues selects django.tasks functions, and none was given or found")
    django_types = explicit
    if module_paths:
        django_types += djangotasks.worker_task_types(module_paths, queue_names or _configured_queues())
    for task_type in django_types:
        registry.handler(task_type)(arun_django_task if _is_async(task_type) else run_django_task)
    return others + django_types


def _is_async(task_type: str) -> bool:
    """Whether the django.tasks function of `task_type` is an `async def` one (Django's own test: Task.call)."""
    defined = import_string(djangotasks.split_task_type(task_type)[0])
    return iscoroutinefunction(getattr(defined, "func", None))


def _configured_queues() -> list[str]:
    """The queues TASKS names for taskflow backends; [] (any) if one of them allows any queue."""
    from ..backends import TaskflowBackend

    names: list[str] = []
    for alias in task_backends.settings:
        try:
            backend = task_backends[alias]
        except InvalidTaskBackend:
            continue  # not ours to report: using it raises the same error where it is used
        if isinstance(backend, TaskflowBackend):
            if not backend.queues:
                return []
            names += sorted(backend.queues)
    return names or [djangotasks.DEFAULT_QUEUE]


def _backend(payload: Any) -> Any:
    from ..backends import TaskflowBackend

    alias = payload.get("backend", DEFAULT_TASK_BACKEND_ALIAS) if isinstance(payload, dict) else ""
    backend = task_backends[alias or DEFAULT_TASK_BACKEND_ALIAS]
    if not isinstance(backend, TaskflowBackend):
        raise TypeError(f"TASKS[{alias!r}] is not a taskflow.backends.TaskflowBackend")
    return backend

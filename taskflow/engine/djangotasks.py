"""How `django.tasks` tasks map onto task types: the type of a task is its function's module path,
with its Django queue appended after a colon unless the queue is "default".

So `shop.tasks.send_receipt` has a ScheduleCfg row, limits and a console filter like any other
type, and a worker chooses queues by choosing types. Functions are known once the module defining
them is imported (taskflow imports every installed app's `tasks` module at start-up).

Whoever ends a task calls `endings.announce_finished` with it, once, where its final status is
written; the backend listens for the django.tasks ones (`on_finished`) and sends Django's
`task_finished` once that commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from types import SimpleNamespace

from ..exceptions import InvalidTask
from ..models import ScheduleCfg, Task
from . import endings, rolling, sql
from .enqueueing import EXISTING, enqueue
from .validation import MAX_INT, TASK_TYPE_RE, validate_key, validate_non_negative_int

__all__ = ["EXISTING", "enqueue"]  # the engine's, for the backend

DEFAULT_QUEUE = "default"  # django.tasks.DEFAULT_TASK_QUEUE_NAME
QUEUE_SEPARATOR = ":"  # never in a module path

_module_paths: set[str] = set()

log = logging.getLogger("taskflow.djangotasks")



def task_type_for(module_path: str, queue_name: str) -> str:
    """The task type of a django.tasks function in a queue; InvalidTask if it cannot be one."""
    task_type = module_path if queue_name == DEFAULT_QUEUE else f"{module_path}{QUEUE_SEPARATOR}{queue_name}"
    if not TASK_TYPE_RE.fullmatch(task_type) or QUEUE_SEPARATOR in module_path:
        raise InvalidTask(
            f"{task_type!r} cannot be a taskflow task type: the module path and queue name together must be "
            "1-100 characters of letters, digits, '_', '.', ':' or '-'"
        )
    return task_type


def validate_options(max_retries: object, timeout: object, key: object, version: object) -> None:
    """Check a task's taskflow options (as enqueue would), so a bad `@task(...)` fails where it is declared."""
    validate_non_negative_int("max_retries", max_retries, allow_none=True, maximum=MAX_INT)
    if timeout is not None and validate_non_negative_int("timeout", timeout, maximum=MAX_INT) == 0:
        raise InvalidTask("timeout must be a positive number of seconds")
    validate_key(key)
    validate_non_negative_int("version", version)


def split_task_type(task_type: str) -> tuple[str, str]:
    """(module path, queue name) of a django.tasks task type."""
    module_path, _, queue_name = task_type.partition(QUEUE_SEPARATOR)
    return module_path, queue_name or DEFAULT_QUEUE


def register(module_path: str) -> None:
    """Remember a django.tasks function (called as its task object is created)."""
    _module_paths.add(module_path)


def is_django_task(task_type: str) -> bool:
    return split_task_type(task_type)[0] in _module_paths


def known_module_paths() -> list[str]:
    return sorted(_module_paths)


def read_task(task_id: int) -> SimpleNamespace | None:
    """What a django.tasks result shows of the task with this id (sql.OUTCOME_COLUMNS as attributes), if any."""
    row = sql.read_outcome(sql.task_table(), task_id)
    if row is None:
        # Rolled into a history table (rare, and off the hot path): read it through the ORM there.
        try:
            task = rolling.get_task(task_id)
        except Task.DoesNotExist:
            return None
        row = {name: getattr(task, name) for name in sql.OUTCOME_COLUMNS}
    return SimpleNamespace(**row)


def worker_task_types(module_paths: Iterable[str], queues: Iterable[str]) -> list[str]:
    """The task types serving these functions in these queues.

    An empty `queues` means every queue: the default one plus each queue these functions have a
    ScheduleCfg row for (one is made at a type's first enqueue), as of now.
    """
    wanted = list(dict.fromkeys(queues))
    paths = list(module_paths)
    seen: dict[str, set[str]] = {path: set() for path in paths}
    if not wanted:
        for task_type in ScheduleCfg.objects.filter(task_type__contains=QUEUE_SEPARATOR).values_list(
            "task_type", flat=True
        ):
            path, queue_name = split_task_type(task_type)
            if path in seen:
                seen[path].add(queue_name)
    types = []
    for path in paths:
        names = wanted or [DEFAULT_QUEUE, *sorted(seen[path])]
        types += [task_type_for(path, name) for name in names]
    return types


def on_finished(listener: Callable[[list[Task]], None]) -> None:
    """Have `listener` told of django.tasks tasks that ended (their rows), after each ending commits."""
    endings.on_finished(listener, wants=is_django_task)

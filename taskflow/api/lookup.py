"""Finding one task by the id in a URL: the one place the API loads a single task (history tables too)."""

from __future__ import annotations

from rest_framework.exceptions import NotFound

from ..engine import validation
from ..engine.rolling import get_task
from ..models import Task


def parse_task_id(value: object) -> int | None:
    """The task id in `value` (a decimal string, as task ids are in JSON), or None if it cannot be one."""
    if not isinstance(value, str):
        return None  # JSON numbers lose 64-bit ids in JavaScript: the API takes strings only
    return validation.parse_task_id(value)


def load_task(task_id: object) -> Task:
    """The task with this id; a malformed or unknown id is the API's 404."""
    parsed = parse_task_id(task_id)
    if parsed is None:
        raise NotFound(f"no task {task_id!s:.40}: task ids are decimal strings")
    try:
        return get_task(parsed)  # wherever it lives: the task table or a history table
    except Task.DoesNotExist:
        raise NotFound(f"no task {parsed}") from None

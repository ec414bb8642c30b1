"""Finding one task by the id in a URL: the one place the API loads a single task."""

from __future__ import annotations

from rest_framework.exceptions import NotFound

from ..models import Task

MAX_TASK_ID = 2**63 - 1


def parse_task_id(value: object) -> int | None:
    """The task id in `value` (a decimal string, as task ids are in JSON), or None if it cannot be one."""
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 19:
        return None
    task_id = int(value)
    return task_id if 0 < task_id <= MAX_TASK_ID else None


def load_task(task_id: object) -> Task:
    """The task with this id; a malformed or unknown id is the API's 404."""
    parsed = parse_task_id(task_id)
    if parsed is None:
        raise NotFound(f"no task {task_id!s:.40}: task ids are decimal strings")
    try:
        return Task.objects.get(pk=parsed)
    except Task.DoesNotExist:
        raise NotFound(f"no task {parsed}") from None

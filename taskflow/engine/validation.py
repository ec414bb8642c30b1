"""Checks on what producers hand in, shared by enqueueing, the API and the admin."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from ..exceptions import InvalidTask

MIN_PRIORITY, MAX_PRIORITY = -100, 100  # django.tasks convention: higher runs first
TASK_TYPE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.:-]{0,99}$")


def validate_task_type(task_type: object) -> str:
    if not isinstance(task_type, str) or not TASK_TYPE_RE.match(task_type):
        raise InvalidTask(
            f"task_type must be 1-100 characters of letters, digits, '_', '.', ':' or '-', "
            f"starting with a letter; got {task_type!r}"
        )
    return task_type


def validate_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidTask(f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}; got {priority!r}")
    return priority


def validate_json(name: str, value: Any) -> Any:
    json_text(name, value)
    return value


def json_text(name: str, value: Any) -> str:
    """`value` as JSON text, or InvalidTask if it is not strict JSON (no NaN, no sets, no objects)."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidTask(f"{name} must be JSON-serialisable: {exc}") from None


def validate_key(key: object) -> str | None:
    if key is None or key == "":
        return None
    if not isinstance(key, str) or len(key) > 255:
        raise InvalidTask(f"key must be a string of at most 255 characters; got {key!r}")
    return key


# The largest values an integer and a bigint column hold on every supported database.
MAX_INT, MAX_BIGINT = 2**31 - 1, 2**63 - 1


def validate_non_negative_int(
    name: str, value: object, *, allow_none: bool = False, maximum: int = MAX_BIGINT
) -> int | None:
    if value is None and allow_none:
        return None
    # Out-of-range values would otherwise fail only at the INSERT, as a database error.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise InvalidTask(f"{name} must be an integer from 0 to {maximum}; got {value!r}")
    return value


def validate_short_text(name: str, value: object, max_length: int) -> str:
    if not isinstance(value, str) or len(value) > max_length:
        raise InvalidTask(f"{name} must be a string of at most {max_length} characters; got {value!r}")
    return value


def resolve_run_after(run_after: object, now: datetime) -> datetime:
    """Accept an aware datetime, a timedelta from now, or seconds from now."""
    if run_after is None:
        return now
    if isinstance(run_after, timedelta):
        return now + run_after
    if isinstance(run_after, (int, float)) and not isinstance(run_after, bool):
        return now + timedelta(seconds=run_after)
    if isinstance(run_after, datetime):
        if timezone.is_naive(run_after):
            raise InvalidTask("run_after must be timezone-aware")
        return run_after
    raise InvalidTask(f"run_after must be a datetime, a timedelta or seconds; got {run_after!r}")

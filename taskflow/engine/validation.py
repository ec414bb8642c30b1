"""Checks on what producers hand in, shared by enqueueing, the API and the admin."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from ..conf import MAX_INT as MAX_INT  # the largest integer column value, re-exported for validators
from ..conf import get_settings
from ..exceptions import InvalidTask

MIN_PRIORITY, MAX_PRIORITY = -100, 100  # django.tasks convention: higher runs first
# Arrays and objects nested in stored JSON, at most: the outermost one is level 1, a scalar level 0.
# MariaDB's JSON_VALID refuses 32 levels: 24 keeps a margin, the same on every database.
MAX_JSON_DEPTH = 24
# Matched whole (fullmatch): with re.match, "$" also matches before a trailing newline. The first
# character is a letter so a type never reads as a command-line option or a reserved name ("*").
TASK_TYPE_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,99}")
# In JSON text (ASCII-escaped, as json.dumps writes it) "\u0000" is a NUL character when the run of
# backslashes ending in its own is odd; in an even run its backslash is the second half of a "\\".
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# A UTF-16 surrogate escape without its other half: a character no database can store as UTF-8.
_LONE_SURROGATE_ESCAPE = re.compile(
    r"(?<!\\)(?:\\\\)*\\ud[89ab][0-9a-f]{2}(?!\\ud[c-f][0-9a-f]{2})"
    r"|(?<!\\ud[89ab][0-9a-f]{2})\\ud[c-f][0-9a-f]{2}"
)


# json.dumps(value, allow_nan=False) builds an encoder per call; the same settings, built once.
_ENCODER = json.JSONEncoder(allow_nan=False)


def validate_task_type(task_type: object) -> str:
    if not isinstance(task_type, str) or not TASK_TYPE_RE.fullmatch(task_type):
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
    """`value` as JSON text, or InvalidTask naming `name` if no database could store it as such.

    Refused: anything but strict JSON (no NaN, no sets, no objects), text over
    TASKFLOW["MAX_PAYLOAD_BYTES"], arrays and objects nested deeper than MAX_JSON_DEPTH (MariaDB's
    limit is 32), and characters PostgreSQL cannot store (NUL, a lone surrogate), so every database
    refuses the same values. Used for payloads, contexts, checkpoints and results.
    """
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidTask(f"{name} must be JSON-serialisable: {exc}") from None
    limit = get_settings().MAX_PAYLOAD_BYTES
    # json.dumps escapes every non-ASCII character, so one character of the text is one byte.
    if len(text) > limit:
        raise InvalidTask(
            f"{name} is {len(text):,} bytes as JSON, over the limit of {limit:,} (TASKFLOW['MAX_PAYLOAD_BYTES'])"
        )
    # Fewer brackets than the limit cannot nest past it (brackets inside strings only add to the count),
    # so the walk runs only for values with many of them.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidTask(
            f"{name} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep (the limit of stored JSON)"
        )
    # Both searches run only when the cheap substring test finds a candidate.
    if "u0000" in text and _NUL_ESCAPE.search(text):
        raise InvalidTask(f"{name} contains a NUL character (\\u0000), which PostgreSQL cannot store")
    if "\\ud" in text and _LONE_SURROGATE_ESCAPE.search(text):
        raise InvalidTask(f"{name} contains a lone UTF-16 surrogate, which is not storable text")
    return text


def json_depth(value: Any, stop_after: int = MAX_JSON_DEPTH) -> int:
    """How deep arrays and objects nest in `value` (0 for a scalar, 1 for `[1, 2]`), counted up to `stop_after` + 1."""
    depth = 0
    level = [value]
    while depth <= stop_after:
        inner: list[Any] = []
        containers = 0
        for item in level:
            if isinstance(item, dict):
                inner.extend(item.values())
            elif isinstance(item, (list, tuple)):  # json.dumps writes a tuple as an array
                inner.extend(item)
            else:
                continue
            containers += 1
        if not containers:
            break
        depth += 1
        level = inner
    return depth


def validate_key(key: object) -> str | None:
    if key is None or key == "":
        return None
    return validate_short_text("key", key, 255)


# The largest value a bigint column holds on every supported database (MAX_INT: an integer column).
MAX_BIGINT = 2**63 - 1


def parse_task_id(value: object) -> int | None:
    """The task id in `value` (a decimal string, as ids are given out, or an int), or None if it cannot be one.

    An id outside the bigint range is None here rather than an OverflowError at the query (SQLite).
    """
    if isinstance(value, str):
        if not value.isascii() or not value.isdigit() or len(value) > 19:
            return None
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 < value <= MAX_BIGINT else None


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
    """`value` if it is a string of at most `max_length` characters that every database can store."""
    if not isinstance(value, str) or len(value) > max_length:
        raise InvalidTask(f"{name} must be a string of at most {max_length} characters; got {value!r}")
    if "\x00" in value:
        raise InvalidTask(f"{name} contains a NUL character (\\x00), which PostgreSQL cannot store; got {value!r}")
    if not value.isascii() and not _is_utf8(value):
        raise InvalidTask(f"{name} contains a lone UTF-16 surrogate, which is not storable text; got {value!r}")
    return value


def storable_text(text: str) -> str:
    """`text` with what no database can store escaped (NUL as "\\x00", lone surrogates as "\\udxxx").

    For text the engine writes on a task's behalf, such as an exception's message in status_msg:
    refusing it would lose the report, so it is kept readable instead.
    """
    if text.isascii() and "\x00" not in text:
        return text
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def resolve_run_after(run_after: object, now: datetime) -> datetime:
    """Accept an aware datetime, a timedelta from now, or seconds from now."""
    if run_after is None:
        return now
    try:
        if isinstance(run_after, timedelta):
            return now + run_after
        if isinstance(run_after, (int, float)) and not isinstance(run_after, bool):
            return now + timedelta(seconds=run_after)
    except (OverflowError, ValueError):  # NaN, or past year 9999
        raise InvalidTask(f"run_after is not a time a database can store: {run_after!r}") from None
    if isinstance(run_after, datetime):
        if timezone.is_naive(run_after):
            raise InvalidTask("run_after must be timezone-aware")
        return run_after
    raise InvalidTask(f"run_after must be a datetime, a timedelta or seconds; got {run_after!r}")

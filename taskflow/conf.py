"""The TASKFLOW setting, read once into one typed object with defaults, each value type- and range-checked.

`setting_problems()` lists what is wrong with a TASKFLOW value; the system checks
(`taskflow.checks`) report it at `manage.py check`, and `get_settings()` refuses to start with it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from types import UnionType
from typing import Any, get_args, get_type_hints

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

# The largest value an integer column holds on every supported database.
MAX_INT = 2**31 - 1
DAY = 86400.0
# Delays are added to datetimes: far beyond a year they mean "never" and, larger still, overflow.
MAX_DELAY = 365 * DAY
RETRY_STRATEGIES = ("fixed", "exponential", "polynomial")
REDIS_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _setting(default: Any, low: float | None = None, high: float | None = None, **metadata: Any) -> Any:
    """A setting's default and the inclusive range its value must lie in."""
    return field(default=default, metadata={"low": low, "high": high, **metadata})


@dataclass(frozen=True)
class TaskflowSettings:
    # django-redis cache alias; None runs everything on the database alone.
    REDIS_ALIAS: str | None = None
    # Prefix of every Redis key and channel (after "taskflow:"); None derives one from the database,
    # so two deployments sharing a Redis server never share leases, counters or wake-ups.
    REDIS_NAMESPACE: str | None = _setting(None, pattern=REDIS_NAMESPACE_RE)
    # The largest payload, context, checkpoint or result, as JSON text.
    MAX_PAYLOAD_BYTES: int = _setting(1024 * 1024, 1024, 256 * 1024 * 1024)
    # The largest HTTP request body the API reads (larger ones are answered 413 unread).
    MAX_REQUEST_BYTES: int = _setting(8 * 1024 * 1024, 1024, 1024 * 1024 * 1024)
    # Seconds an API server process reuses a token's user and permissions before reading them
    # again: a revoked token or permission takes effect within this (at once in the process that
    # changed it); 0 reads them on every request.
    API_AUTH_REFRESH: float = _setting(5.0, 0, 60)

    # Defaults for a task type's ScheduleCfg row when it is first created (the row's fields have
    # the same ranges: see ScheduleCfg).
    SCHEDULE_LIMIT: int = _setting(100, 1, 1000)
    SCHEDULE_INTERVAL: float = _setting(1.0, 0.01, DAY)
    MAX_PROCESSING_TIME: int = _setting(300, 1, MAX_INT)
    MAX_RETRY_NUM: int = _setting(3, 0, 1000)
    RETRY_STRATEGY: str = _setting("exponential", choices=RETRY_STRATEGIES)
    RETRY_INTERVAL: float = _setting(10.0, 0, MAX_DELAY)
    MAX_RETRY_INTERVAL: float = _setting(3600.0, 0, MAX_DELAY)
    RETRY_JITTER: float = _setting(0.1, 0, 1)
    CONCURRENCY_LIMIT: int = _setting(0, 0, MAX_INT)
    PRIORITY_AGING: float = _setting(1.0, 0, DAY)
    PENDING_TIMEOUT: int = _setting(0, 0, MAX_INT)
    SUCCESS_RETENTION: int = _setting(86400, 0, MAX_INT)
    PURGE_AFTER_DAYS: int = _setting(7, 0, 36500)

    # The engine's own timings (seconds); tests and small deployments shorten them.
    CONFIG_REFRESH: float = _setting(1.0, 0, DAY)
    REPORT_INTERVAL: float = _setting(0.005, 0, 60)
    HEARTBEAT_INTERVAL: float = _setting(5.0, 0.01, DAY)
    LIVENESS_TIMEOUT: float = _setting(30.0, 0.02, DAY)
    SHUTDOWN_GRACE: float = _setting(30.0, 0, DAY)
    # Claim-ahead (docs/workers.md): attempts a worker claims beyond its free threads, at most, and the
    # seconds one may wait unstarted before it is handed back (runtime.runner's PREFETCH defaults).
    PREFETCH: int = _setting(256, 0, 100_000)
    PREFETCH_WAIT: float = _setting(1.0, 0.01, 3600)
    # Async (`async def`) handlers a worker runs at once on its event loop, apart from its threads
    # (docs/workers.md; runtime.runner's ASYNC_CONCURRENCY default).
    ASYNC_CONCURRENCY: int = _setting(1000, 1, 100_000)
    GLOBAL_CONCURRENCY_LIMIT: int = _setting(0, 0, MAX_INT)
    RECONCILE_INTERVAL: float = _setting(30.0, 0.01, DAY)
    WATCH_INTERVAL: float = _setting(5.0, 0.01, DAY)
    LEADER_TTL: float = _setting(15.0, 0.1, DAY)
    PURGE_BATCH: int = _setting(1000, 1, 100_000)

    # Periodic schedules, {"<name>": {"task_type": ..., "cron": ... | "every": seconds, ...}}: see
    # docs/periodic.md. Each is checked by engine.periodic (cron, time zone, ...).
    PERIODIC: Mapping = field(default_factory=dict, hash=False, metadata={"schedules": True})
    # Table rolling (docs/rolling.md). Off by default (ROLL_INTERVAL 0: the watcher never rolls;
    # `manage.py taskroll` still does), because it creates and drops tables at run time.
    ROLL_INTERVAL: float = _setting(0.0, 0, DAY)
    ROLL_AFTER: int = _setting(86400, 0, MAX_INT)  # seconds after finishing that a task moves out
    ROLL_MAX_ROWS: int = _setting(5_000_000, 1, 10**12)  # rows per history table, never more
    ROLL_TABLE_SECONDS: float = _setting(DAY, 1, 366 * DAY)  # a history table older than this is full too
    ROLL_RETENTION_DAYS: int = _setting(30, 1, 36500)  # a history table is dropped this long after its newest finish
    ROLL_BATCH: int = _setting(1000, 1, 100_000)  # rows moved per transaction


@dataclass(frozen=True)
class SettingProblem:
    """One thing wrong with the TASKFLOW setting; `kind` is one of KINDS."""

    kind: str
    key: str  # the TASKFLOW key at fault ("" for the setting as a whole)
    message: str


KINDS = ("not-a-dict", "unknown", "type", "range", "conflict")


# Settings that were removed because they were unsafe, with what to do instead.
REMOVED = {
    "NODE_ID": (
        "one node number in the project settings is shared by every process that reads them, so they "
        "mint the same ids. Each process now leases a node of its own; delete the setting."
    ),
}


def setting_problems(given: object) -> list[SettingProblem]:
    """Everything wrong with a TASKFLOW value on its own (not what it refers to, such as cache aliases)."""
    if given is None:
        return []
    if not isinstance(given, Mapping):
        return [SettingProblem("not-a-dict", "", f"TASKFLOW must be a dict; got {type(given).__name__}")]
    fields = {f.name: f for f in dataclasses.fields(TaskflowSettings)}
    hints = _type_hints()
    problems = [
        SettingProblem(
            "unknown",
            str(name),
            f"TASKFLOW[{name!r}] is no longer supported: {REMOVED[name]}"
            if name in REMOVED
            else f"TASKFLOW[{name!r}] is not a taskflow setting",
        )
        for name in sorted(set(given) - set(fields), key=str)
    ]
    for name in fields.keys() & set(given):
        value = given[name]
        if not _fits_type(value, hints[name]):
            problems.append(SettingProblem("type", name, f"TASKFLOW[{name!r}] {_type_problem(value, hints[name])}"))
        elif message := _value_problem(value, fields[name].metadata):
            problems.append(SettingProblem("range", name, f"TASKFLOW[{name!r}] {message}"))
    # Pairs are compared only when both values are valid on their own (a default stands in for one not given).
    faulty = {p.key for p in problems}
    valid = {name: value for name, value in given.items() if name in fields and name not in faulty}
    problems += [p for p, keys in _conflicts(TaskflowSettings(**valid)) if not keys & faulty]
    return sorted(problems, key=lambda p: (list(fields).index(p.key) if p.key in fields else -1, p.message))


def _conflicts(s: TaskflowSettings) -> list[tuple[SettingProblem, set[str]]]:
    """Values valid one by one that contradict each other, each with the keys involved."""
    problems = []
    if s.RETRY_INTERVAL > s.MAX_RETRY_INTERVAL:
        message = (
            f"TASKFLOW['RETRY_INTERVAL'] ({s.RETRY_INTERVAL:g}) is above TASKFLOW['MAX_RETRY_INTERVAL'] "
            f"({s.MAX_RETRY_INTERVAL:g}), the cap on every retry delay"
        )
        problems.append(
            (SettingProblem("conflict", "RETRY_INTERVAL", message), {"RETRY_INTERVAL", "MAX_RETRY_INTERVAL"})
        )
    if s.LIVENESS_TIMEOUT < 2 * s.HEARTBEAT_INTERVAL:
        message = (
            f"TASKFLOW['LIVENESS_TIMEOUT'] ({s.LIVENESS_TIMEOUT:g}) must be at least twice "
            f"TASKFLOW['HEARTBEAT_INTERVAL'] ({s.HEARTBEAT_INTERVAL:g}): otherwise one late beat makes a live "
            "worker look dead, and its tasks are rescued and run a second time"
        )
        problems.append(
            (SettingProblem("conflict", "LIVENESS_TIMEOUT", message), {"LIVENESS_TIMEOUT", "HEARTBEAT_INTERVAL"})
        )
    return problems


@cache
def _type_hints() -> dict[str, Any]:
    return get_type_hints(TaskflowSettings)


def _allowed_types(hint: Any) -> tuple[type, ...]:
    return get_args(hint) if isinstance(hint, UnionType) else (hint,)


def _fits_type(value: object, hint: Any) -> bool:
    allowed = _allowed_types(hint)
    if isinstance(value, bool):  # True is an int to Python, never a count or a duration here
        return bool in allowed
    if float in allowed and isinstance(value, int):
        return True
    return isinstance(value, allowed)


_TYPE_NAMES = {
    Mapping: "a dict",
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "True or False",
    type(None): "None",
}


def _type_problem(value: object, hint: Any) -> str:
    wanted = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in _allowed_types(hint))
    return f"must be {wanted}; got {value!r} ({type(value).__name__})"


def _value_problem(value: object, metadata: Mapping[str, Any]) -> str | None:
    if value is None:
        return None
    low, high = metadata.get("low"), metadata.get("high")
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number; got {value!r}"
    if (low is not None and value < low) or (high is not None and value > high):  # type: ignore[operator]
        return f"must be from {_number(low)} to {_number(high)}; got {value!r}"
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        return f"must be one of {', '.join(map(repr, choices))}; got {value!r}"
    if metadata.get("schedules"):
        # Imported here: the schedule checks use the engine, which needs the models (and so this module).
        from .engine.periodic import declaration_problems

        problems = declaration_problems(value)  # type: ignore[arg-type]
        return "; ".join(problems) if problems else None
    pattern = metadata.get("pattern")
    if pattern is not None and not pattern.fullmatch(value):
        return f"must be 1-64 letters, digits, '_', '.' or '-'; got {value!r}"
    return None


def _number(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def value_range(name: str) -> tuple[float, float]:
    """The inclusive range of the TASKFLOW setting `name` (ScheduleCfg's fields share these)."""
    metadata = {f.name: f.metadata for f in dataclasses.fields(TaskflowSettings)}[name]
    return metadata["low"], metadata["high"]


@cache
def get_settings() -> TaskflowSettings:
    """Return the TASKFLOW setting merged over the defaults; ImproperlyConfigured if any value is wrong."""
    given = getattr(settings, "TASKFLOW", None)
    problems = setting_problems(given)
    if problems:
        raise ImproperlyConfigured("; ".join(p.message for p in problems) + " (run manage.py check)")
    return TaskflowSettings(**(given or {}))


def _reset(*, setting: str, **kwargs: object) -> None:
    if setting == "TASKFLOW":
        get_settings.cache_clear()


setting_changed.connect(_reset)

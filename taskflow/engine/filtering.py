"""Which tasks an operator's filter matches: the console's task list and the command line share these rules.

Each filter is answered by an index (docs/console.md, "Fast at millions of rows"). A filter on a
column that leads no index of its own (stage, priority, created time, key) also names the task
types (`task_type IN (...)`: the ones asked for, else every known type, from the tiny config
table), so the database reads one short range per type of a `(task_type, column)` index instead
of the whole table. Bad input raises InvalidTask naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, time

from django.db.models import Q, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from ..exceptions import InvalidTask
from ..models import ScheduleCfg, Status, Task
from .validation import MAX_BIGINT, MAX_PRIORITY, MIN_PRIORITY

FINISHED = (Status.SUCCESS, Status.FAILED, Status.STOPPED)


def known_types() -> list[str]:
    """Every task type ever enqueued: enqueue creates its ScheduleCfg row (the console keeps it)."""
    return list(ScheduleCfg.objects.order_by("task_type").values_list("task_type", flat=True))


def of_types(queryset: QuerySet[Task], types: Sequence[str] = ()) -> QuerySet[Task]:
    """`queryset` limited to `types`, or to every known type when none is named (a prefix for the per-type indexes)."""
    return queryset.filter(task_type__in=list(types) or known_types())


def at_stage(queryset: QuerySet[Task], stage: str, types: Sequence[str] = ()) -> QuerySet[Task]:
    return of_types(queryset, types).filter(stage=stage)  # (task_type, stage)


def with_key(queryset: QuerySet[Task], key: str, types: Sequence[str] = ()) -> QuerySet[Task]:
    return of_types(queryset, types).filter(key=key)  # the identity index (task_type, task_key, version)


def priority_between(
    queryset: QuerySet[Task], low: int | None, high: int | None, types: Sequence[str] = ()
) -> QuerySet[Task]:
    """Tasks whose priority lies in [low, high] (either end optional); (task_type, priority)."""
    bounds = {}
    for lookup, value in (("priority__gte", low), ("priority__lte", high)):
        if value is not None:
            # Clamped, so a bound far outside -100..100 stays a small integer the column accepts.
            bounds[lookup] = max(MIN_PRIORITY - 1, min(MAX_PRIORITY + 1, value))
    return of_types(queryset, types).filter(**bounds) if bounds else queryset


def created_between(
    queryset: QuerySet[Task], start: datetime | None, end: datetime | None, types: Sequence[str] = ()
) -> QuerySet[Task]:
    """Tasks created in [start, end] (either end optional); (task_type, created_at)."""
    bounds = _range("created_at", start, end)
    return of_types(queryset, types).filter(**bounds) if bounds else queryset


def finished_between(queryset: QuerySet[Task], start: datetime | None, end: datetime | None) -> QuerySet[Task]:
    """Tasks finished in [start, end]; (status, finished_at): only finished tasks have a finish time."""
    bounds = _range("finished_at", start, end)
    return queryset.filter(status__in=FINISHED, **bounds) if bounds else queryset


def running_on(queryset: QuerySet[Task], worker_id: str) -> QuerySet[Task]:
    """What one worker runs now: its processing tasks, a prefix of the claim index."""
    # Finished tasks keep their last worker too, but finding those would need an index on
    # worker_id, which every claim would rewrite; "which machine runs what" needs only this.
    return queryset.filter(status=Status.PROCESSING, worker_id=worker_id)


def search(queryset: QuerySet[Task], term: str) -> QuerySet[Task]:
    """Exact matches only, each answered by an index: id, key (the identity index), trace id, user id."""
    term = term.strip()
    if not term:
        return queryset
    match = Q(trace_id=term) | Q(user_id=term) | Q(task_type__in=known_types(), key=term)
    if term.isdigit() and int(term) <= MAX_BIGINT:
        match |= Q(pk=int(term))
    return queryset.filter(match)


def parse_time(name: str, text: str) -> datetime:
    """A typed date and time in the current time zone: "2026-05-01T12:30" (seconds, offset optional) or a date."""
    try:
        value = parse_datetime(text.strip())
        if value is None and (day := parse_date(text.strip())) is not None:
            value = datetime.combine(day, time())
    except ValueError:
        value = None
    if value is None:
        raise InvalidTask(f"{name}: not a date and time: {text!r}")
    return timezone.make_aware(value) if timezone.is_naive(value) else value


def _range(field: str, start: datetime | None, end: datetime | None) -> dict[str, datetime]:
    bounds = {}
    if start is not None:
        bounds[f"{field}__gte"] = start
    if end is not None:
        bounds[f"{field}__lte"] = end
    return bounds

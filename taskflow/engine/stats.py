"""Statistics for the dashboard and the metrics: a small rollup that taskwatch refreshes every pass.

Reading a million-row task table on every page view would be slow, so `refresh` (a taskwatch
duty) keeps two small tables:

- `TaskStatsMinute`: per type and minute, what finished (by `finished_at`, read through the
  `(status, finished_at)` index and aggregated by the database) and a histogram of those
  attempts' run times. Each pass recomputes only the minutes that may still change (the last
  SETTLE_S seconds); older minutes are final, are added once to the type's totals and are kept
  for KEEP_S.
- `TaskStats`: per type, tasks by status (a full count, repeated no more often than COUNT_EFFORT
  of the time allows: about 1 s at a million rows on MariaDB), the tasks in flight and the head
  of the queue (every pass, from the claim index), and the totals behind the metrics' counters.

`current` reads only these tables (and the tiny ScheduleCfg), so it costs the same at any size.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Case, Count, DurationField, ExpressionWrapper, F, IntegerField, Sum, Value, When
from django.db.models.functions import TruncMinute
from django.utils import timezone

from ..models import ScheduleCfg, Status, Task, TaskStats, TaskStatsMinute

# Upper bounds (ms) of the run-time histogram's buckets; one more bucket holds everything longer.
RUN_TIME_BOUNDS_MS: tuple[float, ...] = (
    5,
    10,
    25,
    50,
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    30_000,
    60_000,
    300_000,
    900_000,
    3_600_000,
)
FINISHED = (Status.SUCCESS, Status.FAILED, Status.STOPPED)
# A minute may still change until this long after its end: finish times come from the workers'
# clocks just before their write commits, so a late commit or a clock a little behind lands there.
SETTLE_S = 90
KEEP_S = 25 * 3600  # minute rows kept: the longest window `current` serves, plus margin
MAX_WINDOW_S = 24 * 3600
FIRST_LOOK_BACK_S = 3600  # a first refresh fills the last hour, so the dashboard is full at once
# The share of the time the full count by status may take: it reruns once 1/COUNT_EFFORT times its
# own duration has passed (every ~20 s at a million rows on MariaDB; every pass on small tables).
COUNT_EFFORT = 0.05
NO_BUCKET = -1  # rows without a run time (stopped tasks, tasks never started)

KeepGoing = Callable[[], bool]


def _always() -> bool:
    return True


def _floor_minute(when: datetime) -> datetime:
    return when.replace(second=0, microsecond=0)


# -- refreshing (the taskwatch duty) ----------------------------------------------------------------


def refresh(now: datetime | None = None, keep_going: KeepGoing | None = None) -> int:
    """Bring the rollup up to `now`; returns how many minute rows it wrote."""
    now = now or timezone.now()
    keep_going = keep_going or _always
    types = list(ScheduleCfg.objects.order_by("task_type").values_list("task_type", flat=True))
    if not types:
        return 0
    rows = {s.task_type: s for s in TaskStats.objects.filter(task_type__in=types)}
    for task_type in types:
        if task_type not in rows:
            rows[task_type] = TaskStats(task_type=task_type, refreshed_at=now)
    written = _roll_minutes(rows, now)
    if not keep_going():
        return written
    _count_live(rows, types, now)
    _count_all_if_due(rows, now)
    # Every row exists by now (_roll_minutes created the new ones).
    TaskStats.objects.bulk_update(
        rows.values(), ["counts", "counted_at", "count_seconds", "in_flight", "oldest_pending_since", "refreshed_at"]
    )
    TaskStatsMinute.objects.filter(minute__lt=now - timedelta(seconds=KEEP_S)).delete()
    return written


def _roll_minutes(rows: dict[str, TaskStats], now: datetime) -> int:
    """Recompute the minutes that may still change; make final those that can no longer, adding them to the totals."""
    known = [s.rolled_until for s in rows.values() if s.rolled_until is not None]
    start = min(known) if known else _floor_minute(now) - timedelta(seconds=FIRST_LOOK_BACK_S)
    # After a long stop (no leader), the minutes too old to show are skipped rather than scanned.
    start = max(start, _floor_minute(now) - timedelta(seconds=KEEP_S))
    final_until = _floor_minute(now - timedelta(seconds=SETTLE_S))
    minutes = _finished_by_minute(start, now)
    with transaction.atomic():
        # Guarded by the boundary read above: a second refresher racing this one adds nothing twice.
        for task_type, stats in rows.items():
            begin = stats.rolled_until or start
            if stats.rolled_until is not None and stats.rolled_until >= final_until:
                continue  # no minute became final since the last pass
            totals = _add_to_totals(
                stats.totals,
                (m for (t, minute), m in minutes.items() if t == task_type and begin <= minute < final_until),
            )
            if stats._state.adding:
                stats.rolled_until, stats.totals = final_until, totals
                TaskStats.objects.bulk_create([stats], ignore_conflicts=True)
                continue
            changed = TaskStats.objects.filter(task_type=task_type, rolled_until=stats.rolled_until).update(
                rolled_until=final_until, totals=totals
            )
            if changed:
                stats.rolled_until, stats.totals = final_until, totals
        TaskStatsMinute.objects.filter(minute__gte=start).delete()
        TaskStatsMinute.objects.bulk_create(minutes.values())
    return len(minutes)


def _finished_by_minute(start: datetime, now: datetime) -> dict[tuple[str, datetime], TaskStatsMinute]:
    """Minute rows of the tasks finished in [start, now), aggregated by the database."""
    run_time = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
    bucket = Case(
        When(status=Status.STOPPED, then=Value(NO_BUCKET)),
        When(started_at__isnull=True, then=Value(NO_BUCKET)),
        *(
            When(run_time__lte=timedelta(milliseconds=bound), then=Value(i))
            for i, bound in enumerate(RUN_TIME_BOUNDS_MS)
        ),
        default=Value(len(RUN_TIME_BOUNDS_MS)),
        output_field=IntegerField(),
    )
    groups = (
        Task.objects.filter(status__in=FINISHED, finished_at__gte=start, finished_at__lt=now)
        .annotate(run_time=run_time)
        .annotate(minute=TruncMinute("finished_at", tzinfo=UTC), bucket=bucket)
        .values("task_type", "status", "minute", "bucket")
        .annotate(n=Count("id"), attempts=Sum("attempts"), run_time_sum=Sum("run_time"))
        .order_by()
    )
    minutes: dict[tuple[str, datetime], TaskStatsMinute] = {}
    for g in groups:
        minute = g["minute"] if timezone.is_aware(g["minute"]) else g["minute"].replace(tzinfo=UTC)
        row = minutes.get((g["task_type"], minute))
        if row is None:
            row = minutes[g["task_type"], minute] = TaskStatsMinute(
                task_type=g["task_type"], minute=minute, run_time_buckets=[0] * (len(RUN_TIME_BOUNDS_MS) + 1)
            )
        field = {Status.SUCCESS: "completed", Status.FAILED: "failed", Status.STOPPED: "stopped"}[g["status"]]
        setattr(row, field, getattr(row, field) + g["n"])
        row.attempts += g["attempts"] or 0
        if g["bucket"] != NO_BUCKET:
            row.run_time_buckets[g["bucket"]] += g["n"]
            row.run_time_sum_ms += _ms(g["run_time_sum"])
    return minutes


def _ms(value: timedelta | int | float | None) -> float:
    if value is None:
        return 0.0
    if isinstance(value, timedelta):
        return value.total_seconds() * 1000
    return float(value) / 1000  # a backend that sums durations as microseconds


def _add_to_totals(totals: dict[str, Any], minutes: Any) -> dict[str, Any]:
    """`totals` plus the given minute rows (a new dict)."""
    out = {
        "completed": totals.get("completed", 0),
        "failed": totals.get("failed", 0),
        "stopped": totals.get("stopped", 0),
        "attempts": totals.get("attempts", 0),
        "run_time_buckets": list(totals.get("run_time_buckets") or [0] * (len(RUN_TIME_BOUNDS_MS) + 1)),
        "run_time_sum_ms": totals.get("run_time_sum_ms", 0.0),
    }
    for m in minutes:
        out["completed"] += m.completed
        out["failed"] += m.failed
        out["stopped"] += m.stopped
        out["attempts"] += m.attempts
        out["run_time_buckets"] = [a + b for a, b in zip(out["run_time_buckets"], m.run_time_buckets, strict=True)]
        out["run_time_sum_ms"] += m.run_time_sum_ms
    return out


def _count_live(rows: dict[str, TaskStats], types: list[str], now: datetime) -> None:
    """Tasks in flight and the head of each queue: both read a short range of the claim index."""
    processing = dict(
        Task.objects.filter(status=Status.PROCESSING, task_type__in=types)
        .values_list("task_type")
        .annotate(n=Count("id"))
        .order_by()
    )
    for task_type, stats in rows.items():
        stats.in_flight = processing.get(task_type, 0)
        stats.oldest_pending_since = (
            Task.objects.filter(status=Status.PENDING, task_type=task_type, run_after__lte=now)
            .order_by("order_time")
            .values_list("run_after", flat=True)
            .first()
        )
        stats.refreshed_at = now


def _count_all_if_due(rows: dict[str, TaskStats], now: datetime) -> None:
    """Tasks by type and status, if the last count is old enough for its cost (see COUNT_EFFORT)."""
    if all(s.counted_at for s in rows.values()):  # a new type is counted at once
        last = min(s.counted_at for s in rows.values() if s.counted_at)
        cost = max(s.count_seconds for s in rows.values())
        if (now - last).total_seconds() < cost / COUNT_EFFORT:
            return
    began = time.perf_counter()
    counts: dict[str, dict[str, int]] = defaultdict(dict)
    for task_type, status, n in (
        # Every type at once, so the database reads the claim index once, in order.
        Task.objects.values_list("task_type", "status").annotate(n=Count("id")).order_by()
    ):
        counts[task_type][status] = n
    seconds = time.perf_counter() - began
    for task_type, stats in rows.items():
        stats.counts = {s.value: counts[task_type].get(s.value, 0) for s in Status}
        stats.counted_at = now
        stats.count_seconds = seconds


# -- reading ------------------------------------------------------------------------------------


def current(window_s: int = 3600) -> dict[str, Any]:
    """The dashboard's numbers per task type over the last `window_s` seconds (whole minutes, up to a day).

    Read from the rollup only; if taskwatch never refreshed it, this refreshes it once first.
    """
    window_s = max(60, min(MAX_WINDOW_S, int(window_s)))
    cfgs = list(ScheduleCfg.objects.order_by("task_type"))
    rows = {s.task_type: s for s in TaskStats.objects.filter(task_type__in=[c.task_type for c in cfgs])}
    if cfgs and not rows:
        # If taskwatch's first refresh gets there first, this one's insert fails: read what it wrote.
        with contextlib.suppress(IntegrityError):
            refresh()
        rows = {s.task_type: s for s in TaskStats.objects.filter(task_type__in=[c.task_type for c in cfgs])}
    generated = max((s.refreshed_at for s in rows.values()), default=None) or timezone.now()
    last_minute = _floor_minute(generated)
    n_minutes = math.ceil(window_s / 60)
    first_minute = last_minute - timedelta(minutes=n_minutes - 1)
    # Tuples, not model instances: a day's window is 1,440 rows per type.
    by_type: dict[str, dict[datetime, tuple[int, int, list[int]]]] = defaultdict(dict)
    for task_type, minute, completed, failed, buckets in TaskStatsMinute.objects.filter(
        minute__gte=first_minute, minute__lte=last_minute
    ).values_list("task_type", "minute", "completed", "failed", "run_time_buckets"):
        by_type[task_type][minute] = (completed, failed, buckets)
    minutes = [first_minute + timedelta(minutes=i) for i in range(n_minutes)]
    types = {}
    for cfg in cfgs:
        stats = rows.get(cfg.task_type)
        mine = by_type.get(cfg.task_type, {})
        completed = sum(m[0] for m in mine.values())
        failed = sum(m[1] for m in mine.values())
        buckets = [sum(col) for col in zip(*(m[2] for m in mine.values()), strict=True)] or [0] * (
            len(RUN_TIME_BOUNDS_MS) + 1
        )
        pending_since = stats.oldest_pending_since if stats else None
        types[cfg.task_type] = {
            "counts": {s.value: (stats.counts.get(s.value, 0) if stats else 0) for s in Status},
            "oldest_pending_age_s": (
                round(max(0.0, (generated - pending_since).total_seconds()), 3) if pending_since else None
            ),
            "success_rate": round(completed / (completed + failed), 4) if completed + failed else None,
            "run_time_ms": {"p50": quantile(buckets, 0.5), "p95": quantile(buckets, 0.95)},
            "in_flight": stats.in_flight if stats else 0,
            "limit": cfg.concurrency_limit or None,
            "paused": cfg.paused,
            "per_minute": [
                {
                    "minute": minute.isoformat(),
                    "completed": mine[minute][0] if minute in mine else 0,
                    "failed": mine[minute][1] if minute in mine else 0,
                }
                for minute in minutes
            ],
        }
    return {"window_s": window_s, "generated_at": generated.isoformat(), "types": types}


def quantile(buckets: list[int], q: float) -> float | None:
    """The q-quantile (ms) of a run-time histogram, interpolated within its bucket as Prometheus does.

    None without samples; a quantile in the last, open bucket is reported as the last bound.
    """
    total = sum(buckets)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(buckets):
        if n and seen + n >= rank:
            if i == len(RUN_TIME_BOUNDS_MS):
                return float(RUN_TIME_BOUNDS_MS[-1])
            low = RUN_TIME_BOUNDS_MS[i - 1] if i else 0.0
            return round(low + (RUN_TIME_BOUNDS_MS[i] - low) * (rank - seen) / n, 1)
        seen += n
    return float(RUN_TIME_BOUNDS_MS[-1])


def totals() -> dict[str, dict[str, Any]]:
    """Per type, the counts of every final minute since the rollup began (only ever grows): the metrics' counters."""
    return {s.task_type: s.totals for s in TaskStats.objects.order_by("task_type") if s.totals}

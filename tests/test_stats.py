"""The statistics rollup (engine/stats.py): tasks in known states, a refresh, and the numbers it reports."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import taskflow
from taskflow.engine import stats
from taskflow.engine.attempts import Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.models import ScheduleCfg, Status, Task, TaskStats, TaskStatsMinute
from taskflow.runtime.watcher import DUTIES

pytestmark = pytest.mark.django_db(transaction=True)

A = "test.noop"
B = "test.record"


def task(task_type: str, status: str, **columns: object) -> Task:
    """A task of `task_type` put straight into `status` with the given columns (test setup only)."""
    created = taskflow.enqueue(task_type)
    Task.objects.filter(pk=created.pk).update(status=status, **columns)
    return created


def finished(task_type: str, status: str, at, run_ms: float | None, attempts: int = 1) -> Task:  # noqa: ANN001
    started = None if run_ms is None else at - timedelta(milliseconds=run_ms)
    return task(task_type, status, started_at=started, finished_at=at, attempts=attempts)


@pytest.fixture
def now():  # noqa: ANN201
    # The middle of a minute, so "30 s into minute M" never falls on a boundary.
    return timezone.now().replace(second=30, microsecond=0)


def minute_of(when) -> str:  # noqa: ANN001
    return when.replace(second=0, microsecond=0).isoformat()


def test_current_reports_counts_rates_run_times_and_minutes_of_every_type(now) -> None:  # noqa: ANN001
    configs.get(B)
    ScheduleCfg.objects.filter(pk=B).update(concurrency_limit=3, paused=True)
    five_ago, two_ago = now - timedelta(minutes=5), now - timedelta(minutes=2)
    for _ in range(4):
        finished(A, Status.SUCCESS, five_ago, 150, attempts=2)
    finished(A, Status.FAILED, two_ago, 3000, attempts=4)
    finished(A, Status.STOPPED, two_ago, None)  # stopped before it started: no run time
    finished(A, Status.SUCCESS, now - timedelta(hours=2), 10)  # outside the window
    task(A, Status.PENDING, run_after=now - timedelta(seconds=120), order_time=now - timedelta(seconds=120))
    task(A, Status.PENDING, run_after=now - timedelta(seconds=30), order_time=now - timedelta(seconds=30))
    task(A, Status.PENDING, run_after=now + timedelta(hours=1), order_time=now + timedelta(hours=1))  # not due
    task(A, Status.PROCESSING, started_at=now - timedelta(seconds=5))

    stats.refresh(now)
    result = stats.current()

    assert set(result) == {"window_s", "generated_at", "types"}
    assert result["window_s"] == 3600
    assert result["generated_at"] == now.isoformat()
    assert set(result["types"]) == {A, B}
    a, b = result["types"][A], result["types"][B]
    assert a["counts"] == {"pending": 3, "processing": 1, "success": 5, "failed": 1, "stopped": 1}
    assert a["oldest_pending_age_s"] == 120.0
    assert a["success_rate"] == 0.8  # 4 of the 5 judged in the window (stopped tasks are not judged)
    assert 100 < a["run_time_ms"]["p50"] <= 250  # four of five took 150 ms
    assert 2500 < a["run_time_ms"]["p95"] <= 5000  # the slowest took 3 s
    assert a["in_flight"] == 1 and a["limit"] is None and a["paused"] is False
    assert len(a["per_minute"]) == 60
    assert a["per_minute"][-1]["minute"] == minute_of(now)
    by_minute = {m["minute"]: (m["completed"], m["failed"]) for m in a["per_minute"]}
    assert by_minute[minute_of(five_ago)] == (4, 0)
    assert by_minute[minute_of(two_ago)] == (0, 1)
    assert sum(c + f for c, f in by_minute.values()) == 5

    assert b["counts"] == {s.value: 0 for s in Status}
    assert b["oldest_pending_age_s"] is None and b["success_rate"] is None
    assert b["run_time_ms"] == {"p50": None, "p95": None}
    assert b["in_flight"] == 0 and b["limit"] == 3 and b["paused"] is True
    assert all(m == {"minute": m["minute"], "completed": 0, "failed": 0} for m in b["per_minute"])

    # A shorter window: whole minutes, the older finishes left out.
    short = stats.current(window_s=180)["types"][A]
    assert len(short["per_minute"]) == 3
    assert short["success_rate"] == 0.0


def test_run_times_and_counts_of_attempts_finished_by_the_engine(now) -> None:  # noqa: ANN001
    taskflow.enqueue(A)
    taskflow.enqueue(A)
    claimed = claim_batch(configs.get(A), 10, "host-a:1:w")
    reports = [Report(claimed[0], Outcome.SUCCESS, result=1), Report(claimed[1], Outcome.FAIL, error="no")]
    assert len(finish_attempts(reports)) == 2

    stats.refresh()
    a = stats.current()["types"][A]

    assert a["counts"]["success"] == 1 and a["counts"]["failed"] == 1
    assert a["success_rate"] == 0.5
    assert a["run_time_ms"]["p50"] is not None
    assert sum(m["completed"] for m in a["per_minute"]) == 1
    assert sum(m["failed"] for m in a["per_minute"]) == 1


def test_final_minutes_are_added_to_the_totals_once_and_the_totals_never_go_back(now) -> None:  # noqa: ANN001
    old = now - timedelta(minutes=10)  # final: past SETTLE_S
    fresh = now - timedelta(seconds=20)  # may still change
    failed_old = finished(A, Status.FAILED, old, 40)
    finished(A, Status.SUCCESS, old, 40)
    failed_fresh = finished(A, Status.FAILED, fresh, 40)

    stats.refresh(now)
    totals = stats.totals()[A]
    assert (totals["completed"], totals["failed"], totals["stopped"]) == (1, 1, 0)
    assert sum(totals["run_time_buckets"]) == 2
    assert totals["run_time_buckets"][stats.RUN_TIME_BOUNDS_MS.index(50)] == 2
    assert totals["run_time_sum_ms"] == pytest.approx(80, abs=1)

    # Both failed tasks are retried: the final minute keeps what happened, the open one follows the table.
    taskflow.retry_now([failed_old.pk, failed_fresh.pk], by="test", reason="again")
    stats.refresh(now + timedelta(seconds=5))
    stats.refresh(now + timedelta(seconds=10))
    assert stats.totals()[A] == totals
    a = stats.current()["types"][A]
    assert sum(m["failed"] for m in a["per_minute"]) == 1
    assert a["counts"]["failed"] == 0 and a["counts"]["pending"] == 2

    # Once the open minute is final too, it is added (once).
    later = now + timedelta(seconds=stats.SETTLE_S + 60)
    finished(A, Status.SUCCESS, fresh, 40)
    stats.refresh(later)
    stats.refresh(later + timedelta(seconds=1))
    assert stats.totals()[A]["completed"] == 2
    assert stats.totals()[A]["failed"] == 1


def test_the_full_count_waits_in_proportion_to_its_cost_while_live_numbers_follow_every_pass(now) -> None:  # noqa: ANN001
    task(A, Status.PENDING, run_after=now, order_time=now)
    stats.refresh(now)
    TaskStats.objects.update(count_seconds=10.0)  # as if the last count took 10 s: next one in 200 s
    task(A, Status.PROCESSING, started_at=now)
    task(A, Status.PENDING, run_after=now - timedelta(seconds=60), order_time=now - timedelta(seconds=60))

    stats.refresh(now + timedelta(seconds=30))
    row = TaskStats.objects.get(pk=A)
    assert row.counts["pending"] == 1 and row.counts["processing"] == 0  # not counted again yet
    assert row.counted_at == now
    assert row.in_flight == 1
    assert row.oldest_pending_since == now - timedelta(seconds=60)

    stats.refresh(now + timedelta(seconds=10 / stats.COUNT_EFFORT + 1))
    row.refresh_from_db()
    assert row.counts["pending"] == 2 and row.counts["processing"] == 1


def test_current_reads_only_the_rollup_and_fills_it_if_taskwatch_never_ran(now) -> None:  # noqa: ANN001
    finished(A, Status.SUCCESS, now - timedelta(minutes=1), 20)
    assert not TaskStats.objects.exists()
    assert stats.current()["types"][A]["counts"]["success"] == 1  # refreshed once, here
    assert TaskStats.objects.filter(pk=A).exists()

    with CaptureQueriesContext(connection) as queries:
        stats.current()
    task_table = Task._meta.db_table
    assert queries.captured_queries
    assert not any(task_table + '"' in q["sql"] or task_table + "`" in q["sql"] for q in queries.captured_queries)


def test_minute_rows_older_than_a_day_are_deleted(now) -> None:  # noqa: ANN001
    finished(A, Status.SUCCESS, now - timedelta(minutes=3), 20)
    stats.refresh(now)
    assert TaskStatsMinute.objects.count() == 1
    stats.refresh(now + timedelta(seconds=stats.KEEP_S + 60))
    assert TaskStatsMinute.objects.count() == 0
    assert stats.totals()[A]["completed"] == 1


def test_after_a_long_stop_minutes_older_than_a_day_are_skipped_not_scanned(now) -> None:  # noqa: ANN001
    finished(A, Status.SUCCESS, now - timedelta(minutes=5), 20)
    stats.refresh(now)
    later = now + timedelta(days=3)
    finished(A, Status.SUCCESS, later - timedelta(hours=30), 20)  # while no taskwatch led: too old to show
    finished(A, Status.FAILED, later - timedelta(minutes=10), 20)

    stats.refresh(later)

    totals = stats.totals()[A]
    assert (totals["completed"], totals["failed"]) == (1, 1)
    assert TaskStats.objects.get(pk=A).rolled_until == (later - timedelta(seconds=stats.SETTLE_S)).replace(
        second=0, microsecond=0
    )


def test_a_refresh_stopped_by_its_watcher_keeps_what_it_finished(now) -> None:  # noqa: ANN001
    finished(A, Status.SUCCESS, now - timedelta(minutes=5), 20)
    stats.refresh(now)
    task(A, Status.PROCESSING, started_at=now)
    stats.refresh(now + timedelta(seconds=5), keep_going=lambda: False)
    row = TaskStats.objects.get(pk=A)
    assert row.in_flight == 0 and row.refreshed_at == now  # the live numbers wait for the next pass
    assert TaskStatsMinute.objects.filter(task_type=A).count() == 1


def test_refresh_is_a_taskwatch_duty() -> None:
    assert dict(DUTIES)["refresh_stats"] is stats.refresh


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        ([], 0.5, None),
        ([0] * 17, 0.5, None),
        ([10] + [0] * 16, 0.5, 2.5),  # ten samples under 5 ms: interpolated from 0
        ([0, 0, 0, 0, 4] + [0] * 12, 0.5, 75.0),  # (50, 100]
        ([0] * 16 + [3], 0.95, 3_600_000.0),  # past the last bound
    ],
)
def test_quantile_interpolates_within_its_bucket(buckets: list[int], q: float, expected: float | None) -> None:
    assert stats.quantile(buckets, q) == expected


@pytest.mark.processes
def test_a_taskwatch_process_keeps_the_rollup_current_while_a_worker_runs_tasks(spawn) -> None:  # noqa: ANN001
    from .conftest import wait_until

    spawn("taskwatch")
    spawn("taskworker", "--types", A, "--concurrency", "2")
    for _ in range(5):
        taskflow.enqueue(A)

    def counted() -> dict | None:
        # A pass may read the minutes just before a report commits and count just after: the next
        # pass takes the minute again.
        numbers = stats.current()["types"][A]
        done = numbers["counts"]["success"] == 5 and sum(m["completed"] for m in numbers["per_minute"]) == 5
        return numbers if done else None

    numbers = wait_until(counted, timeout=60)
    assert numbers["success_rate"] == 1.0 and numbers["run_time_ms"]["p50"] is not None
    assert numbers["in_flight"] == 0

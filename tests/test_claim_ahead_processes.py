"""Claim-ahead with real worker processes: tasks claimed ahead of free threads and not started go back
to pending uncounted (when their worker dies, or when they wait behind a slow handler), and a limited
type is never claimed ahead."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

import taskflow
from taskflow.engine.configs import configs
from taskflow.models import ScheduleCfg, Status, Task

from .conftest import peak_overlap, read_runs, wait_until

pytestmark = pytest.mark.processes


def overrides(**values: object) -> dict[str, str]:
    return {"TASKFLOW_TEST_OVERRIDES": json.dumps(values)}


def queue_behind_a_slow_task(slow_seconds: float, quick: int = 60) -> tuple[list[Task], Task, list[Task]]:
    """Quick tasks first (so the worker claims ahead), then a slow one, then the tasks that will wait behind it."""
    first = taskflow.enqueue_many(
        [{"task_type": "test.sleep", "payload": {"seconds": 0}, "priority": 10} for _ in range(quick)]
    )
    slow = taskflow.enqueue("test.sleep", {"seconds": slow_seconds}, priority=5)
    # Enough that some stay reserved behind those the worker starts ahead of its thread (START_AHEAD).
    behind = taskflow.enqueue_many(
        [{"task_type": "test.sleep", "payload": {"seconds": 0}, "priority": 0} for _ in range(300)]
    )
    return first, slow, behind


def started(run_log: Path, task: Task) -> bool:
    return any(r[0] == str(task.pk) and r[2] == "start" for r in read_runs(run_log))


def reserved(tasks: list[Task]) -> set[int]:
    """Those of `tasks` claimed ahead and not started: processing, with no start time."""
    ids = [t.pk for t in tasks]
    return set(Task.objects.filter(pk__in=ids, status=Status.PROCESSING, started_at=None).values_list("pk", flat=True))


def started_ahead(run_log: Path, tasks: list[Task]) -> set[int]:
    """Those of `tasks` started by the worker (`started_at` set) whose handler has not begun: queued for a thread."""
    ids = [t.pk for t in tasks]
    rows = Task.objects.filter(pk__in=ids, status=Status.PROCESSING, started_at__isnull=False)
    begun = {int(r[0]) for r in read_runs(run_log) if r[2] == "start"}
    return set(rows.values_list("pk", flat=True)) - begun


def test_tasks_claimed_ahead_by_a_killed_worker_run_again_at_once_their_attempt_uncounted(spawn, run_log) -> None:
    # A long hand-back bound: only the worker's death can free what it claimed ahead. Many quick tasks
    # first, so it claims more ahead (the pace of PREFETCH_WAIT / 4) than it starts ahead (START_AHEAD).
    doomed = spawn("taskworker", "--types", "test.sleep", "--concurrency", "1", env=overrides(PREFETCH_WAIT=60))
    _, slow, behind = queue_behind_a_slow_task(600, quick=300)
    wait_until(lambda: started(run_log, slow), timeout=60)
    # Past START_AHEAD (0.05 s) of the thread's last pace: the busy worker starts nothing more ahead.
    time.sleep(0.5)
    # How many of those it holds are only reserved and how many already started ahead depends on the
    # pace it measured (the machine's speed): both kinds must come back at once.
    wait_until(lambda: reserved(behind) | started_ahead(run_log, behind), timeout=10)
    held = reserved(behind)
    queued = started_ahead(run_log, behind) - held
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(timeout=10)
    killed_at = time.monotonic()

    spawn("taskwatch")
    spawn("taskworker", "--types", "test.sleep", "--concurrency", "4")
    wait_until(lambda: Task.objects.filter(pk__in=held, status=Status.SUCCESS).count() == len(held), timeout=60)
    # At once when taskwatch sees the worker dead (LIVENESS_TIMEOUT 3 s), not after their 300 s lease.
    assert time.monotonic() - killed_at < 30
    for row in Task.objects.filter(pk__in=held):
        # Never started by the dead worker: no failed attempt, no back-off, one run in all.
        assert (row.attempts, [e["outcome"] for e in row.schedule_log]) == (1, ["success"]), row.status_msg
        assert [r[2] for r in read_runs(run_log) if r[0] == str(row.pk)] == ["start", "end"]
    # Those started ahead of the thread count an attempt, as a running one does, and are not lost either.
    wait_until(lambda: Task.objects.filter(pk__in=queued, status=Status.SUCCESS).count() == len(queued), timeout=60)
    # The task that had started is rescued as a failed attempt, as before.
    wait_until(lambda: "rescued" in [e["outcome"] for e in Task.objects.get(pk=slow.pk).schedule_log], timeout=30)


def test_tasks_claimed_ahead_behind_a_slow_handler_go_back_to_pending_for_other_workers(spawn, run_log) -> None:
    first = spawn("taskworker", "--types", "test.sleep", "--concurrency", "1", env=overrides(PREFETCH_WAIT=0.5))
    _, slow, behind = queue_behind_a_slow_task(8)
    wait_until(lambda: started(run_log, slow), timeout=60)
    wait_until(lambda: reserved(behind) | started_ahead(run_log, behind), timeout=10)
    spawn("taskworker", "--types", "test.sleep", "--concurrency", "4")

    ids = [t.pk for t in behind]
    wait_until(lambda: Task.objects.filter(pk__in=ids, status=Status.SUCCESS).count() == len(ids), timeout=30)
    # Done while the slow handler still runs: handed back unstarted and run by the other worker.
    assert not Task.objects.filter(pk=slow.pk, status=Status.SUCCESS).exists()
    rows = Task.objects.filter(pk__in=ids)
    assert all(row.attempts == 1 for row in rows)
    assert [row.pk for row in rows if row.lease_token > 1], "none was claimed ahead and handed back"
    assert first.poll() is None


def test_tasks_started_ahead_behind_a_slow_handler_go_back_to_pending_uncounted(spawn, run_log) -> None:
    # Many quick tasks first, so the worker's threads take them at a pace and it starts tasks ahead.
    first = spawn("taskworker", "--types", "test.sleep", "--concurrency", "1", env=overrides(PREFETCH_WAIT=0.5))
    quick = taskflow.enqueue_many(
        [{"task_type": "test.sleep", "payload": {"seconds": 0}, "priority": 10} for _ in range(400)]
    )
    slow = taskflow.enqueue("test.sleep", {"seconds": 8}, priority=5)
    behind = taskflow.enqueue_many(
        [{"task_type": "test.sleep", "payload": {"seconds": 0}, "priority": 0} for _ in range(40)]
    )
    wait_until(lambda: started(run_log, slow), timeout=60)
    queued = wait_until(lambda: started_ahead(run_log, behind), timeout=5)
    spawn("taskworker", "--types", "test.sleep", "--concurrency", "4")

    wait_until(lambda: Task.objects.filter(pk__in=queued, status=Status.SUCCESS).count() == len(queued), timeout=30)
    assert not Task.objects.filter(pk=slow.pk, status=Status.SUCCESS).exists()
    for row in Task.objects.filter(pk__in=queued):
        # Started ahead but never run by the first worker: handed back uncounted, run once by the other.
        assert (row.attempts, row.lease_token, [e["outcome"] for e in row.schedule_log]) == (1, 2, ["success"])
        assert [r[2] for r in read_runs(run_log) if r[0] == str(row.pk)] == ["start", "end"]
    assert Task.objects.filter(pk__in=[t.pk for t in quick], status=Status.SUCCESS, attempts=1).count() == 400
    assert first.poll() is None


def test_tasks_run_in_priority_order_across_what_is_claimed_and_started_ahead(spawn, run_log) -> None:
    tasks = taskflow.enqueue_many(
        [{"task_type": "test.sleep", "payload": {"seconds": 0}, "priority": (i * 7) % 10} for i in range(600)]
    )
    worker = spawn("taskworker", "--types", "test.sleep", "--concurrency", "1", "--burst")
    assert worker.wait(timeout=120) == 0
    priority = {str(t.pk): t.priority for t in tasks}
    order = [priority[r[0]] for r in read_runs(run_log) if r[2] == "start"]
    assert len(order) == 600
    assert order == sorted(order, reverse=True)
    # Several batches were claimed ahead and started together (else this tested nothing new).
    starts = Task.objects.filter(pk__in=[t.pk for t in tasks]).values("started_at").distinct().count()
    assert starts < 300


def test_a_limit_under_claim_ahead_never_has_more_running_than_allowed(spawn, run_log) -> None:
    configs.get("test.sleep")
    ScheduleCfg.objects.filter(pk="test.sleep").update(concurrency_limit=2)
    configs.clear()
    tasks = taskflow.enqueue_many([{"task_type": "test.sleep", "payload": {"seconds": 0.1}} for _ in range(40)])
    procs = [spawn("taskworker", "--types", "test.sleep", "--concurrency", "4", "--burst") for _ in range(3)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    assert Task.objects.filter(pk__in=[t.pk for t in tasks], status=Status.SUCCESS, attempts=1).count() == 40
    # Nothing was claimed ahead (every claim started its tasks), and at no moment did more than 2 run.
    assert not Task.objects.filter(pk__in=[t.pk for t in tasks], lease_token__gt=1).exists()
    assert peak_overlap(run_log) <= 2

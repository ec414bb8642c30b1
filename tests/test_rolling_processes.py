"""Rolling with real processes: workers, the watcher and other rolls racing it, operators acting, and kill -9."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from django.db import close_old_connections, connection
from django.utils import timezone

import taskflow
from taskflow.engine import rolling, sql
from taskflow.models import SchedulePos, Status, Task

from .conftest import read_runs, wait_until

pytestmark = [pytest.mark.processes, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _no_history_tables() -> None:
    yield
    for table in history_tables():
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TABLE {sql.quote(table)}")


def history_tables() -> set[str]:
    with connection.cursor() as cursor:
        return {t for t in connection.introspection.table_names(cursor) if t.startswith(sql.task_table() + "_")}


def overrides(**values: object) -> dict[str, str]:
    return {"TASKFLOW_TEST_OVERRIDES": json.dumps(values)}


def ids_in(table: str) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM {sql.quote(table)}")
        return [row[0] for row in cursor.fetchall()]


def assert_each_task_in_one_table(expected: set[int], max_rows: int) -> dict[int, str]:
    """Every expected task is in exactly one table, and SchedulePos counts what each history table holds."""
    where: dict[int, list[str]] = {}
    for task_id in ids_in(sql.task_table()):
        where.setdefault(task_id, []).append(sql.task_table())
    kept = {rolling.history_table(p.position): p for p in rolling.kept()}
    for table in history_tables():
        assert table in kept, f"{table} exists but is not a kept table"
        ids = ids_in(table)
        assert len(ids) == kept[table].row_count <= max_rows
        if ids:
            assert kept[table].min_id <= min(ids) and max(ids) <= kept[table].max_id
        for task_id in ids:
            where.setdefault(task_id, []).append(table)
    assert set(where) == expected
    assert {task_id: tables for task_id, tables in where.items() if len(tables) != 1} == {}
    return {task_id: tables[0] for task_id, tables in where.items()}


def test_rolling_races_workers_rolls_and_operators_without_losing_or_repeating_a_task(spawn, run_log: Path) -> None:  # noqa: ANN001
    env = overrides(ROLL_AFTER=0, ROLL_MAX_ROWS=40, ROLL_BATCH=7, ROLL_INTERVAL=0.2)
    good = [
        t.id for t in taskflow.enqueue_many([{"task_type": "test.record", "payload": {"n": i}} for i in range(300)])
    ]
    bad = [taskflow.enqueue("test.fail", {}, key=f"f{i}", version=1, max_retries=0).id for i in range(40)]
    extra_runs: Counter[int] = Counter()

    workers = [spawn("taskworker", "--types", "test.record,test.fail", "--concurrency", "4", env=env) for _ in range(2)]
    watcher = spawn("taskwatch", env=env)
    stop = threading.Event()

    def roll_again_and_again() -> None:
        while not stop.is_set():
            proc = spawn("taskroll", env=env)
            proc.wait(timeout=120)

    roller = threading.Thread(target=roll_again_and_again)
    roller.start()
    try:
        deadline = time.monotonic() + 20
        rng = random.Random(7)
        while time.monotonic() < deadline:
            # Producers keep adding work; operators retry failures (wherever they live now) and
            # re-enqueue failed identities, which brings them back from history as the same task.
            good += [t.id for t in taskflow.enqueue_many([{"task_type": "test.record"} for _ in range(10)])]
            task_id = rng.choice(bad)
            if taskflow.retry_now([task_id], by="ops").changed:
                extra_runs[task_id] += 1
            i = rng.randrange(len(bad))
            again = taskflow.enqueue("test.fail", {}, key=f"f{i}", version=1, max_retries=0)
            assert again.id == bad[i]
            if again.enqueue_outcome == "replaced":
                extra_runs[again.id] += 1
            time.sleep(0.05)
    finally:
        stop.set()
        roller.join()
        close_old_connections()

    def settled() -> bool:
        return not Task.objects.filter(status__in=[Status.PENDING, Status.PROCESSING]).exists()

    wait_until(settled, timeout=120)
    wait_until(lambda: not Task.objects.exists(), timeout=60)  # the watcher rolled everything
    for proc in (*workers, watcher):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0

    assert len(rolling.kept()) > 3  # several tables were started along the way
    assert_each_task_in_one_table(set(good) | set(bad), max_rows=40)
    runs = Counter(int(r[0]) for r in read_runs(run_log))
    assert {t: n for t, n in runs.items() if t in set(good) and n != 1} == {}
    assert set(runs) == set(good) | set(bad)
    assert {t: runs[t] for t in bad if runs[t] != 1 + extra_runs[t]} == {}
    assert sum(extra_runs.values()) > 10  # the operators really did act on rolled tasks
    for task_id in bad:
        assert taskflow.get_task(task_id).status == Status.FAILED


def test_a_roll_killed_at_any_moment_leaves_each_task_in_one_table_and_the_next_run_finishes(spawn) -> None:  # noqa: ANN001
    env = overrides(ROLL_MAX_ROWS=700, ROLL_BATCH=50)
    tasks = taskflow.enqueue_many([{"task_type": "test.noop", "payload": {"n": i}} for i in range(3000)])
    ids = {t.id for t in tasks}
    Task.objects.update(status=Status.SUCCESS, finished_at=timezone.now() - rolling.timedelta(days=2))
    rng = random.Random(9)
    kills = 0

    def moved() -> int:
        return sum(p.row_count for p in SchedulePos.objects.all())

    while kills < 6:
        before = moved()
        proc = spawn("taskroll", env=env)
        # Killed once it is moving (starting Django takes a while), at a random point of a batch.
        wait_until(lambda before=before, proc=proc: moved() > before or proc.poll() is not None, timeout=120)
        time.sleep(rng.uniform(0, 0.3))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        kills += 1
        assert_each_task_in_one_table(ids, max_rows=700)
    assert kills >= 2, "no roll was interrupted: the test proved nothing"
    moved_before = sum(p.row_count for p in SchedulePos.objects.all())
    assert moved_before > 0

    last = spawn("taskroll", env=env)
    assert last.wait(timeout=300) == 0, Path(last.log_path).read_text()
    where = assert_each_task_in_one_table(ids, max_rows=700)
    assert sql.task_table() not in set(where.values())
    assert [p.row_count for p in rolling.kept()][:4] == [700, 700, 700, 700]
    assert sum(p.row_count for p in rolling.kept()) == 3000

#!/usr/bin/env python
"""Benchmark of table rolling: claim-and-complete throughput as finished rows pile up, rolled or not,
and the time to drop a day of history against DELETE-ing it.

Run from the repository root, e.g.:
  DATABASE_URL=mysql://root@127.0.0.1:3306/tf_rollbench .venv/bin/python bench/bench_rolling.py
  ... bench/bench_rolling.py --rows 1000000 --day-rows 200000     # a quicker run
The database name must contain "bench": it is dropped and recreated (unless --reuse-db). Finished
rows are made by INSERT ... SELECT doubling (any database). Throughput is one in-process loop of
`claim_batch` (100 tasks) + `finish_attempts` (success) over --tasks pending tasks: the database's
cost per task, without a worker's threads. It prints, never asserts; see bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-bench-only")

from bench import database  # noqa: E402

OLD_TYPE = "bench.old"  # the finished rows that pile up
WORK_TYPE = "bench.noop"  # what is claimed and completed
SEED = 10_000


def fill_finished(rows: int, *, status: str = "success", days_ago: float = 2.0) -> float:
    """Add `rows` finished OLD_TYPE tasks: a seed, then INSERT ... SELECT doubling; returns seconds."""
    from django.db import connection, transaction
    from django.utils import timezone

    import taskflow
    from taskflow.engine import sql
    from taskflow.models import Task

    started = time.perf_counter()
    table = sql.quote(sql.task_table())
    finished_at = timezone.now() - timedelta(days=days_ago)
    seed_ids = []
    for start in range(0, min(rows, SEED), 1000):
        batch = [{"task_type": OLD_TYPE, "payload": {"n": i}} for i in range(start, min(rows, SEED, start + 1000))]
        seed_ids += [t.id for t in taskflow.enqueue_many(batch)]
    Task.objects.filter(pk__in=seed_ids).update(status=status, finished_at=finished_at, attempts=1, lease_token=1)
    have = len(seed_ids)
    low, high = min(seed_ids), max(seed_ids)
    columns = [f.column for f in Task._meta.concrete_fields]
    quoted = ", ".join(sql.quote(c) for c in columns)
    while have < rows:
        take = min(have, rows - have)
        shift = high - low + 1
        select = ", ".join(f"{sql.quote('id')} - %s" if c == "id" else sql.quote(c) for c in columns)
        with transaction.atomic(), connection.cursor() as cursor:
            # Copies of the newest `take` rows, moved below the lowest id: ids stay unique.
            cursor.execute(
                f"INSERT INTO {table} ({quoted}) SELECT {select} FROM {table} "
                f"WHERE {sql.quote('task_type')} = %s AND {sql.quote('id')} >= %s "
                f"ORDER BY {sql.quote('id')} LIMIT %s",
                [shift, OLD_TYPE, low, take],
            )
        low -= shift
        have += take
        print(f"    {have:,} / {rows:,} finished rows", flush=True)
    return time.perf_counter() - started


def throughput(tasks: int, repeat: int) -> tuple[float, float]:
    """The median and the best of `repeat` runs of `one_throughput`.

    On a shared machine other processes slow some runs down; the best run is the least disturbed.
    """
    runs = sorted(one_throughput(tasks) for _ in range(repeat))
    print(f"    runs: {', '.join(f'{r:,.0f}' for r in runs)} tasks/s", flush=True)
    return runs[len(runs) // 2], runs[-1]


def one_throughput(tasks: int) -> float:
    """Claim and complete `tasks` pending tasks in batches of 100, one loop; tasks per second."""
    import taskflow
    from taskflow.engine.attempts import Outcome, Report
    from taskflow.engine.claiming import claim_batch
    from taskflow.engine.configs import configs
    from taskflow.engine.finishing import finish_attempts
    from taskflow.models import Task

    for start in range(0, tasks, 1000):
        taskflow.enqueue_many([{"task_type": WORK_TYPE} for _ in range(min(1000, tasks - start))])
    cfg = configs.get(WORK_TYPE)
    done = 0
    started = time.perf_counter()
    while done < tasks:
        held = claim_batch(cfg, 100, "bench-host:1:w")
        if not held:
            break
        finish_attempts([Report(t, Outcome.SUCCESS) for t in held])
        done += len(held)
    elapsed = time.perf_counter() - started
    Task.objects.filter(task_type=WORK_TYPE).delete()  # the next measurement starts from the same table
    return done / elapsed


def roll_all(batch: int) -> tuple[int, float]:
    from taskflow.engine import rolling

    started = time.perf_counter()
    result = rolling.roll(batch=batch, pause=0)
    return result.moved, time.perf_counter() - started


def purge_delete(rows: int) -> float:
    """DELETE `rows` stopped tasks the way purge_finished does (PURGE_BATCH ids per statement); seconds."""
    from taskflow.engine.expiry import purge_finished
    from taskflow.models import ScheduleCfg

    ScheduleCfg.objects.update_or_create(task_type=OLD_TYPE, defaults={"purge_after_days": 1})
    started = time.perf_counter()
    purged = purge_finished()
    elapsed = time.perf_counter() - started
    assert purged == rows, (purged, rows)
    return elapsed


def rate(figure: tuple[float, float]) -> str:
    return f"median {figure[0]:,.0f} tasks/s, best {figure[1]:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="finished rows for the large case")
    parser.add_argument("--small", type=int, default=10_000, help="finished rows for the small case")
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks claimed and completed per measurement")
    parser.add_argument("--day-rows", type=int, default=1_000_000, help="rows in the day dropped vs deleted")
    parser.add_argument("--roll-batch", type=int, default=10_000, help="rows moved per roll transaction")
    parser.add_argument("--repeat", type=int, default=5, help="runs per throughput measurement")
    parser.add_argument("--reuse-db", action="store_true")
    args = parser.parse_args()

    url = os.environ.get("DATABASE_URL") or f"sqlite:///{ROOT / 'var' / 'tfbench.sqlite3'}"
    os.environ["DATABASE_URL"] = url
    name = database.ensure_database(url, fresh=not args.reuse_db)
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from django.test import override_settings

    from taskflow.engine import rolling, sql

    database.migrate()
    database.reset_tables()
    print(f"bench_rolling on {database.describe()} ({name}); load average {os.getloadavg()[0]:.2f}")
    print(f"  rows {args.rows:,}, small {args.small:,}, tasks per measurement {args.tasks:,}, day {args.day_rows:,}")
    big = {**settings.TASKFLOW, "ROLL_MAX_ROWS": 10**12, "ROLL_TABLE_SECONDS": 366 * 86400}
    figures: list[tuple[str, str]] = []

    print(f"- {args.small:,} finished rows")
    fill_finished(args.small)
    base = throughput(args.tasks, args.repeat)
    figures.append((f"claim+complete, {args.small:,} finished rows", rate(base)))

    print(f"- {args.rows:,} finished rows, never rolled")
    seconds = fill_finished(args.rows - args.small)
    print(f"    filled in {seconds:.1f} s")
    never = throughput(args.tasks, args.repeat)
    figures.append((f"claim+complete, {args.rows:,} finished rows never rolled", rate(never)))

    print(f"- rolling {args.rows:,} rows")
    with override_settings(TASKFLOW=big):
        moved, seconds = roll_all(args.roll_batch)
    figures.append(
        (f"roll of {moved:,} rows (batch {args.roll_batch:,})", f"{seconds:.1f} s, {moved / seconds:,.0f} rows/s")
    )
    rolled = throughput(args.tasks, args.repeat)
    figures.append((f"claim+complete, {args.rows:,} finished rows rolled", rate(rolled)))

    print(f"- a day of {args.day_rows:,} rows: DELETE (as purge_finished) vs DROP TABLE")
    with override_settings(TASKFLOW=big):
        rolling.drop_expired(rolling.timezone.now() + timedelta(days=400))  # the big history goes first
        fill_finished(args.day_rows, status="stopped")
        delete_seconds = purge_delete(args.day_rows)
        fill_finished(args.day_rows, status="stopped")
        # Its own table: the current one was dropped above, so the roll starts a new one.
        moved, _ = roll_all(args.roll_batch)
        started = time.perf_counter()
        dropped = rolling.drop_expired(rolling.timezone.now() + timedelta(days=400))
        drop_seconds = time.perf_counter() - started
    figures.append((f"DELETE a day ({args.day_rows:,} rows, purge_finished)", f"{delete_seconds:.2f} s"))
    figures.append((f"drop a day ({moved:,} rows, {', '.join(dropped)})", f"{drop_seconds:.3f} s"))

    print()
    width = max(len(name) for name, _ in figures)
    for label, value in figures:
        print(f"{label:<{width}}  {value}")
    for label, figure in (("rolled", rolled), ("never rolled", never)):
        median, best = (100 * (figure[i] - base[i]) / base[i] for i in (0, 1))
        print(f"{label} vs {args.small:,}: median {median:+.1f} %, best {best:+.1f} % (target: within -10 %)")
    with connection.cursor() as cursor:
        left = [t for t in connection.introspection.table_names(cursor) if t.startswith(sql.task_table() + "_")]
    print(f"history tables left: {left or 'none'}")


if __name__ == "__main__":
    main()

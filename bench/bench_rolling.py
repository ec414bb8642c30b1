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
CHUNK = 250_000  # rows per INSERT ... SELECT statement when filling


def fill_finished(rows: int, *, status: str = "success", days_ago: float = 2.0) -> float:
    """Add `rows` finished OLD_TYPE tasks: a seed, then INSERT ... SELECT doubling; returns seconds."""
    from django.utils import timezone

    import taskflow
    from taskflow.engine import sql
    from taskflow.models import Task

    started = time.perf_counter()
    have = Task.objects.filter(task_type=OLD_TYPE).count()
    finished_at = timezone.now() - timedelta(days=days_ago)
    seed_ids = []
    for start in range(0, min(rows, SEED), 1000):
        batch = [{"task_type": OLD_TYPE, "payload": {"n": i}} for i in range(start, min(rows, SEED, start + 1000))]
        seed_ids += [t.id for t in taskflow.enqueue_many(batch)]
    Task.objects.filter(pk__in=seed_ids).update(status=status, finished_at=finished_at, attempts=1, lease_token=1)
    double_rows(sql.task_table(), OLD_TYPE, have + rows)
    return time.perf_counter() - started


def double_rows(table: str, task_type: str, rows: int) -> None:
    """Grow `task_type`'s rows in `table` to `rows` by INSERT ... SELECT doubling.

    Copies go below the table's lowest id, so ids stay unique; each statement copies at most CHUNK
    rows (its own transaction), so none needs a huge temporary table (MariaDB copies
    a same-table INSERT ... SELECT through one).
    """
    from django.db import connection, transaction

    from taskflow.engine import sql
    from taskflow.models import Task

    columns = [f.column for f in Task._meta.concrete_fields]
    quoted = ", ".join(sql.quote(c) for c in columns)
    select = ", ".join(f"{sql.quote('id')} - %s" if c == "id" else sql.quote(c) for c in columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COUNT(*), MIN({sql.quote('id')}), MAX({sql.quote('id')}) FROM {sql.quote(table)} "
            f"WHERE {sql.quote('task_type')} = %s",
            [task_type],
        )
        have, _, high = cursor.fetchone()
        cursor.execute(f"SELECT MIN({sql.quote('id')}) FROM {sql.quote(table)}")
        (low,) = cursor.fetchone()
    scratch = scratch_table()
    started = time.perf_counter()
    while have < rows:
        take, shift, copied, last = min(have, rows - have), high - low + 1, 0, low - 1
        while copied < take:
            # Ids are sparse (time-based), so a chunk ends at the CHUNK-th id, found by the index.
            where = f"{sql.quote('task_type')} = %s AND {sql.quote('id')} > %s"
            end = chunk_end(table, where, [task_type, last], min(CHUNK, take - copied))
            with transaction.atomic(), connection.cursor() as cursor:
                # Through a scratch table: MariaDB runs a same-table INSERT ... SELECT through a
                # temporary file in /tmp, which a cleaner on this machine removed mid-statement.
                cursor.execute(f"DELETE FROM {sql.quote(scratch)}")
                cursor.execute(
                    f"INSERT INTO {sql.quote(scratch)} ({quoted}) SELECT {select} FROM {sql.quote(table)} "
                    f"WHERE {where} AND {sql.quote('id')} <= %s",
                    [shift, task_type, last, end if end is not None else high],
                )
                cursor.execute(f"INSERT INTO {sql.quote(table)} ({quoted}) SELECT {quoted} FROM {sql.quote(scratch)}")
                copied += cursor.rowcount
            if end is None:
                break
            last = end
        low -= shift
        have += copied
        print(f"    {have:,} / {rows:,} rows in {table} ({time.perf_counter() - started:.0f} s)", flush=True)


def scratch_table() -> str:
    """An empty table with the task table's columns, for copies on their way back into their own table."""
    from django.db import connection

    from taskflow.engine import rolling

    name = "bench_scratch"
    with connection.cursor() as cursor:
        exists = name in connection.introspection.table_names(cursor)
    if not exists:
        with connection.schema_editor() as editor:
            editor.create_model(rolling.history_model(name))
    return name


def chunk_end(table: str, where: str, params: list, rows: int) -> int | None:
    """The id of the `rows`-th row of `table` matching `where` in id order, or None if fewer match."""
    from django.db import connection

    from taskflow.engine import sql

    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {sql.quote('id')} FROM {sql.quote(table)} WHERE {where} "
            f"ORDER BY {sql.quote('id')} LIMIT 1 OFFSET %s",
            [*params, rows - 1],
        )
        row = cursor.fetchone()
    return row[0] if row else None


def copy_table(source: str, target: str, low: int, high: int) -> int:
    """Copy every row of `source` with an id in low..high into `target`, CHUNK rows per statement; rows copied."""
    from django.db import connection, transaction

    from taskflow.engine import sql
    from taskflow.models import Task

    quoted = ", ".join(sql.quote(f.column) for f in Task._meta.concrete_fields)
    copied = 0
    started = time.perf_counter()
    last = low - 1
    while True:
        end = chunk_end(source, f"{sql.quote('id')} > %s", [last], CHUNK)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {sql.quote(target)} ({quoted}) SELECT {quoted} FROM {sql.quote(source)} "
                f"WHERE {sql.quote('id')} > %s AND {sql.quote('id')} <= %s",
                [last, end if end is not None else high],
            )
            copied += cursor.rowcount
        print(f"    {copied:,} rows copied into {target} ({time.perf_counter() - started:.0f} s)", flush=True)
        if end is None:
            break
        last = end
    return copied


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


class MariaDBTuning:
    """On MySQL/MariaDB: a bigger buffer pool for the run and relaxed log flushing during fills; both restored.

    Only server variables that are dynamic in MariaDB 10.11 are set (SET GLOBAL); the server is never
    restarted. Every value set and restored is printed. Does nothing on other databases.
    """

    def __init__(self, buffer_pool: int) -> None:
        from django.db import connection

        self.active = connection.vendor == "mysql" and buffer_pool > 0
        self.buffer_pool = buffer_pool
        self.original: dict[str, int] = {}

    def _set(self, name: str, value: int) -> None:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(f"SET GLOBAL {name} = {int(value)}")
            cursor.execute(f"SELECT @@GLOBAL.{name}")
            print(f"    SET GLOBAL {name} = {value} (now {cursor.fetchone()[0]})", flush=True)

    def start(self) -> None:
        if not self.active:
            return
        from django.db import connection

        with connection.cursor() as cursor:
            for name in ("innodb_buffer_pool_size", "innodb_flush_log_at_trx_commit"):
                cursor.execute(f"SELECT @@GLOBAL.{name}")
                self.original[name] = int(cursor.fetchone()[0])
        print(f"  server settings before the run: {self.original}")
        if self.buffer_pool > self.original["innodb_buffer_pool_size"]:
            self._set("innodb_buffer_pool_size", self.buffer_pool)
            time.sleep(5)  # the resize runs in the background; let it settle before measuring

    def fill(self, relaxed: bool) -> None:
        """innodb_flush_log_at_trx_commit = 2 while filling, the original value while measuring."""
        if self.active:
            name = "innodb_flush_log_at_trx_commit"
            self._set(name, 2 if relaxed else self.original[name])

    def restore(self) -> None:
        if not self.active:
            return
        print("  restoring server settings:")
        for name, value in self.original.items():
            self._set(name, value)


def build_history(position: int, rows: int) -> float:
    """Grow history table `position` (made by a real roll) to `rows` rows by INSERT ... SELECT doubling; seconds.

    It ends in the state a roll of that many rows leaves it: the same table (made by the engine's
    own sync_table), columns and indexes, and its SchedulePos row's count and id range updated.
    The copies keep finished_at, so the newest finished_at recorded stays right.
    """
    from django.db.models import Max, Min

    from taskflow.engine import rolling
    from taskflow.models import SchedulePos

    started = time.perf_counter()
    table = rolling.history_table(position)
    model = rolling.history_model(table)
    double_rows(table, OLD_TYPE, rows)
    span = model.objects.aggregate(low=Min("id"), high=Max("id"))
    count = model.objects.count()
    SchedulePos.objects.filter(position=position).update(row_count=count, min_id=span["low"], max_id=span["high"])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40,000 rows, 2,000 tasks, one run a figure")
    parser.add_argument("--rows", type=int, default=None, help="finished rows for the large case (10,000,000)")
    parser.add_argument("--small", type=int, default=None, help="finished rows for the small case (10,000)")
    parser.add_argument("--tasks", type=int, default=None, help="tasks claimed and completed per measurement (20,000)")
    parser.add_argument("--day-rows", type=int, default=None, help="rows in the day dropped vs deleted (1,000,000)")
    parser.add_argument("--roll-batch", type=int, default=10_000, help="rows moved per roll transaction")
    parser.add_argument(
        "--roll-rows",
        type=int,
        default=0,
        help="rows moved by a real roll (default: all --rows); the history table is then grown to --rows by "
        "INSERT ... SELECT as a roll leaves it",
    )
    parser.add_argument("--repeat", type=int, default=None, help="runs per throughput measurement (5)")
    parser.add_argument(
        "--buffer-pool",
        type=int,
        default=0,
        help="MariaDB/MySQL: SET GLOBAL innodb_buffer_pool_size to this many bytes for the run (and "
        "innodb_flush_log_at_trx_commit = 2 during fills); both restored at the end",
    )
    parser.add_argument("--reuse-db", action="store_true")
    args = parser.parse_args()
    quick = args.quick
    args.rows = args.rows or (40_000 if quick else 10_000_000)
    args.small = args.small or (5_000 if quick else 10_000)
    args.tasks = args.tasks or (2_000 if quick else 20_000)
    args.day_rows = args.day_rows or (10_000 if quick else 1_000_000)
    args.repeat = args.repeat or (1 if quick else 5)
    roll_rows = min(args.roll_rows or args.rows, args.rows)

    url = os.environ.get("DATABASE_URL") or f"sqlite:///{ROOT / 'var' / 'tfbench.sqlite3'}"
    os.environ["DATABASE_URL"] = url
    name = database.ensure_database(url, fresh=not args.reuse_db)
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from django.db.models import Max, Min
    from django.test import override_settings

    from taskflow.engine import rolling, sql

    database.migrate()
    database.reset_tables()
    print(f"bench_rolling on {database.describe()} ({name}); load average {os.getloadavg()[0]:.2f}")
    print(
        f"  rows {args.rows:,} (rolled for real: {roll_rows:,}), small {args.small:,}, "
        f"tasks per measurement {args.tasks:,}, day {args.day_rows:,}"
    )
    big = {**settings.TASKFLOW, "ROLL_MAX_ROWS": 10**12, "ROLL_TABLE_SECONDS": 366 * 86400}
    figures: list[tuple[str, str]] = []
    tuning = MariaDBTuning(args.buffer_pool)
    tuning.start()
    try:
        # First, on the empty task table: a day of history deleted, then the same made again, rolled
        # into its own history table and dropped.
        print(f"- a day of {args.day_rows:,} rows: DELETE (as purge_finished) vs DROP TABLE")
        with override_settings(TASKFLOW=big):
            tuning.fill(True)
            fill_finished(args.day_rows, status="stopped")
            tuning.fill(False)
            delete_seconds = purge_delete(args.day_rows)
            tuning.fill(True)
            fill_finished(args.day_rows, status="stopped")
            tuning.fill(False)
            moved, _ = roll_all(args.roll_batch)
            started = time.perf_counter()
            dropped = rolling.drop_expired(rolling.timezone.now() + timedelta(days=400))
            drop_seconds = time.perf_counter() - started
        figures.append((f"DELETE a day ({args.day_rows:,} rows, purge_finished)", f"{delete_seconds:.2f} s"))
        figures.append((f"drop a day ({moved:,} rows, {', '.join(dropped)})", f"{drop_seconds:.3f} s"))

        print(f"- {args.small:,} finished rows")
        tuning.fill(True)
        fill_finished(args.small)
        tuning.fill(False)
        base = throughput(args.tasks, args.repeat)
        figures.append((f"claim+complete, {args.small:,} finished rows", rate(base)))

        print(f"- rolling {roll_rows:,} rows")
        tuning.fill(True)
        seconds = fill_finished(roll_rows - args.small)
        tuning.fill(False)
        print(f"    filled in {seconds:.1f} s")
        with override_settings(TASKFLOW=big):
            moved, seconds = roll_all(args.roll_batch)
            position = rolling.kept().last().position
        figures.append(
            (f"roll of {moved:,} rows (batch {args.roll_batch:,})", f"{seconds:.1f} s, {moved / seconds:,.0f} rows/s")
        )
        rolled_label = f"claim+complete, {args.rows:,} finished rows rolled"
        if args.rows > moved:
            print(f"- history grown from {moved:,} to {args.rows:,} rows by INSERT ... SELECT, as a roll leaves it")
            tuning.fill(True)
            seconds = build_history(position, args.rows)
            tuning.fill(False)
            print(f"    built in {seconds:.1f} s")
            rolled_label += f" (history built by INSERT ... SELECT as a roll leaves it; rolled for real: {moved:,})"
        rolled = throughput(args.tasks, args.repeat)
        figures.append((rolled_label, rate(rolled)))

        print(f"- {args.rows:,} finished rows, never rolled (the history's rows copied back, the history dropped)")
        table = rolling.history_table(position)
        model = rolling.history_model(table)
        span = model.objects.aggregate(low=Min("id"), high=Max("id"))
        tuning.fill(True)
        started = time.perf_counter()
        copied = copy_table(table, sql.task_table(), span["low"], span["high"])
        tuning.fill(False)
        print(f"    copied {copied:,} rows in {time.perf_counter() - started:.1f} s")
        with override_settings(TASKFLOW=big):
            rolling.drop_expired(rolling.timezone.now() + timedelta(days=400))
        never = throughput(args.tasks, args.repeat)
        figures.append((f"claim+complete, {args.rows:,} finished rows never rolled", rate(never)))
    finally:
        tuning.restore()

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

#!/usr/bin/env python
"""Benchmark of the operator console at a million tasks: server time per page, and a bulk terminate.

Run from the repository root, e.g.:
  DATABASE_URL=mysql://root@127.0.0.1:3306/tf_console_bench .venv/bin/python bench/bench_console.py
The database name must contain "bench": it is dropped and recreated (unless --reuse-db) and filled
with --rows tasks by one INSERT ... SELECT per chunk (MariaDB/MySQL or PostgreSQL). Each page is
requested in-process through Django's test Client (middleware, queries and template rendering:
the server's time, without a network) and the median of --repeat requests is printed, with the
database's share and the page's slowest statement. It prints, never asserts; see bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-bench-only")

from bench import database  # noqa: E402

TYPES = [f"bench.type{n}" for n in range(9)]
BULK_TYPE = "bench.bulk"  # pending tasks the bulk terminate stops: BULK_ROWS, or a tenth of a smaller table
BULK_ROWS = 100_000
HOSTS = 4
NODE = 1023  # the id generator's last node: ids minted by this process (node leases) never collide
EPOCH_MS = 1_735_689_600_000  # taskflow.engine.ids.EPOCH_MS
SPACING_MS = 600  # one task every 0.6 s: a million tasks span about a week
CHUNK = 100_000
TARGET_MS = 300.0


@dataclass
class Timing:
    name: str
    url: str
    median_ms: float
    db_ms: float
    queries: int
    status: int
    slowest: str
    shown: str  # the list's count label ("10,000+"), or "" for other pages


def bulk_rows(rows: int) -> int:
    """How many of `rows` are pending `bench.bulk` tasks (the first ones); a small table keeps most for the types."""
    return min(BULK_ROWS, rows // 10)


def fill(rows: int) -> None:
    """Insert `rows` tasks spread over a week, types, statuses, keys, traces, users, stages, workers."""
    from django.db import connection, transaction

    from taskflow.engine.configs import configs
    from taskflow.models import Task, WorkerProcess

    vendor = connection.vendor
    if vendor not in ("mysql", "postgresql"):
        raise SystemExit("bench_console fills its table with INSERT ... SELECT on MariaDB/MySQL or PostgreSQL")
    for task_type in [*TYPES, BULK_TYPE]:
        configs.get(task_type)
    now_ms = int(time.time() * 1000)
    start_ms = now_ms - rows * SPACING_MS
    table = connection.ops.quote_name(Task._meta.db_table)
    columns, select = _row_sql(vendor, start_ms, bulk_rows(rows))
    with connection.cursor() as cursor:
        if vendor == "mysql":
            cursor.execute("SET time_zone = '+00:00'")  # FROM_UNIXTIME in UTC, as Django stores datetimes
        for low in range(1, rows + 1, CHUNK):
            high = min(rows, low + CHUNK - 1)
            source = (
                # MariaDB's sequence tables count in BIGINT UNSIGNED, which refuses negative arithmetic.
                f"(SELECT CAST(seq AS SIGNED) AS seq FROM seq_{low}_to_{high}) AS s"
                if vendor == "mysql"
                else f"generate_series({low}, {high}) AS s(seq)"
            )
            with transaction.atomic():
                cursor.execute(f"INSERT INTO {table} ({', '.join(columns)}) SELECT {select} FROM {source}")
            print(f"  inserted {high:,} / {rows:,}", flush=True)
        cursor.execute(f"ANALYZE TABLE {table}" if vendor == "mysql" else f"ANALYZE {table}")
    for host in range(HOSTS):
        WorkerProcess.objects.update_or_create(
            worker_id=_worker(host),
            defaults={
                "host": f"bench-host-{host}",
                "pid": 100,
                "task_types": TYPES,
                "concurrency": 16,
                "started_at": _now(),
                "heartbeat_at": _now(),
            },
        )


def _now():  # noqa: ANN202
    from django.utils import timezone

    return timezone.now()


def _worker(host: int) -> str:
    return f"bench-host-{host}:100:w"


def _row_sql(vendor: str, start_ms: int, bulk_count: int) -> tuple[list[str], str]:
    """The column list and the SELECT expressions that make row number `seq` into a task."""
    my = vendor == "mysql"

    def text(*parts: str) -> str:
        return f"CONCAT({', '.join(parts)})" if my else "(" + " || ".join(f"({p})::text" for p in parts) + ")"

    def at(offset_ms: str) -> str:
        seconds = f"({start_ms} + seq * {SPACING_MS} + {offset_ms}) / 1000.0"
        return f"FROM_UNIXTIME({seconds})" if my else f"to_timestamp({seconds})"

    def json(expr: str) -> str:
        return expr if my else f"({expr})::jsonb"

    bulk = f"seq <= {bulk_count}"
    bucket = "MOD(seq, 100)"
    # What runs now: 64 tasks (four workers of 16), as a live deployment's processing set is small.
    running = f"(NOT ({bulk}) AND MOD(seq, 15625) = 0)"
    status = (
        f"CASE WHEN {bulk} THEN 'pending' WHEN {running} THEN 'processing' WHEN {bucket} < 60 THEN 'success' "
        f"WHEN {bucket} < 70 THEN 'failed' WHEN {bucket} < 75 THEN 'stopped' ELSE 'pending' END"
    )
    finished = f"(NOT ({bulk}) AND NOT {running} AND {bucket} < 75)"
    started = f"({finished} OR {running})"
    priority = "CASE WHEN MOD(seq, 13) = 0 THEN MOD(seq, 201) - 100 ELSE 0 END"
    delayed = f"({bulk} OR MOD(seq, 7) = 0)"
    run_after = f"CASE WHEN {delayed} THEN {at('86400000')} ELSE {at('0')} END"
    order_offset = f"CASE WHEN {delayed} THEN 86400000 ELSE 0 END - ({priority}) * 1000"
    whole = (lambda a, b: f"FLOOR({a} / {b})") if my else (lambda a, b: f"({a} / {b})")
    worker = text("'bench-host-'", f"MOD({whole('seq', 15625)}, {HOSTS})", "':100:w'")
    type_number = f"MOD({whole('seq', 7)}, {len(TYPES)})"
    log_entry = text(
        """'[{"attempt": 1, "worker": "'""",
        worker,
        """'", "started_at": "2026-01-01T00:00:00+00:00", "cost_ms": 12, "outcome": "success", "error": ""}]'""",
    )
    values = {
        "id": f"(({start_ms} + seq * {SPACING_MS} - {EPOCH_MS}) * 4194304) + {NODE} * 4096",
        "task_type": f"CASE WHEN {bulk} THEN '{BULK_TYPE}' ELSE {text("'bench.type'", type_number)} END",
        "task_key": f"CASE WHEN MOD(seq, 3) = 0 THEN {text("'k'", 'seq')} ELSE NULL END",
        "version": "0",
        "priority": priority,
        "status": status,
        "status_msg": "''",
        "payload": json(text("""'{"n": '""", "seq", "'}'")),
        "result": f"CASE WHEN {finished} THEN {json("""'{"ok": true}'""")} ELSE NULL END",
        "context": json("'{}'"),
        "checkpoint": "NULL",
        "stage": "CASE WHEN MOD(seq, 11) = 0 THEN 'index' ELSE '' END",
        "attempts": f"CASE WHEN {started} THEN 1 ELSE 0 END",
        "run_after": run_after,
        "order_time": at(order_offset),
        "worker_id": f"CASE WHEN {started} THEN {worker} ELSE '' END",
        "lease_expires_at": f"CASE WHEN {running} THEN {at('999999999')} ELSE NULL END",
        "lease_token": f"CASE WHEN {started} THEN 1 ELSE 0 END",
        "retry_same_host": "0",
        "prefer_host": "''",
        "trace_id": f"CASE WHEN MOD(seq, 5) = 0 THEN {text("'t'", 'seq')} ELSE '' END",
        "schedule_log": f"CASE WHEN {finished} THEN {json(log_entry)} ELSE {json("'[]'")} END",
        "user_id": f"CASE WHEN MOD(seq, 2) = 0 THEN {text("'u'", 'MOD(seq, 5000)')} ELSE '' END",
        "created_at": at("0"),
        "updated_at": at("5000"),
        "started_at": f"CASE WHEN {started} THEN {at('1000')} ELSE NULL END",
        "finished_at": f"CASE WHEN {finished} THEN {at('5000')} ELSE NULL END",
    }
    from django.db import connection

    return [connection.ops.quote_name(c) for c in values], ", ".join(values.values())


def seq_id(seq: int, rows: int) -> int:
    """The id `fill` gave row number `seq` (its start time is recomputed from the newest id)."""
    from taskflow.models import Task

    newest = Task.objects.order_by("-id").values_list("id", flat=True).first()
    assert newest is not None
    newest_ms = (newest >> 22) + EPOCH_MS
    start_ms = newest_ms - rows * SPACING_MS
    return ((start_ms + seq * SPACING_MS - EPOCH_MS) << 22) + NODE * 4096


def measure(client, name: str, url: str, repeat: int) -> Timing:  # noqa: ANN001
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client.get(url)  # warm: caches, the ScheduleCfg rows, the session
    times, db_times, slowest = [], [], ("", 0.0)
    queries = status = 0
    response = None
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as captured:
            began = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - began) * 1000)
        status = response.status_code
        spent = [(q["sql"], float(q["time"]) * 1000) for q in captured.captured_queries]
        db_times.append(sum(t for _, t in spent))
        queries = len(spent)
        top = max(spent, key=lambda q: q[1], default=("", 0.0))
        if top[1] > slowest[1]:
            slowest = top
    found = re.search(r'<span class="tf-count">([^<]*)</span>', response.content.decode()) if response else None
    return Timing(
        name,
        url,
        statistics.median(times),
        statistics.median(db_times),
        queries,
        status,
        slowest[0],
        found.group(1) if found else "",
    )


def measure_all(client, pages: list[tuple[str, str]], repeat: int, explain: bool) -> list[Timing]:  # noqa: ANN001
    """Measure and print each page; a page answering 404 (the dashboard, not installed yet) is skipped."""
    from django.db import connection

    results = []
    for name, url in pages:
        timing = measure(client, name, url, repeat)
        if timing.status == 404:
            print(f"{name:40} (not installed: 404)")
            continue
        results.append(timing)
        flag = "" if timing.median_ms < TARGET_MS else "  <-- over target"
        print(
            f"{name:40} {timing.median_ms:7.1f} ms  (db {timing.db_ms:6.1f} ms, {timing.queries:2} queries, "
            f"HTTP {timing.status}{', rows ' + timing.shown if timing.shown else ''}){flag}",
            flush=True,
        )
        if explain and timing.slowest:
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN " + timing.slowest)
                for row in cursor.fetchall():
                    print("     ", row)
    return results


def timed(label: str, work: Callable[[], object]) -> tuple[float, object]:
    began = time.perf_counter()
    value = work()
    seconds = time.perf_counter() - began
    print(f"{label}: {seconds:.2f} s", flush=True)
    return seconds, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20,000 tasks, 2 requests a page")
    parser.add_argument("--rows", type=int, default=None, help="tasks in the table (default 1,000,000)")
    parser.add_argument("--repeat", type=int, default=None, help="requests per page; the median is printed (7)")
    parser.add_argument("--reuse-db", action="store_true", help="keep a database already filled with --rows tasks")
    parser.add_argument("--skip-bulk", action="store_true", help="leave out the bulk terminate (it changes the data)")
    parser.add_argument("--explain", action="store_true", help="print EXPLAIN of each page's slowest statement")
    args = parser.parse_args()
    args.rows = args.rows or (20_000 if args.quick else 1_000_000)
    args.repeat = args.repeat or (2 if args.quick else 7)
    if args.rows < 1000:
        raise SystemExit("--rows must be at least 1,000")
    bulk = bulk_rows(args.rows)
    url = os.environ.get("DATABASE_URL", "")
    database.ensure_database(url, fresh=not args.reuse_db)

    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.test import Client

    from taskflow.models import Status, Task

    database.migrate()
    print(f"# console benchmark on {database.describe()}, {args.rows:,} tasks")
    if not args.reuse_db or not Task.objects.exists():
        timed(f"fill {args.rows:,} tasks", lambda: fill(args.rows))
    user = User.objects.filter(username="bench-admin").first() or User.objects.create_superuser(
        "bench-admin", "bench@example.com", "bench"
    )
    client = Client(SERVER_NAME="localhost")
    client.force_login(user)

    middle = seq_id(args.rows // 2, args.rows)
    # A row that exists for each search: keys on every 3rd row, traces on every 5th, users on even rows.
    key_row, trace_row = (args.rows // 3) * 3, (args.rows // 5) * 5
    hour = [time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() - 3 * 86400 + s)) for s in (0, 3600)]
    tasks = "/admin/taskflow/task/"
    pages = [
        ("list, unfiltered", tasks),
        ("list, status+type (failed)", tasks + "?" + urlencode({"status__exact": "failed", "task_type": TYPES[3]})),
        ("list, status+type (pending)", tasks + "?" + urlencode({"status__exact": "pending", "task_type": TYPES[3]})),
        ("list, status (processing)", tasks + "?status__exact=processing"),
        ("list, status (failed)", tasks + "?status__exact=failed"),
        ("list, type", tasks + "?" + urlencode({"task_type": TYPES[5]})),
        ("list, search by id", tasks + f"?q={middle}"),
        ("list, search by key", tasks + f"?q=k{key_row}"),
        ("list, search by trace id", tasks + f"?q=t{trace_row}"),
        ("list, search by user id (100 tasks)", tasks + "?q=u42"),
        # Payload search reads the newest 10,000 matching the filters (payload "n" is the row's seq).
        ("list, search payload.n, a recent task", tasks + "?" + urlencode({"q": f"payload.n = {args.rows - 7}"})),
        ("list, search payload.n, none recent", tasks + "?" + urlencode({"q": "payload.n = 1"})),
        (
            "list, type + search payload.n",
            tasks + "?" + urlencode({"task_type": TYPES[5], "q": f"payload.n = {args.rows - 7}"}),
        ),
        ("list, stage", tasks + "?stage=index"),
        ("list, stage+type", tasks + "?" + urlencode({"stage": "index", "task_type": TYPES[2]})),
        ("list, priority >= 90", tasks + "?priority_min=90"),
        (
            "list, created in one hour 3 days ago",
            tasks + "?" + urlencode({"created_from": hour[0], "created_to": hour[1]}),
        ),
        (
            "list, finished in one hour 3 days ago",
            tasks + "?" + urlencode({"finished_from": hour[0], "finished_to": hour[1]}),
        ),
        ("list, running on a worker", tasks + "?" + urlencode({"worker": _worker(1)})),
        ("list, page 200", tasks + "?p=200"),
        ("task page", f"{tasks}{middle}/change/"),
        ("task types", "/admin/taskflow/schedulecfg/"),
        ("workers", "/admin/taskflow/workerprocess/"),
        ("events", "/admin/taskflow/taskevent/"),
        ("dashboard", "/admin/taskflow/dashboard/"),
        ("/metrics (staff session)", "/metrics"),
    ]
    # The dashboard and /metrics read the rollup that taskwatch refreshes every pass: its first
    # refresh (the last hour's minutes and a full count) and a steady-state one are timed too.
    from taskflow.engine import stats
    from taskflow.models import TaskStats, TaskStatsMinute

    TaskStats.objects.all().delete()
    TaskStatsMinute.objects.all().delete()
    timed("stats refresh, first (the last hour, and the full count by status)", stats.refresh)
    timed("stats refresh, steady state (the count is not due yet)", stats.refresh)
    results = measure_all(client, pages, args.repeat, args.explain)

    if not args.skip_bulk:
        bulk_filter = urlencode({"status__exact": "pending", "task_type": BULK_TYPE})
        confirm_url = "/admin/taskflow/task/operate/terminate/?" + urlencode(
            {"select_across": "1", "_changelist_filters": bulk_filter}
        )
        seconds, response = timed(
            f"confirmation page (dry run) of terminate, all {bulk:,} matching", lambda: client.get(confirm_url)
        )
        print(f"  HTTP {response.status_code}")
        seconds, response = timed(
            f"bulk terminate of {bulk:,} tasks by filter (one POST)",
            lambda: client.post(
                "/admin/taskflow/task/operate/terminate/",
                {"select_across": "1", "_changelist_filters": bulk_filter, "reason": "bench", "_confirm": "1"},
            ),
        )
        stopped = Task.objects.filter(task_type=BULK_TYPE, status=Status.STOPPED).count()
        print(f"  HTTP {response.status_code}; {stopped:,} stopped; {bulk / seconds:,.0f} tasks/s")
        bulk_task = Task.objects.filter(task_type=BULK_TYPE).order_by("id").values_list("id", flat=True)[bulk // 2]
        events = "/admin/taskflow/taskevent/"
        after = [
            ("events (after the bulk terminate)", events),
            ("events, action terminate", events + "?action=terminate"),
            ("events, actor", events + "?actor=bench-admin"),
            ("events, search by task id", events + f"?q={bulk_task}"),
            ("task page, with its event", f"{tasks}{bulk_task}/change/"),
        ]
        results += measure_all(client, after, args.repeat, args.explain)

    over = [t.name for t in results if t.median_ms >= TARGET_MS]
    print(f"# pages over {TARGET_MS:.0f} ms: {', '.join(over) if over else 'none'}")
    print(f"# load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

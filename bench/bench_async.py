#!/usr/bin/env python
"""Benchmark of async handlers: N tasks that each `await asyncio.sleep(1)`, drained by ONE worker at default settings.

Run from the repository root, e.g.:
  DATABASE_URL=mysql://root@127.0.0.1:3306/tfbench_h8 REDIS_URL=redis://127.0.0.1:6379/14 \\
    .venv/bin/python bench/bench_async.py [--quick] [--runs 3]
The target (issue 16): 10,000 such tasks drain in <= 15 s with one `taskworker` given no option but
`--types`. The tasks are committed in one transaction to a worker already waiting; the drain time
runs from that commit to the last success. It prints the drain time, tasks/s, the worker's peak RSS
and the conditions; it never asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-bench-only")

from bench import database  # noqa: E402
from bench.workers import WorkerPool  # noqa: E402

TASK_TYPE = "bench.async_sleep"
TARGET_SECONDS = 15.0


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB; NaN where /proc cannot tell."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def drain_once(pool: WorkerPool, n: int, seconds: float, timeout: float) -> tuple[float, float, int, float]:
    """Enqueue n sleeping tasks in one transaction to a waiting worker; (seconds, span, succeeded, peak RSS MB)."""
    from django.db import transaction
    from django.db.models import Max, Min

    import taskflow
    from taskflow.models import Status, Task, WorkerProcess

    database.reset_tables()
    proc = pool.start("taskworker", "--types", TASK_TYPE)
    deadline = time.monotonic() + 60
    # Started and waiting (its liveness row is written once it runs): Django's start-up is not measured.
    while not WorkerProcess.objects.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)
    items = [{"task_type": TASK_TYPE, "payload": {"seconds": seconds}} for _ in range(n)]
    with transaction.atomic():
        for start in range(0, n, 1000):
            taskflow.enqueue_many(items[start : start + 1000])
    committed = time.monotonic()
    deadline = committed + timeout
    done = 0
    while time.monotonic() < deadline and proc.poll() is None:
        done = Task.objects.filter(status=Status.SUCCESS).count()
        if done == n:
            break
        time.sleep(0.1)
    wall = time.monotonic() - committed
    rss = peak_rss_mb(proc.pid)
    span = Task.objects.aggregate(first=Min("started_at"), last=Max("finished_at"))
    elapsed = (span["last"] - span["first"]).total_seconds() if span["last"] else float("nan")
    pool.stop([proc])
    if done != n:
        print(f"  ! {done} of {n} succeeded within {timeout:.0f}s:\n{pool.tail(proc)}")
    return wall, elapsed, done, rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks per drain (10,000)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 500 tasks, one drain")
    parser.add_argument("--runs", type=int, default=1, help="drains to take the median of (1)")
    parser.add_argument("--seconds", type=float, default=1.0, help="each task's asyncio.sleep (1)")
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL", "")
    if "bench" not in url:
        parser.error("set DATABASE_URL to a database whose name contains 'bench' (it is emptied)")
    n, runs = (500, 1) if args.quick else (args.tasks, args.runs)

    database.ensure_database(url, fresh=False)
    import django

    django.setup()
    database.migrate()
    database.reset_schedule_configs("bench.")
    from taskflow.conf import get_settings

    settings = get_settings()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    print(f"commit {commit.stdout.strip() or '?'}{' (with uncommitted changes)' if dirty.stdout.strip() else ''}; ")
    print(f"database: {database.describe()}; redis: {'yes' if os.environ.get('REDIS_URL') else 'no'}; ", end="")
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    print(
        f"one `taskworker --types {TASK_TYPE}` at default settings (ASYNC_CONCURRENCY={settings.ASYNC_CONCURRENCY}, "
        f"SCHEDULE_LIMIT={settings.SCHEDULE_LIMIT}, REPORT_INTERVAL={settings.REPORT_INTERVAL})"
    )
    print(f"{n} tasks, each `await asyncio.sleep({args.seconds:g})`, committed at once to the waiting worker")

    pool = WorkerPool(Path(tempfile.mkdtemp(prefix="taskflow-bench-async-")), {**os.environ})
    walls = []
    try:
        for run in range(runs):
            wall, span, done, rss = drain_once(pool, n, args.seconds, timeout=max(120.0, n / 50))
            walls.append(wall)
            print(
                f"  run {run + 1}: {done} of {n} in {wall:.2f}s ({n / wall:,.0f} tasks/s; "
                f"{span:.2f}s first start to last finish); worker peak RSS {rss:.0f} MB"
            )
    finally:
        pool.close()
    database.reset_tables()
    median = statistics.median(walls)
    verdict = ("met" if median <= TARGET_SECONDS else "MISSED") if n == 10_000 else "n/a for this N"
    print(
        f"async drain of {n}: median {median:.2f}s, {n / median:,.0f} tasks/s "
        f"(target <= {TARGET_SECONDS:.0f}s for 10,000: {verdict})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark of the django.tasks backend against taskflow's own API; it prints, never asserts.

Enqueue rate: the same single-task workload through `fn.enqueue(i)` (Django's API, TaskflowBackend)
and `taskflow.enqueue("bench.noop", {"args": [i], "kwargs": {}})`, taking turns every 100 tasks so a
drifting machine favours neither; target: Django's API within 20 % of taskflow's. Drain rate: burst workers
running N `@task` functions vs N handler tasks (the backend adds a row read and three signals per
attempt). Run from the repository root, e.g.:
  DATABASE_URL=mysql://root@127.0.0.1:3306/tfbench_backend REDIS_URL=redis://127.0.0.1:6379/8 \
    .venv/bin/python bench/bench_backend.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
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

HANDLER_TYPE = "bench.noop"
DJANGO_TYPE = "bench.benchapp.django_tasks.django_noop"
BLOCK = 100  # enqueues in a row through one API before the other takes its turn


def enqueue_rates(n: int, runs: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Tasks per second of each API, and this process's CPU microseconds per task, over `runs` runs.

    The CPU time leaves out the wait for the database, so it shows the API's own cost even on a
    machine whose other load makes the rates noisy.
    """
    import taskflow
    from bench.benchapp.django_tasks import django_noop

    def via_taskflow(first: int) -> None:
        for i in range(first, first + BLOCK):
            taskflow.enqueue(HANDLER_TYPE, {"args": [i], "kwargs": {}})

    def via_django(first: int) -> None:
        for i in range(first, first + BLOCK):
            django_noop.enqueue(i)

    apis = {"taskflow.enqueue": via_taskflow, "fn.enqueue": via_django}
    rates: dict[str, list[float]] = {label: [] for label in apis}
    cpu: dict[str, list[float]] = {label: [] for label in apis}
    for run in range(runs):
        database.reset_tables()
        wall = dict.fromkeys(apis, 0.0)
        busy = dict.fromkeys(apis, 0.0)
        # The two APIs take turns every BLOCK tasks (who goes first alternating), so a change in the
        # machine's other load hits both alike.
        for block, first in enumerate(range(0, n, BLOCK)):
            order = list(apis) if block % 2 == 0 else list(reversed(apis))
            for label in order:
                started, cpu_started = time.perf_counter(), time.process_time()
                apis[label](first)
                wall[label] += time.perf_counter() - started
                busy[label] += time.process_time() - cpu_started
        count = (n // BLOCK) * BLOCK
        for label in apis:
            rates[label].append(count / wall[label])
            cpu[label].append(busy[label] / count * 1e6)
            rate = f"{count} tasks in {wall[label]:.2f}s = {count / wall[label]:,.0f}/s"
            print(f"  run {run + 1} {label:17} {rate}, {busy[label] / count * 1e6:.0f} us CPU/task", flush=True)
    return rates, cpu


def drain_rates(pool: WorkerPool, n: int, concurrency: int, runs: int) -> dict[str, list[float]]:
    """Tasks per second one burst worker drains, for `n` preloaded tasks of each kind."""
    from django.db.models import Max, Min

    import taskflow
    from bench.benchapp.django_tasks import django_noop
    from taskflow.models import Status, Task

    rates: dict[str, list[float]] = {"drain @task": [], "drain handler": []}
    for run in range(runs):
        for label, task_type in (("drain handler", HANDLER_TYPE), ("drain @task", DJANGO_TYPE)):
            database.reset_tables()
            if task_type == HANDLER_TYPE:
                taskflow.enqueue_many([{"task_type": HANDLER_TYPE, "payload": {"args": [i]}} for i in range(n)])
            else:
                for i in range(n):
                    django_noop.enqueue(i)
            proc = pool.start("taskworker", "--burst", "--types", task_type, "--concurrency", str(concurrency))
            if not pool.wait([proc], timeout=300):
                print(f"  ! {label} did not finish within 300 s:\n{pool.tail(proc)}")
                continue
            # From the first start to the last finish, as the rows say: the worker's start-up is not counted.
            span = Task.objects.aggregate(first=Min("started_at"), last=Max("finished_at"))
            elapsed = (span["last"] - span["first"]).total_seconds()
            done = Task.objects.filter(status=Status.SUCCESS).count()
            if done != n:
                print(f"  ! {label}: {done} of {n} succeeded:\n{pool.tail(proc)}")
            rates[label].append(n / elapsed)
            print(f"  run {run + 1} {label:17} {n} tasks in {elapsed:.2f}s = {n / elapsed:,.0f}/s", flush=True)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--no-drain", action="store_true", help="measure enqueueing only")
    parser.add_argument("--reuse-db", action="store_true", help="keep the existing bench database")
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL"):
        parser.error("set DATABASE_URL to a database whose name contains 'bench'")
    n, runs, drain_n = (300, 2, 500) if args.quick else (3_000, 7, 5_000)

    database.ensure_database(os.environ["DATABASE_URL"], fresh=not args.reuse_db)
    import django

    django.setup()
    database.migrate()
    database.reset_schedule_configs("bench.")
    _warm_up()
    print(f"database: {database.describe()}; redis: {'yes' if os.environ.get('REDIS_URL') else 'no'}")
    print(f"load average: {os.getloadavg()[0]:.2f}; {runs} runs of {n} single enqueues through each API")

    print("\n[enqueue]")
    rates, cpu = enqueue_rates(n, runs)
    if not args.no_drain:
        print(f"\n[drain] one burst worker, concurrency 32, {drain_n} tasks")
        pool = WorkerPool(Path(tempfile.mkdtemp(prefix="taskflow-bench-backend-")), {**os.environ})
        try:
            rates |= drain_rates(pool, drain_n, 32, max(1, runs // 2))
        finally:
            pool.close()
    database.reset_tables()

    print("\nfigure               median      runs")
    for label, values in rates.items():
        if values:
            shown = ", ".join(f"{v:,.0f}" for v in values)
            print(f"{label:17} {statistics.median(values):>9,.0f}/s  [{shown}]")
    for label, values in cpu.items():
        print(f"{label:17} {statistics.median(values):>9,.0f} us CPU/task")
    ratio = statistics.median(rates["fn.enqueue"]) / statistics.median(rates["taskflow.enqueue"])
    verdict = "met" if ratio >= 0.8 else "MISSED"
    print(f"fn.enqueue / taskflow.enqueue = {ratio:.1%} of the rate (target >= 80 %: {verdict})")
    return 0


def _warm_up() -> None:
    """Create both types' config rows and lease an id node before anything is timed."""
    import taskflow
    from bench.benchapp.django_tasks import django_noop

    for i in range(20):
        taskflow.enqueue(HANDLER_TYPE, {"warm": i})
        django_noop.enqueue(i)
    database.reset_tables()


if __name__ == "__main__":
    sys.exit(main())

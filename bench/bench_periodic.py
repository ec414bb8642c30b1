#!/usr/bin/env python
"""Benchmark of the periodic duty: what one taskwatch pass costs with N schedules.

Run from the repository root, e.g.:
  DATABASE_URL=mysql://root@127.0.0.1:3306/tf_periodic_bench .venv/bin/python bench/bench_periodic.py
The database name must contain "bench": it is dropped and recreated. The duty
(`fire_periodic_tasks`) runs in this process, as the leader runs it, with the clock it is given:
a pass where every schedule is due (one task each), a pass where none is, and the sync of N
declared schedules (first sync, then an unchanged one). Medians of --repeat passes; it prints,
never asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-bench-only")

from bench import database  # noqa: E402

T0 = 1_800_000_000  # a multiple of 60: every schedule ticks at T0 + k * 60


def median_ms(run: Callable[[int], object], repeat: int) -> float:
    times = []
    for i in range(repeat):
        started = time.perf_counter()
        run(i)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20 schedules, 2 passes a figure")
    parser.add_argument("--schedules", type=int, default=None, help="schedules (default 100)")
    parser.add_argument("--repeat", type=int, default=None, help="passes per figure; the median is printed (5)")
    args = parser.parse_args()
    args.schedules = args.schedules or (20 if args.quick else 100)
    args.repeat = args.repeat or (2 if args.quick else 5)
    database.ensure_database(os.environ.get("DATABASE_URL", ""), fresh=True)

    import django

    django.setup()
    from django.conf import settings
    from django.test import override_settings

    from taskflow.engine.periodic import create_schedule, fire_periodic_tasks, sync_schedules
    from taskflow.models import PeriodicTask, Task

    database.migrate()
    n = args.schedules
    print(f"# periodic duty on {database.describe()}, {n} schedules (every 60 s), median of {args.repeat} passes")
    for i in range(n):
        create_schedule(PeriodicTask(name=f"s{i}", task_type="bench.noop", every=60), now=T0)

    # Pass k happens 60 s after the previous one: every schedule has exactly one tick due.
    due = median_ms(lambda k: fire_periodic_tasks(T0 + 60 * (k + 1)), args.repeat)
    fired = Task.objects.count()
    idle = median_ms(lambda k: fire_periodic_tasks(T0 + 60 * args.repeat + 1), args.repeat)
    print(f"pass, all {n} due (one task each): {due:8.1f} ms  ({due / n:.2f} ms per schedule; {fired} tasks in all)")
    print(f"pass, none due:                  {idle:8.1f} ms")

    PeriodicTask.objects.all().delete()
    spec = {"task_type": "bench.noop", "cron": "*/5 * * * *", "timezone": "Europe/Paris"}
    declared = {f"d{i}": spec for i in range(n)}
    with override_settings(TASKFLOW={**settings.TASKFLOW, "PERIODIC": declared}):
        first = median_ms(lambda k: (PeriodicTask.objects.all().delete(), sync_schedules(T0)), 1)
        again = median_ms(lambda k: sync_schedules(T0), args.repeat)
    print(f"sync of {n} declarations, first: {first:8.1f} ms (creates the rows)")
    print(f"sync of {n} declarations, again: {again:8.1f} ms (nothing changed: runs every pass)")


if __name__ == "__main__":
    main()

"""What the per-task log line costs: one `taskworker --burst` draining no-op tasks at -l INFO
(a line per task) and at -l WARNING (none), alternately, several times; prints the medians.

    DATABASE_URL=mysql://root@127.0.0.1:3306/<db> REDIS_URL=redis://127.0.0.1:6379/<n> \\
        .venv/bin/python bench/bench_logging.py [--tasks 5000] [--reps 5] [--concurrency 8]

Migrates the database named by DATABASE_URL and deletes its bench.noop tasks before each run.
The drain rate is tasks / (last finish - first start), so process start-up does not count; the
worker's output goes to a file (the lines are written, as under a supervisor), its size printed.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--micro", action="store_true", help="only time runtime.logs.attempts_ended in-process")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 500 tasks, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.reps = min(args.tasks, 500), 1
    if args.micro:
        micro()
        return

    import django

    django.setup()
    from django.core.management import call_command
    from django.db.models import Max, Min

    import taskflow
    from taskflow.models import Status, Task

    call_command("migrate", verbosity=0)
    rates: dict[str, list[float]] = {"INFO": [], "WARNING": []}
    cpu_us: dict[str, list[float]] = {"INFO": [], "WARNING": []}
    out_dir = Path(tempfile.mkdtemp(prefix="bench-logging-"))
    for rep in range(args.reps):
        # Alternate which level goes first, so a drifting machine load favours neither.
        for level in ("INFO", "WARNING") if rep % 2 == 0 else ("WARNING", "INFO"):
            Task.objects.filter(task_type="bench.noop").delete()
            taskflow.enqueue_many([{"task_type": "bench.noop", "payload": {"n": i}} for i in range(args.tasks)])
            log = out_dir / f"{rep}-{level}.log"
            command = [sys.executable, str(ROOT / "manage.py"), "taskworker", "--burst", "--types", "bench.noop"]
            command += ["--concurrency", str(args.concurrency), "-l", level]
            started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
            with open(log, "wb") as out:
                subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=600, check=True)
            wall, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
            # The worker's own CPU (start-up included) per task: less swayed by a busy machine than rates.
            cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / args.tasks * 1e6
            cpu_us[level].append(cpu)
            done = Task.objects.filter(task_type="bench.noop", status=Status.SUCCESS)
            span = done.aggregate(first=Min("started_at"), last=Max("finished_at"))
            count = done.count()
            seconds = (span["last"] - span["first"]).total_seconds()
            rates[level].append(count / seconds)
            lines = sum(1 for line in log.read_text().splitlines() if " taskflow.tasks " in line)
            print(
                f"rep {rep} {level:7} {count} tasks in {seconds:6.2f} s = {count / seconds:7.0f}/s "
                f"(wall {wall:5.1f} s, worker CPU {cpu:5.0f} us/task, {lines} task lines, "
                f"{log.stat().st_size} bytes of output)",
                flush=True,
            )
    info, warning = statistics.median(rates["INFO"]), statistics.median(rates["WARNING"])
    print(f"median drain rate: -l INFO {info:.0f}/s, -l WARNING {warning:.0f}/s, INFO/WARNING = {info / warning:.3f}")
    info, warning = statistics.median(cpu_us["INFO"]), statistics.median(cpu_us["WARNING"])
    print(f"median worker CPU: -l INFO {info:.0f} us/task, -l WARNING {warning:.0f} us/task, + {info - warning:.0f} us")
    Task.objects.filter(task_type="bench.noop").delete()


def micro(n: int = 20000) -> None:
    """Microseconds per report in `attempts_ended`: lines written to /dev/null (text, JSON), and turned off."""
    import logging
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from taskflow.runtime import logs

    later = datetime.now(UTC) + timedelta(seconds=5)
    reports = []
    for i in range(n):
        task = SimpleNamespace(id=252137109023424513 + i, trace_id="f0e43cc6c7f8", task_type="bench.noop", attempt=1)
        failed = i % 10 == 0
        written = {"status": "pending", "run_after": later} if failed else {"status": "success"}
        outcome = "error" if failed else "success"
        reports.append(SimpleNamespace(task=task, outcome=outcome, written=written, cost_ms=3, error="E: x", detail=""))
    logger = logging.getLogger("taskflow")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    with open(os.devnull, "w") as sink:
        for name, level, formatter in (
            ("off (-l WARNING)", "WARNING", None),
            ("text to /dev/null", "INFO", logging.Formatter(logs.TEXT_FORMAT)),
            ("json to /dev/null", "INFO", logs.JsonFormatter()),
        ):
            handler = logging.StreamHandler(sink)
            if formatter:
                handler.setFormatter(formatter)
            logger.addHandler(handler)
            logger.setLevel(level)
            timings = []
            for _ in range(5):
                started = time.perf_counter()
                for start in range(0, n, 100):  # the worker's batches
                    logs.attempts_ended(reports[start : start + 100])
                timings.append((time.perf_counter() - started) / n * 1e6)
            logger.removeHandler(handler)
            print(f"{name:20} {statistics.median(timings):7.2f} us per task (median of 5 x {n})")


if __name__ == "__main__":
    main()

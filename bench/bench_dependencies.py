#!/usr/bin/env python
"""Benchmark of task dependencies in the engine (in-process, no worker processes).

Run from the repository root, e.g.:
  DATABASE_URL=postgres://postgres@127.0.0.1:5432/tf_deps_bench .venv/bin/python bench/bench_dependencies.py
The database name must contain "bench": it is dropped and recreated (unless --reuse-db). It prints
figures, never asserts; see bench/README.md ("Dependencies").

- finish overhead: finish_attempts of N successes (batches of 100) of tasks nobody waits for, with
  the release step as shipped and with it removed, and the release step alone for one report of
  100 tasks: what dependencies cost every other task.
- enqueue: N single enqueues without and with `depends_on=[one pending task]`.
- fan-out release: one task with N waiting dependents succeeds; time of its release.
- cascade: a chain of depth D whose root fails; time until the last link is stopped.
- repair pass: `repair_waiting` over N open edges (N/10 unfinished dependencies): the watcher's cost per pass.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-bench-only")

from bench import database  # noqa: E402

T = "bench.noop"


def reset() -> None:
    from taskflow.models import TaskDependency

    database.reset_tables()
    TaskDependency.objects.all().delete()


def finish_all(ids: list[int]) -> float:
    """Claim and succeed these tasks, 100 per report; returns the seconds spent in finish_attempts."""
    from taskflow.engine.attempts import Outcome, Report
    from taskflow.engine.claiming import claim_batch
    from taskflow.engine.configs import configs
    from taskflow.engine.finishing import finish_attempts

    spent = 0.0
    left = set(ids)
    while left:
        held = claim_batch(configs.get(T), 100, "bench:1:w")
        if not held:
            raise SystemExit("nothing to claim")
        began = time.perf_counter()
        finish_attempts([Report(t, Outcome.SUCCESS) for t in held])
        spent += time.perf_counter() - began
        left -= {t.id for t in held}
    return spent


def finish_overhead(n: int, rounds: int = 5) -> None:
    """finish_attempts with and without the release step, alternating, `rounds` times each; medians."""
    import statistics

    import taskflow
    from taskflow.engine import dependencies

    real = dependencies.release_on_commit
    spent: dict[str, list[float]] = {"with the release step": [], "release step removed": []}
    for _ in range(rounds):
        for label, hook in (("with the release step", real), ("release step removed", lambda ids: list(ids))):
            reset()
            dependencies.release_on_commit = hook
            try:
                tasks = taskflow.enqueue_many([{"task_type": T} for _ in range(n)])
                spent[label].append(finish_all([t.id for t in tasks]))
            finally:
                dependencies.release_on_commit = real
    for label, runs in spent.items():
        seconds = statistics.median(runs)
        print(
            f"finish {n:,} successes, reports of 100 ({label}): median {seconds * 1000:.0f} ms, "
            f"{n / seconds:,.0f}/s ({rounds} runs)",
            flush=True,
        )


def release_check(repeat: int = 200) -> None:
    """The release step alone for a report of 100 finished tasks nobody waits for (one indexed read)."""
    import statistics

    import taskflow
    from taskflow.engine import dependencies

    reset()
    ids = [t.id for t in taskflow.enqueue_many([{"task_type": T} for _ in range(100)])]
    runs = []
    for _ in range(repeat):
        began = time.perf_counter()
        dependencies.release(ids)
        runs.append(time.perf_counter() - began)
    print(
        f"release step for a report of 100 tasks nobody waits for: median {statistics.median(runs) * 1000:.2f} ms "
        f"({repeat} runs)",
        flush=True,
    )


def enqueue_cost(n: int) -> None:
    import taskflow

    reset()
    gate = taskflow.enqueue(T, {})
    for label, options in (("no dependencies", {}), ("depends_on=[pending task]", {"depends_on": [gate.id]})):
        began = time.perf_counter()
        for _ in range(n):
            taskflow.enqueue(T, {}, **options)
        seconds = time.perf_counter() - began
        print(f"single enqueue, {label}: {n / seconds:,.0f}/s ({seconds * 1e6 / n:.0f} us each)", flush=True)


def fan_out(n: int) -> None:
    import taskflow
    from taskflow.models import Status, Task

    reset()
    root = taskflow.enqueue(T, {})
    taskflow.enqueue_many([{"task_type": T, "depends_on": [root.id]} for _ in range(n)])
    began = time.perf_counter()
    finish_all([root.id])
    seconds = time.perf_counter() - began
    released = Task.objects.filter(status=Status.PENDING).count()
    print(f"fan-out: root succeeds, {released:,} of {n:,} dependents released in {seconds * 1000:.0f} ms", flush=True)


def cascade(depth: int) -> None:
    import taskflow
    from taskflow.engine.attempts import Outcome, Report
    from taskflow.engine.claiming import claim_batch
    from taskflow.engine.configs import configs
    from taskflow.engine.finishing import finish_attempts
    from taskflow.models import Status, Task

    reset()
    link = root = taskflow.enqueue(T, {}, max_retries=0)
    for _ in range(depth):
        link = taskflow.enqueue(T, {}, depends_on=[link.id])
    (held,) = claim_batch(configs.get(T), 10, "bench:1:w")
    assert held.id == root.id
    began = time.perf_counter()
    finish_attempts([Report(held, Outcome.FAIL, error="bench")])
    seconds = time.perf_counter() - began
    stopped = Task.objects.filter(status=Status.STOPPED).count()
    print(f"cascade: root fails, {stopped:,} of {depth:,} chained tasks stopped in {seconds * 1000:.0f} ms", flush=True)


def repair_pass(n: int) -> None:
    import taskflow
    from taskflow.engine.dependencies import repair_waiting

    reset()
    gates = taskflow.enqueue_many([{"task_type": T} for _ in range(max(1, n // 10))])
    for start in range(0, n, 1000):
        taskflow.enqueue_many(
            [{"task_type": T, "depends_on": [gates[i % len(gates)].id]} for i in range(start, min(n, start + 1000))]
        )
    runs = []
    for _ in range(5):
        began = time.perf_counter()
        repair_waiting()
        runs.append(time.perf_counter() - began)
    runs.sort()
    print(
        f"repair pass over {n:,} open edges ({len(gates):,} unfinished dependencies), nothing to do: "
        f"median {runs[2] * 1000:.1f} ms",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 200 tasks, a chain of 20")
    parser.add_argument("--n", type=int, default=None, help="tasks per measurement (default 5,000)")
    parser.add_argument("--depth", type=int, default=None, help="length of the failing chain (default 200)")
    parser.add_argument("--reuse-db", action="store_true", help="keep the database (only migrate it)")
    args = parser.parse_args()
    args.n = args.n or (200 if args.quick else 5000)
    args.depth = args.depth or (20 if args.quick else 200)
    database.ensure_database(os.environ.get("DATABASE_URL", ""), fresh=not args.reuse_db)

    import django

    django.setup()
    database.migrate()
    database.reset_schedule_configs("bench.")
    print(f"# dependencies benchmark on {database.describe()}, load average {os.getloadavg()[0]:.2f}")
    finish_overhead(min(args.n, 2000))
    release_check()
    enqueue_cost(min(args.n, 2000))
    fan_out(args.n)
    cascade(args.depth)
    repair_pass(args.n * 4)
    reset()


if __name__ == "__main__":
    main()

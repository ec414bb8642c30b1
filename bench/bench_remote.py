#!/usr/bin/env python
"""Benchmark of taskflow over HTTP: create latency through the API, and the drain rate of remote workers.

Run from the repository root, e.g.:
  DATABASE_URL=mysql://root@127.0.0.1:3306/tfbench_remote REDIS_URL=redis://127.0.0.1:6379/6 \
    .venv/bin/python bench/bench_remote.py [--quick]
The example project is served by gunicorn (2 processes, gthread, loopback); the remote workers are
`python -m taskflow.remote` processes with no database access. Their drains alternate with drains by
local `taskworker --burst` processes with the same threads, the reference. --py-spy PATH profiles the
server's processes during one more remote drain. Prints figures, never asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-bench-only")

from bench import cpu, database, profiling  # noqa: E402
from bench.workers import WorkerPool  # noqa: E402

TASK_TYPE = "bench.noop"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gunicorn(
    pool: WorkerPool, env: dict[str, str], port: int, workers: int, threads: int, worker_class: str
) -> subprocess.Popen:
    log_path = pool.log_dir / "gunicorn.log"
    command = [sys.executable, "-m", "gunicorn", "project.wsgi:application", "--bind", f"127.0.0.1:{port}"]
    command += ["--workers", str(workers), "--worker-class", worker_class, "--threads", str(threads)]
    command += ["--no-control-socket"]  # its default path is shared by every gunicorn of the user
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    pool.procs.append(proc)
    return proc


def start_remote(
    pool: WorkerPool, env: dict[str, str], url: str, token_file: Path, concurrency: int
) -> subprocess.Popen:
    log_path = pool.log_dir / f"remote-{len(pool.procs):03d}.log"
    command = [sys.executable, "-m", "taskflow.remote", "--url", url, "--token-file", str(token_file)]
    command += ["--handlers", "bench.benchapp.tasks", "--types", TASK_TYPE, "--concurrency", str(concurrency)]
    command += ["--log-level", "WARNING"]
    remote_env = {k: v for k, v in env.items() if k not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=remote_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    pool.procs.append(proc)
    return proc


def wait_for_server(url: str, timeout: float = 60) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            requests.get(url + "tasks/", timeout=2)
            return
        except requests.RequestException:
            time.sleep(0.2)
    raise SystemExit(f"the server did not answer at {url} within {timeout}s")


def measure_create(url: str, token: str, n: int) -> dict[str, float]:
    """POST /api/tasks/ one task at a time on one keep-alive session; per-request wall times."""
    import requests

    session = requests.Session()
    session.headers["Authorization"] = f"Token {token}"
    times = []
    for i in range(n):
        started = time.perf_counter()
        response = session.post(url + "tasks/", json={"task_type": TASK_TYPE, "payload": {"i": i}}, timeout=30)
        times.append(time.perf_counter() - started)
        if response.status_code != 201:
            raise SystemExit(f"create answered {response.status_code}: {response.text[:300]}")
    return {
        "n": n,
        "p50_ms": percentile(times, 50) * 1000,
        "p95_ms": percentile(times, 95) * 1000,
        "mean_ms": statistics.fmean(times) * 1000,
        "rate": n / sum(times),
    }


def enqueue_tasks(n: int) -> None:
    import taskflow

    database.reset_tables()
    for start in range(0, n, 1000):
        taskflow.enqueue_many(
            [{"task_type": TASK_TYPE, "payload": {"i": i}} for i in range(start, min(n, start + 1000))]
        )


CpuReading = tuple[float, float, float | None, tuple[float, float]]


def cpu_reading(worker_pids: list[int], server_pids: list[int]) -> CpuReading:
    """CPU so far of the workers, the API server's processes, the database server, and the whole machine."""
    return (
        cpu.processes_cpu(worker_pids),
        cpu.processes_cpu(server_pids),
        cpu.database_server_cpu(),
        cpu.machine_busy(),
    )


def measure_drain(
    pool: WorkerPool,
    n: int,
    start_workers: Callable[[], list[subprocess.Popen]],
    timeout: float,
    server_pids: list[int] | None = None,
) -> dict[str, float]:
    """Enqueue `n` tasks, start the workers, time until every task succeeded (then stop them).

    Also the CPU that the workers, the API server's processes, the database server and the whole
    machine used from the first task's start to the last success (start-up left out): with every
    core busy, the drain can go no faster than cores / their CPU per task.
    """
    from django.db.models import Max, Min

    from taskflow.models import Status, Task

    enqueue_tasks(n)
    started = time.monotonic()
    procs = start_workers()
    deadline = started + timeout
    pids, server_pids = [p.pid for p in procs], server_pids or []
    before: CpuReading | None = None
    done = 0
    while time.monotonic() < deadline:
        if before is None:
            if Task.objects.filter(status__in=[Status.PROCESSING, Status.SUCCESS]).exists():
                before = cpu_reading(pids, server_pids)
            else:
                time.sleep(0.005)
                continue
        done = Task.objects.filter(status=Status.SUCCESS).count()
        if done == n:
            break
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a worker exited:\n" + "\n".join(WorkerPool.tail(p) for p in procs))
        time.sleep(0.05)
    wall = time.monotonic() - started
    after = cpu_reading(pids, server_pids)
    pool.stop(procs)
    span = Task.objects.filter(status=Status.SUCCESS).aggregate(first=Min("started_at"), last=Max("finished_at"))
    once = Task.objects.filter(status=Status.SUCCESS, attempts=1, lease_token=1).count()
    db_seconds = (span["last"] - span["first"]).total_seconds() if done else float("nan")
    before = before or after
    # None: no database server process here (SQLite runs inside the workers and the API server).
    database_cpu = after[2] - before[2] if after[2] is not None and before[2] is not None else 0.0
    return {
        "n": n,
        "done": done,
        "once": once,
        "wall_s": wall,
        "wall_rate": done / wall,
        "db_span_s": db_seconds,
        "db_rate": done / db_seconds if done else 0.0,
        "workers_cpu": after[0] - before[0],
        "server_cpu": after[1] - before[1],
        "database_cpu": database_cpu,
        "machine_busy": (after[3][0] - before[3][0]) / max(1, after[3][1] - before[3][1]),
    }


def server_workers(master: subprocess.Popen) -> list[int]:
    """The pids of gunicorn's worker processes (the master's children)."""
    children = Path(f"/proc/{master.pid}/task/{master.pid}/children")
    return [int(pid) for pid in children.read_text().split()] if children.exists() else []


def profile_server(py_spy: str, master: subprocess.Popen, log_dir: Path, seconds: float) -> list[subprocess.Popen]:
    """Start py-spy (GIL samples) on each gunicorn worker for `seconds`; returns the profilers."""
    profilers = []
    for pid in server_workers(master):
        raw = log_dir / f"server-{pid}.txt"
        command = [py_spy, "record", "--gil", "--format", "raw", "--full-filenames", "--rate", "250"]
        command += ["--duration", str(max(1, int(seconds))), "--pid", str(pid), "-o", str(raw)]
        profilers.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        )
    return profilers


def per_task(drained: dict[str, float], figure: str) -> str:
    """CPU µs a task of one kind of process (see measure_drain)."""
    return f"{1e6 * drained[figure] / max(1, drained['done']):.0f}"


def drain_line(label: str, drained: dict[str, float]) -> str:
    return (
        f"{label}: {drained['done']}/{drained['n']} tasks, {drained['db_rate']:,.0f} tasks/s first start to last "
        f"finish ({drained['db_span_s']:.2f} s), {drained['wall_rate']:,.0f} tasks/s wall from spawning "
        f"({drained['wall_s']:.1f} s); claimed exactly once: {drained['once']}\n"
        f"    CPU from the first start to the last success: workers {per_task(drained, 'workers_cpu')}, "
        f"API server {per_task(drained, 'server_cpu')}, database server {per_task(drained, 'database_cpu')} µs a task "
        f"(machine {100 * drained['machine_busy']:.0f} % busy); {os.cpu_count()} cores over their sum = at most "
        f"{ceiling(drained):,.0f} tasks/s here"
    )


def ceiling(drained: dict[str, float]) -> float:
    """The drain rate this machine's cores allow at the CPU per task measured (every core busy)."""
    used = drained["workers_cpu"] + drained["server_cpu"] + drained["database_cpu"]
    return (os.cpu_count() or 1) * drained["done"] / used if used > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run (about a minute)")
    parser.add_argument("--creates", type=int, default=None, help="single creates to time (default 1000, quick 200)")
    parser.add_argument("--tasks", type=int, default=None, help="tasks to drain (default 10000, quick 2000)")
    parser.add_argument("--concurrency", type=int, default=32, help="handler threads per remote worker (32)")
    parser.add_argument("--workers", type=int, default=2, help="remote worker processes (2)")
    parser.add_argument("--server-processes", type=int, default=2, help="gunicorn processes (2)")
    parser.add_argument("--server-threads", type=int, default=4, help="threads per gunicorn process (4)")
    parser.add_argument("--server-class", default="gthread", help="gunicorn worker class (gthread)")
    parser.add_argument("--repeat", type=int, default=None, help="drains of each kind, alternating (3, quick 1)")
    parser.add_argument(
        "--no-local", dest="local", action="store_false", help="leave out the local workers' drains (the reference)"
    )
    parser.add_argument("--py-spy", default="", help="also profile the server's processes during a drain (py-spy path)")
    parser.add_argument("--reuse-db", action="store_true", help="keep the database (only migrate it)")
    args = parser.parse_args()
    args.repeat = args.repeat or (1 if args.quick else 3)
    creates = args.creates or (200 if args.quick else 1000)
    tasks = args.tasks or (2000 if args.quick else 10_000)

    url = os.environ.get("DATABASE_URL") or "sqlite:////tmp/tfbench_remote.sqlite3"
    os.environ["DATABASE_URL"] = url
    database.ensure_database(url, fresh=not args.reuse_db)
    import django

    django.setup()
    database.migrate()
    database.reset_tables()
    database.reset_schedule_configs("bench.")
    from django.contrib.auth.models import Permission, User
    from rest_framework.authtoken.models import Token

    User.objects.filter(username="bench-remote").delete()
    user = User.objects.create_user("bench-remote")
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="taskflow", codename__in=["add_task", "hold_task", "view_task"]
        )
    )
    token = Token.objects.create(user=user).key

    log_dir = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    token_file = log_dir / "token"
    token_file.write_text(token)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "bench.settings"}
    pool = WorkerPool(log_dir, env)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api/"
    print(f"database: {database.describe()}   redis: {os.environ.get('REDIS_URL') or 'none'}")
    print(
        f"server: gunicorn {args.server_processes} processes x {args.server_threads} threads "
        f"({args.server_class}) at {api}"
    )
    print(f"load average: {os.getloadavg()[0]:.2f}   logs: {log_dir}")
    try:
        master = start_gunicorn(pool, env, port, args.server_processes, args.server_threads, args.server_class)
        wait_for_server(api)
        measure_create(api, token, 20)  # warm both server processes
        created = measure_create(api, token, creates)
        print(
            f"create POST /api/tasks/ x{created['n']}: p50 {created['p50_ms']:.2f} ms  p95 {created['p95_ms']:.2f} ms"
            f"  mean {created['mean_ms']:.2f} ms  ({created['rate']:.0f}/s, one client)",
            flush=True,
        )

        def remote_workers() -> list[subprocess.Popen]:
            return [start_remote(pool, env, api, token_file, args.concurrency) for _ in range(args.workers)]

        def local_workers() -> list[subprocess.Popen]:
            command = ("taskworker", "--types", TASK_TYPE, "--concurrency", str(args.concurrency), "--burst")
            return [pool.start(*command) for _ in range(args.workers)]

        # Remote and local drains take turns, so a machine whose load drifts favours neither.
        rates: dict[str, list[float]] = {"remote": [], "local": []}
        for run in range(args.repeat):
            drained = measure_drain(pool, tasks, remote_workers, timeout=600, server_pids=server_workers(master))
            rates["remote"].append(drained["db_rate"])
            print(drain_line(f"remote drain {run + 1}, {args.workers} workers x C={args.concurrency}", drained))
            if args.local:
                drained = measure_drain(pool, tasks, local_workers, timeout=600)
                rates["local"].append(drained["db_rate"])
                label = f"local drain {run + 1}, {args.workers} taskworker --burst x C={args.concurrency}"
                print(drain_line(label, drained))
        remote_rate = statistics.median(rates["remote"])
        summary = f"remote drain median {remote_rate:,.0f} tasks/s"
        if rates["local"]:
            local_rate = statistics.median(rates["local"])
            share = 100 * remote_rate / local_rate
            summary += f", local median {local_rate:,.0f} tasks/s: remote = {share:.0f} % of local"
        print(summary + f" (medians of {args.repeat}; target >= 5,000 tasks/s and >= 75 % of local)")
        if args.py_spy:
            # One more remote drain with the server's processes under py-spy.
            enqueue_tasks(0)
            profilers: list[subprocess.Popen] = []

            def profiled_remote_workers() -> list[subprocess.Popen]:
                profilers.extend(profile_server(args.py_spy, master, log_dir, seconds=max(2.0, tasks / 2000)))
                return remote_workers()

            measure_drain(pool, tasks, profiled_remote_workers, timeout=600)
            for profiler in profilers:
                profiler.wait(timeout=120)
            for raw in sorted(log_dir.glob("server-*.txt")):
                print(f"\nserver process {raw.stem.split('-')[1]} during a remote drain (py-spy --gil):")
                print(profiling.summarise_server(raw))
    finally:
        pool.close()
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

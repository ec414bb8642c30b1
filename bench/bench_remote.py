#!/usr/bin/env python
"""Benchmark of taskflow over HTTP: create latency through the API, and the drain rate of remote workers.

Run from the repository root, e.g.:
  DATABASE_URL=mysql://root@127.0.0.1:3306/tfbench_remote REDIS_URL=redis://127.0.0.1:6379/6 \
    .venv/bin/python bench/bench_remote.py [--quick]
The example project is served by gunicorn (2 processes, gthread, loopback); the remote workers are
`python -m taskflow.remote` processes with no database access. Prints figures, never asserts.
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

TASK_TYPE = "bench.noop"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gunicorn(pool: WorkerPool, env: dict[str, str], port: int, workers: int, threads: int) -> subprocess.Popen:
    log_path = pool.log_dir / "gunicorn.log"
    command = [sys.executable, "-m", "gunicorn", "project.wsgi:application", "--bind", f"127.0.0.1:{port}"]
    command += ["--workers", str(workers), "--worker-class", "gthread", "--threads", str(threads)]
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


def measure_drain(
    pool: WorkerPool,
    env: dict[str, str],
    url: str,
    token_file: Path,
    n: int,
    concurrency: int,
    workers: int,
    timeout: float,
) -> dict[str, float]:
    """Enqueue `n` tasks, start `workers` remote workers, time until every task succeeded."""
    from django.db.models import Max, Min

    import taskflow
    from taskflow.models import Status, Task

    database.reset_tables()
    for start in range(0, n, 1000):
        taskflow.enqueue_many(
            [{"task_type": TASK_TYPE, "payload": {"i": i}} for i in range(start, min(n, start + 1000))]
        )
    started = time.monotonic()
    procs = [start_remote(pool, env, url, token_file, concurrency) for _ in range(workers)]
    deadline = started + timeout
    done = 0
    while time.monotonic() < deadline:
        done = Task.objects.filter(status=Status.SUCCESS).count()
        if done == n:
            break
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a remote worker exited:\n" + "\n".join(WorkerPool.tail(p) for p in procs))
        time.sleep(0.1)
    wall = time.monotonic() - started
    pool.stop(procs)
    span = Task.objects.filter(status=Status.SUCCESS).aggregate(first=Min("started_at"), last=Max("finished_at"))
    once = Task.objects.filter(status=Status.SUCCESS, attempts=1, lease_token=1).count()
    db_seconds = (span["last"] - span["first"]).total_seconds() if done else float("nan")
    return {
        "n": n,
        "done": done,
        "once": once,
        "wall_s": wall,
        "wall_rate": done / wall,
        "db_span_s": db_seconds,
        "db_rate": done / db_seconds if done else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run (about a minute)")
    parser.add_argument("--creates", type=int, default=None, help="single creates to time (default 1000, quick 200)")
    parser.add_argument("--tasks", type=int, default=None, help="tasks to drain (default 10000, quick 2000)")
    parser.add_argument("--concurrency", type=int, default=32, help="handler threads per remote worker (32)")
    parser.add_argument("--workers", type=int, default=2, help="remote worker processes (2)")
    parser.add_argument("--server-processes", type=int, default=2, help="gunicorn processes (2)")
    parser.add_argument("--server-threads", type=int, default=4, help="threads per gunicorn process (4)")
    parser.add_argument("--reuse-db", action="store_true", help="keep the database (only migrate it)")
    args = parser.parse_args()
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
    print(f"server: gunicorn {args.server_processes} processes x {args.server_threads} threads at {api}")
    print(f"load average: {os.getloadavg()[0]:.2f}   logs: {log_dir}")
    try:
        start_gunicorn(pool, env, port, args.server_processes, args.server_threads)
        wait_for_server(api)
        measure_create(api, token, 20)  # warm both server processes
        created = measure_create(api, token, creates)
        print(
            f"create POST /api/tasks/ x{created['n']}: p50 {created['p50_ms']:.1f} ms  p95 {created['p95_ms']:.1f} ms"
            f"  mean {created['mean_ms']:.1f} ms  ({created['rate']:.0f}/s, one client)"
        )
        drained = measure_drain(pool, env, api, token_file, tasks, args.concurrency, args.workers, timeout=600)
        print(
            f"remote drain {drained['done']}/{drained['n']} tasks, {args.workers} workers x C={args.concurrency}: "
            f"{drained['wall_rate']:.0f} tasks/s wall ({drained['wall_s']:.1f} s from spawning the workers), "
            f"{drained['db_rate']:.0f} tasks/s first start to last finish ({drained['db_span_s']:.1f} s); "
            f"claimed exactly once: {drained['once']}"
        )
    finally:
        pool.close()


if __name__ == "__main__":
    main()

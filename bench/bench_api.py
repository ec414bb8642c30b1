#!/usr/bin/env python
"""Benchmark of the HTTP API at a million tasks: server time of list, get, create, hold and report.

Run from the repository root, e.g.:
  DATABASE_URL=postgres://postgres@127.0.0.1:5432/tf_api_bench .venv/bin/python bench/bench_api.py
The database name must contain "bench": it is dropped and recreated (unless --reuse-db) and filled
with --rows tasks by bench_console's INSERT ... SELECT (MariaDB/MySQL or PostgreSQL). Requests go
in-process through DRF's test client with a token (authentication, serializers, queries and JSON:
the server's time without a network; the remote worker's benchmark measures over gunicorn). Each
figure is the median (and p95) of --repeat requests. It prints, never asserts; see bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-bench-only")

from bench import database  # noqa: E402
from bench.bench_console import TYPES, bulk_rows, fill  # noqa: E402

TARGET_MS = 100.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def timed_requests(client, method: str, url: str, bodies: list[object] | None, repeat: int) -> tuple[list[float], int]:  # noqa: ANN001
    times, status = [], 0
    for i in range(repeat):
        began = time.perf_counter()
        if method == "get":
            response = client.get(url)
        else:
            body = json.dumps(bodies[i % len(bodies)] if bodies else {})
            response = client.post(url, body, content_type="application/json")
        times.append((time.perf_counter() - began) * 1000)
        status = response.status_code
    return times, status


def report(name: str, times: list[float], status: int, per: str = "") -> None:
    median, p95 = statistics.median(times), percentile(times, 0.95)
    flag = "" if median < TARGET_MS else "  <-- over target"
    print(f"{name:44} p50 {median:7.1f} ms  p95 {p95:7.1f} ms  (HTTP {status}{per}){flag}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20,000 tasks, 3 requests a figure")
    parser.add_argument("--rows", type=int, default=None, help="tasks in the table (default 1,000,000)")
    parser.add_argument("--repeat", type=int, default=None, help="requests per figure (default 15)")
    parser.add_argument("--reuse-db", action="store_true", help="keep a database already filled with --rows tasks")
    args = parser.parse_args()
    args.rows = args.rows or (20_000 if args.quick else 1_000_000)
    args.repeat = args.repeat or (3 if args.quick else 15)
    if args.rows < 1000:
        raise SystemExit("--rows must be at least 1,000")
    database.ensure_database(os.environ.get("DATABASE_URL", ""), fresh=not args.reuse_db)

    import django

    django.setup()
    from django.contrib.auth.models import Permission, User
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    from taskflow.models import Task

    database.migrate()
    print(f"# API benchmark on {database.describe()}, {args.rows:,} tasks")
    if not args.reuse_db or not Task.objects.exists():
        began = time.perf_counter()
        fill(args.rows)
        print(f"fill {args.rows:,} tasks: {time.perf_counter() - began:.1f} s")
    user, _ = User.objects.get_or_create(username="bench-api")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="taskflow"))
    client = APIClient(SERVER_NAME="localhost")
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")

    # A task from the middle of the filled week (ids of tasks created by earlier runs are newer); the
    # first rows are bench.bulk tasks, the rest are spread over TYPES.
    typed = args.rows - bulk_rows(args.rows)
    middle = Task.objects.filter(task_type__in=TYPES).order_by("id").values_list("id", flat=True)[typed // 3]
    key_row = (args.rows // 3) * 3
    run = int(time.time())  # keys of this run's creates: new ones however often it runs on the same data
    tasks = "/api/tasks/"
    reads = [
        ("list, unfiltered", tasks),
        ("list, type", tasks + "?" + urlencode({"task_type": TYPES[5]})),
        ("list, status (failed)", tasks + "?status=failed"),
        ("list, status (processing)", tasks + "?status=processing"),
        ("list, status+type (failed)", tasks + "?" + urlencode({"status": "failed", "task_type": TYPES[3]})),
        ("list, key", tasks + f"?key=k{key_row}"),
        ("list, user id", tasks + "?user_id=u42"),
        ("list, stage", tasks + "?stage=index"),
        ("list, stage+type", tasks + "?" + urlencode({"stage": "index", "task_type": TYPES[2]})),
        ("list, 500 per page", tasks + "?page_size=500"),
        ("get one task", f"{tasks}{middle}/"),
    ]
    for name, url in reads:
        client.get(url)  # warm
        times, status = timed_requests(client, "get", url, None, args.repeat)
        report(name, times, status)
    # The 20th page of a type, following `next` links: cursor pages cost the same however deep.
    url, depth = tasks + "?" + urlencode({"task_type": TYPES[5]}), 1
    while depth < 20 and (following := client.get(url).json()["next"]):
        url, depth = following, depth + 1
    times, status = timed_requests(client, "get", url, None, args.repeat)
    report(f"list, type, page {depth} by cursor", times, status)

    creates = [{"task_type": "bench.api", "payload": {"n": i}} for i in range(args.repeat * 10)]
    times, status = timed_requests(client, "post", tasks, creates, len(creates))
    report(f"create one task ({len(creates)} requests)", times, status)
    keyed = [{"task_type": "bench.api", "key": f"api-{run}-{i}", "payload": {"n": i}} for i in range(args.repeat * 10)]
    times, status = timed_requests(client, "post", tasks, keyed, len(keyed))
    report(f"create one keyed task ({len(keyed)} requests)", times, status)
    batch = [{"tasks": [{"task_type": "bench.api", "payload": {"n": i}} for i in range(1000)]}]
    times, status = timed_requests(client, "post", tasks + "bulk/", batch, 3)
    report("bulk create of 1,000 tasks", times, status, f", {1000 / (statistics.median(times) / 1000):,.0f} tasks/s")

    hold_times, report_times, held_total = [], [], 0
    # A remote worker registers once; its issued id and key go with every later worker call.
    worker = client.post(
        "/api/workers/",
        json.dumps({"host": "bench-host", "pid": 1, "task_types": ["bench.api"], "concurrency": 100}),
        content_type="application/json",
    ).json()
    client.credentials(
        **client._credentials,
        HTTP_TASKFLOW_WORKER_ID=worker["worker_id"],
        HTTP_TASKFLOW_WORKER_KEY=worker["worker_key"],
    )
    for _ in range(args.repeat):
        began = time.perf_counter()
        held = client.post(
            tasks + "hold/",
            json.dumps({"task_types": ["bench.api"], "limit": 100}),
            content_type="application/json",
        ).json()["tasks"]
        hold_times.append((time.perf_counter() - began) * 1000)
        held_total += len(held)
        fences = [{"task_id": t["task_id"], "lease": t["lease"], "attempt_key": t["attempt_key"]} for t in held]
        items = [{**fence, "status": "success", "result": None} for fence in fences]
        began = time.perf_counter()
        response = client.post(tasks + "set/", json.dumps({"items": items}), content_type="application/json")
        report_times.append((time.perf_counter() - began) * 1000)
        assert all(r["outcome"] == "applied" for r in response.json()["results"])
    report(f"hold 100 ({held_total} held in all)", hold_times, 200)
    report("batched success reports of 100", report_times, response.status_code)
    drained = held_total / ((sum(hold_times) + sum(report_times)) / 1000)
    print(f"# one remote worker's server-side drain: {drained:,.0f} tasks/s (hold 100 + report 100, in-process)")
    print(f"# load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Benchmark of the taskflow core: enqueue rates, drain rate and start latency; it prints, never asserts.

Run from the repository root, e.g.:
  DATABASE_URL=mysql://root@127.0.0.1:3306/tfbench REDIS_URL=redis://127.0.0.1:6379/12 \
    .venv/bin/python bench/bench_core.py [--quick]
See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ.setdefault("DJANGO_SECRET_KEY", "taskflow-bench-only")

from bench import cpu, database, profiling  # noqa: E402
from bench.workers import WorkerPool  # noqa: E402

TASK_TYPE = "bench.noop"
STAMP_TYPE = "bench.stamp"  # its handler returns when it started: the latency phase's tasks
Goals = tuple[float | None, float | None]  # a latency's p50 and p95 targets in ms, if any
PHASES = ("single", "bulk", "drain", "latency", "profile", "memory")


@dataclass(frozen=True)
class Plan:
    """How much work each phase does; --quick swaps in a small one."""

    single_n: int = 5_000
    # Keyed enqueues take a transaction of two statements each, so fewer of them keep the run short.
    keyed_n: int = 1_000
    single_runs: int = 3
    bulk_total: int = 50_000
    bulk_batch: int = 1_000
    bulk_runs: int = 3
    drain_n: int = 10_000
    # 0: the command's default (8), issue 16's "default settings"; 32 and 128 for its "best settings".
    drain_concurrency: tuple[int, ...] = (0, 32, 128)
    drain_workers: int = 2
    drain_runs: int = 2
    drain_timeout: float = 240.0
    latency_seconds: float = 20.0
    latency_interval: float = 0.010
    latency_concurrency: int = 0  # the command's default, as a user who changes nothing runs it
    polling_seconds: float = 20.0
    profile_n: int = 10_000
    profile_concurrency: int = 32
    memory_n: int = 1_000_000
    memory_timeout: float = 3600.0
    budget: float = 1200.0


FULL = Plan()
QUICK = Plan(
    single_n=300,
    keyed_n=100,
    single_runs=2,
    bulk_total=5_000,
    bulk_runs=2,
    drain_n=1_000,
    drain_runs=1,
    drain_timeout=60.0,
    latency_seconds=3.0,
    polling_seconds=3.0,
    profile_n=2_000,
    memory_n=20_000,
    memory_timeout=120.0,
    budget=120.0,
)


@dataclass
class Metric:
    """One measured figure over several runs; `target` is (">=" or "<=", value) or None."""

    name: str
    unit: str
    target: tuple[str, float] | None = None
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    def verdict(self) -> str:
        if self.target is None or self.median is None:
            return ""
        op, goal = self.target
        met = self.median >= goal if op == ">=" else self.median <= goal
        return "met" if met else "MISSED"


class Bench:
    """Runs the phases against the bench database and collects their metrics."""

    def __init__(self, plan: Plan, pool: WorkerPool, *, has_redis: bool, deadline: float) -> None:
        self.plan = plan
        self.pool = pool
        self.has_redis = has_redis
        self.deadline = deadline
        self.metrics: dict[str, Metric] = {}
        self.notes: list[str] = []

    # -- bookkeeping ---------------------------------------------------------------------------

    def metric(self, name: str, unit: str, target: tuple[str, float] | None = None) -> Metric:
        if name not in self.metrics:
            self.metrics[name] = Metric(name, unit, target)
        return self.metrics[name]

    def out_of_time(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.note(f"skipped {what}: time budget used up")
        return True

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  ! {text}", flush=True)

    # -- phase 1: single enqueue ---------------------------------------------------------------

    def single(self) -> None:
        # The limits, measured in the same run (interleaved with the engine's runs): see RawInserts.
        with database.RawInserts() as raw:
            self.single_runs(raw)

    def single_runs(self, raw: database.RawInserts) -> None:
        import taskflow

        n = self.plan.single_n
        narrow = self.metric("raw INSERT, narrow row", "rows/s")
        task_row = self.metric("raw INSERT, task row", "rows/s")
        plain = self.metric("single enqueue", "tasks/s", (">=", 3000))
        to_narrow = self.metric("single enqueue / raw narrow", "ratio", (">=", 0.55))
        to_task_row = self.metric("single enqueue / raw task row", "ratio")
        for keyed in (False, True):
            n = self.plan.keyed_n if keyed else self.plan.single_n
            label = "keyed single enqueue" if keyed else "single enqueue"
            m = self.metric(label, "tasks/s", (">=", 2000)) if keyed else plain
            for run in range(self.plan.single_runs):
                if self.out_of_time(f"{label} run {run + 1}"):
                    return
                database.reset_tables()
                if not keyed:
                    raw_rate = n / raw.narrow(n)
                    task_row_rate = n / raw.task_row(n, first_id=run * n + 1)
                    narrow.values.append(raw_rate)
                    task_row.values.append(task_row_rate)
                    print(f"  raw INSERT run {run + 1}: narrow row {raw_rate:,.0f}/s, task row {task_row_rate:,.0f}/s")
                started, cpu = time.perf_counter(), time.process_time()
                if keyed:
                    for i in range(n):
                        taskflow.enqueue(TASK_TYPE, {"i": i}, key=f"k{i}")
                else:
                    for i in range(n):
                        taskflow.enqueue(TASK_TYPE, {"i": i})
                elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
                self.check_count(n, label)
                m.values.append(n / elapsed)
                self.metric(f"... client CPU per {label}", "us").values.append(cpu / n * 1e6)
                print(
                    f"  {label} run {run + 1}: {n} tasks in {elapsed:.2f}s = {n / elapsed:,.0f}/s, "
                    f"client CPU {cpu / n * 1e6:.0f} us/task",
                    flush=True,
                )
                if not keyed:
                    to_narrow.values.append(n / elapsed / raw_rate)
                    to_task_row.values.append(n / elapsed / task_row_rate)

    # -- phase 2: bulk enqueue -----------------------------------------------------------------

    def bulk(self) -> None:
        # The limit, measured in the same run (interleaved): the task row in multi-row INSERTs, no engine.
        with database.RawInserts() as raw:
            self.bulk_runs(raw)

    def bulk_runs(self, raw: database.RawInserts) -> None:
        import taskflow

        total, size = self.plan.bulk_total, self.plan.bulk_batch
        m = self.metric(f"bulk enqueue ({size}/call)", "tasks/s", (">=", 50000))
        limit = self.metric(f"raw multi-row INSERT, task row ({size}/statement)", "rows/s")
        to_limit = self.metric("bulk enqueue / raw multi-row INSERT", "ratio")
        # The request lists are the caller's business: built before the clock starts.
        batches = [
            [{"task_type": TASK_TYPE, "payload": {"i": i}} for i in range(start, min(start + size, total))]
            for start in range(0, total, size)
        ]
        for run in range(self.plan.bulk_runs):
            if self.out_of_time(f"bulk run {run + 1}"):
                return
            database.reset_tables()
            raw_rate = total / raw.task_rows(total, size, first_id=run * total + 1)
            limit.values.append(raw_rate)
            print(f"  raw multi-row INSERT run {run + 1}: task row {raw_rate:,.0f}/s", flush=True)
            started, cpu = time.perf_counter(), time.process_time()
            for batch in batches:
                taskflow.enqueue_many(batch)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            self.check_count(total, "bulk enqueue")
            m.values.append(total / elapsed)
            to_limit.values.append(total / elapsed / raw_rate)
            self.metric("... client CPU per bulk task", "us").values.append(cpu / total * 1e6)
            print(
                f"  bulk run {run + 1}: {total} tasks in {elapsed:.2f}s = {total / elapsed:,.0f}/s, "
                f"client CPU {cpu / total * 1e6:.1f} us/task",
                flush=True,
            )

    # -- phase 3: drain ------------------------------------------------------------------------

    def drain(self) -> None:
        p = self.plan
        for concurrency in p.drain_concurrency:
            for run in range(p.drain_runs):
                if self.out_of_time(f"drain C={concurrency} run {run + 1}"):
                    return
                self.drain_warm(concurrency, run)
                if self.out_of_time(f"burst drain C={concurrency} run {run + 1}"):
                    return
                self.drain_burst(concurrency, run)

    def drain_warm(self, concurrency: int, run: int) -> None:
        """Workers already waiting; all tasks become visible in one commit; time to the last success."""
        p = self.plan
        database.reset_tables()
        procs = self.start_workers(p.drain_workers, concurrency)
        try:
            if not self.wait_registered(len(procs)):
                return
            self.preload(p.drain_n, one_transaction=True)
            cpu_before = cpu.processes_cpu([proc.pid for proc in procs])
            server_before = cpu.database_server_cpu()
            committed = time.monotonic()
            done = self.wait_finished(p.drain_n, p.drain_timeout)
            wall = time.monotonic() - committed
            used = cpu.processes_cpu([proc.pid for proc in procs]) - cpu_before
            server = cpu.database_server_cpu() - server_before if server_before is not None else None
        finally:
            self.pool.stop(procs)
        label = f"drain, warm workers, 2x C={concurrency or 'default'}"
        self.record_drain(label, concurrency, run, wall, done, target=True)
        if done and used > 0:
            # Worker CPU per task: what a busy machine sways far less than the rates above.
            per_task = used / p.drain_n * 1e6
            self.metric(f"{label}, worker CPU per task", "us").values.append(per_task)
            print(f"  {label} run {run + 1}: workers' CPU {used:.2f}s = {per_task:.0f} us/task", flush=True)
        if done and server:
            # The database server's share: with every core busy, workers + server CPU per task bound the
            # rate (cores / that), whatever the worker's settings.
            server_per_task = server / p.drain_n * 1e6
            self.metric(f"{label}, database server CPU per task", "us").values.append(server_per_task)
            ceiling = (os.cpu_count() or 1) / ((used + server) / p.drain_n)
            print(
                f"  {label} run {run + 1}: database server's CPU {server:.2f}s = {server_per_task:.0f} us/task "
                f"(this bench's polling included); {os.cpu_count()} cores over workers + server = "
                f"at most {ceiling:,.0f} tasks/s here",
                flush=True,
            )

    def drain_burst(self, concurrency: int, run: int) -> None:
        """Tasks first, then `taskworker --burst` processes started cold; they exit once drained."""
        p = self.plan
        database.reset_tables()
        self.preload(p.drain_n, one_transaction=False)
        started = time.monotonic()
        procs = self.start_workers(p.drain_workers, concurrency, "--burst")
        exited = self.pool.wait(procs, p.drain_timeout)
        wall = time.monotonic() - started
        if not exited:
            self.note(f"burst workers C={concurrency} still running after {p.drain_timeout:.0f}s; stopped")
            self.pool.stop(procs)
        for proc in procs:
            if proc.returncode not in (0, None):
                self.note(f"worker exited {proc.returncode}:\n{self.pool.tail(proc)}")
        label = f"drain, burst (cold start), 2x C={concurrency or 'default'}"
        self.record_drain(label, concurrency, run, wall, exited, False)

    def record_drain(self, label: str, concurrency: int, run: int, wall: float, done: bool, target: bool) -> None:
        from django.db.models import Count, Max, Min, Q

        from taskflow.models import Status, Task

        n = self.plan.drain_n
        stats = Task.objects.aggregate(
            total=Count("id"),
            once=Count("id", filter=Q(status=Status.SUCCESS, attempts=1, lease_token=1)),
            success=Count("id", filter=Q(status=Status.SUCCESS)),
            first=Min("started_at"),
            last=Max("finished_at"),
        )
        # Each claim stamps its rows with one started_at, each report flush with one finished_at.
        claims = Task.objects.values("worker_id", "started_at").distinct().count()
        flushes = Task.objects.values("worker_id", "finished_at").distinct().count()
        per_worker = sorted(
            Task.objects.values("worker_id").annotate(n=Count("id")).values_list("n", flat=True), reverse=True
        )
        if stats["once"] != n or stats["total"] != n:
            self.note(
                f"{label}: {stats['once']} of {n} tasks succeeded exactly once "
                f"({stats['success']} success, {stats['total']} rows)"
            )
        if not done or stats["first"] is None or stats["last"] is None:
            self.note(f"{label} run {run + 1}: did not finish")
            return
        span = (stats["last"] - stats["first"]).total_seconds()
        rate = n / span if span > 0 else float("inf")
        # Issue 16: >= 10,000/s at default settings, >= 20,000/s at the best ones.
        goal = (">=", 10_000 if concurrency == 0 else 20_000) if target else None
        self.metric(label, "tasks/s", goal).values.append(rate)
        self.metric(f"{label} (wall)", "tasks/s").values.append(n / wall)
        print(
            f"  {label} run {run + 1}: {n} tasks, first start->last success {span:.2f}s = {rate:,.0f}/s; "
            f"wall {wall:.2f}s = {n / wall:,.0f}/s; exactly-once {stats['once']}/{n}; per worker {per_worker}; "
            f"{claims} claims ({n / max(claims, 1):.0f}/claim), {flushes} flushes ({n / max(flushes, 1):.0f}/flush)",
            flush=True,
        )

    # -- phase 4: start latency ----------------------------------------------------------------

    def latency(self) -> None:
        from django.db import connection

        if self.has_redis:
            if not self.out_of_time("latency with Redis"):
                self.latency_run("with Redis wake-ups", {}, self.plan.latency_seconds, goals=(1.5, 3.0))
            if not self.out_of_time("latency without Redis"):
                self.latency_run("polling, no Redis", {"REDIS_URL": ""}, self.plan.polling_seconds)
        elif connection.vendor == "postgresql":
            if not self.out_of_time("latency with LISTEN/NOTIFY"):
                self.latency_run("PostgreSQL LISTEN/NOTIFY", {}, self.plan.latency_seconds, goals=(10.0, None))
        elif not self.out_of_time("latency without Redis"):
            self.latency_run("polling, no Redis", {}, self.plan.polling_seconds)

    def latency_run(self, label: str, env: dict[str, str], seconds: float, *, goals: Goals = (None, None)) -> None:
        """Start latency of tasks enqueued one by one; `goals`: the p50 and p95 targets (ms), if any.

        Measured as a producer sees it: from just before the enqueue call to the moment the handler
        starts (bench.stamp returns time.time() as its result), so the INSERT, the wake-up, the claim
        and the hand-over to a handler thread all count, as in ../shared/bench-peers' W3. The
        database's own stamps (created_at to the claim's started_at) are printed beside it: they leave
        out the claim's statements and the hand-over.
        """
        import taskflow
        from taskflow.models import Status, Task

        p = self.plan
        database.reset_tables()
        procs = self.start_workers(2, p.latency_concurrency, env=env, task_type=STAMP_TYPE)
        try:
            if not self.wait_registered(len(procs)):
                return
            # Warm-up: a few tasks through each worker, so connections and subscriptions are live.
            warm = [taskflow.enqueue(STAMP_TYPE, {"warm": i}).id for i in range(20)]
            if not self.wait_ids(warm, 30.0):
                self.note(f"latency {label}: warm-up tasks did not finish")
                return
            count = int(seconds / p.latency_interval)
            ids: list[int] = []
            started = time.perf_counter()
            for i in range(count):
                # An absolute schedule: a slow enqueue does not stretch the whole run.
                delay = started + i * p.latency_interval - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                ids.append(taskflow.enqueue(STAMP_TYPE, {"i": i, "enqueued": time.time()}).id)
            elapsed = time.perf_counter() - started
            finished = self.wait_ids(ids, 60.0)
        finally:
            self.pool.stop(procs)
        rows = Task.objects.filter(id__in=ids).values_list(
            "status", "payload", "result", "created_at", "started_at", "finished_at"
        )
        starts, claims, ends = [], [], []
        for status, payload, result, created, claimed, ended in rows:
            if status != Status.SUCCESS:
                continue
            starts.append((result["started"] - payload["enqueued"]) * 1000)
            claims.append((claimed - created).total_seconds() * 1000)
            ends.append((ended - created).total_seconds() * 1000)
        starts.sort()
        claims.sort()
        ends.sort()
        if not finished:
            self.note(f"latency {label}: only {len(ends)} of {len(ids)} tasks finished")
        if not starts:
            return
        p50, p95 = goals
        for name, q, goal in (("p50", 0.50, p50), ("p95", 0.95, p95), ("p99", 0.99, None), ("max", 1.0, None)):
            tgt = ("<=", float(goal)) if goal is not None else None
            self.metric(f"start latency {name}, {label}", "ms", tgt).values.append(percentile(starts, q))
        self.metric(f"created_at->claim p50, {label}", "ms").values.append(percentile(claims, 0.5))
        self.metric(f"end-to-end p50 (created->finished), {label}", "ms").values.append(percentile(ends, 0.5))
        print(
            f"  latency {label}: {len(ids)} tasks at {len(ids) / elapsed:,.0f}/s; start latency (enqueue call to "
            f"handler start) p50 {percentile(starts, 0.5):.2f} p95 {percentile(starts, 0.95):.2f} "
            f"p99 {percentile(starts, 0.99):.2f} max {starts[-1]:.2f} ms; created_at->claim p50 "
            f"{percentile(claims, 0.5):.2f} ms; created->finished p50 {percentile(ends, 0.5):.1f} ms",
            flush=True,
        )

    # -- profile -------------------------------------------------------------------------------

    def profile(self, py_spy: str, out_dir: Path) -> str:
        """Drain twice with one burst worker under py-spy: once for CPU (GIL) time, once for wall time."""
        p = self.plan
        parts = []
        for mode, flag, summarise in (
            # --gil samples only the thread holding the GIL: the Python CPU time that bounds a worker.
            ("cpu", "--gil", profiling.summarise_cpu),
            # --idle samples every thread, waiting or not: where each thread's wall time goes.
            ("wall", "--idle", profiling.summarise_wall),
        ):
            if self.out_of_time(f"{mode} profile"):
                break
            database.reset_tables()
            self.preload(p.profile_n, one_transaction=False)
            raw = out_dir / f"worker-profile-{mode}.txt"
            wrapper = [py_spy, "record", flag, "--format", "raw", "--full-filenames", "--rate", "250", "-o", str(raw)]
            started = time.monotonic()
            options = ("--concurrency", str(p.profile_concurrency)) if p.profile_concurrency else ()
            proc = self.pool.start(*("taskworker", "--types", TASK_TYPE, *options, "--burst"), wrapper=[*wrapper, "--"])
            if not self.pool.wait([proc], p.drain_timeout):
                self.pool.stop([proc])
            wall = time.monotonic() - started
            level = p.profile_concurrency or "default"
            print(f"  {mode} profile: 1 worker C={level}, {p.profile_n} tasks, wall {wall:.1f}s")
            if not raw.exists():
                parts.append(f"py-spy wrote nothing:\n{self.pool.tail(proc)}")
                continue
            title = {
                "cpu": "CPU: py-spy --gil, samples of whichever thread holds the GIL",
                "wall": "wall time per thread: py-spy --idle, every thread sampled, waits included",
            }[mode]
            parts.append(f"-- {title} ({raw})\n{summarise(raw)}")
        return "\n\n".join(parts)

    # -- memory ---------------------------------------------------------------------------------

    def memory(self) -> None:
        """One worker at default settings drains `memory_n` tasks; its RSS at the start, every 10 % and at the end."""
        from taskflow.models import Status, Task

        p = self.plan
        n = p.memory_n
        if self.out_of_time("memory"):
            return
        database.reset_tables()
        started = time.monotonic()
        self.preload(n, one_transaction=False)
        print(f"  memory: {n:,} tasks enqueued in {time.monotonic() - started:.1f}s", flush=True)
        (proc,) = [self.pool.start("taskworker", "--types", TASK_TYPE)]  # default concurrency and settings
        samples: list[tuple[int, float]] = []
        try:
            if not self.wait_registered(1):
                return
            samples.append((0, rss_mb(proc.pid)))
            print(f"  memory: worker RSS at start {samples[0][1]:.1f} MB", flush=True)
            began = time.monotonic()
            deadline = began + p.memory_timeout
            step = 1
            while step <= 10 and time.monotonic() < deadline and proc.poll() is None:
                left = Task.objects.filter(status=Status.PENDING).count()
                done = n - left
                while step <= 10 and done >= n * step // 10:
                    samples.append((step * 10, rss_mb(proc.pid)))
                    rate = done / max(time.monotonic() - began, 1e-9)
                    print(
                        f"  memory: {step * 10:3d} % ({done:,} claimed, {rate:,.0f}/s): RSS {samples[-1][1]:.1f} MB",
                        flush=True,
                    )
                    step += 1
                time.sleep(0.5)
            if step <= 10:
                self.note(f"memory: the worker did not drain {n:,} tasks within {p.memory_timeout:.0f}s")
            if not self.wait_finished(n, 60.0):
                self.note("memory: not every task succeeded")
        finally:
            self.pool.stop([proc])
        rss = [mb for _, mb in samples]
        if len(rss) < 3:
            return
        # Flatness: the sample at 10 % (past start-up and the first batches) against every later one.
        settled = rss[1]
        spread = max(abs(mb - settled) for mb in rss[1:]) / settled * 100
        self.metric("worker RSS at the end of the drain", "MB", ("<=", 150)).values.append(rss[-1])
        self.metric("worker RSS peak", "MB", ("<=", 150)).values.append(max(rss))
        self.metric("worker RSS drift after 10 % (max |RSS - RSS at 10 %|)", "%", ("<=", 10)).values.append(spread)
        print(
            f"  memory: RSS {' '.join(f'{pct}%:{mb:.0f}' for pct, mb in samples)} MB; drift after 10 % {spread:.1f} %"
        )

    # -- helpers -------------------------------------------------------------------------------

    def start_workers(
        self,
        count: int,
        concurrency: int,
        *extra: str,
        env: dict[str, str] | None = None,
        task_type: str = TASK_TYPE,
    ) -> list[subprocess.Popen]:
        # Concurrency 0: the command's defaults (no --concurrency), what a user who changes nothing gets.
        options = ("--concurrency", str(concurrency)) if concurrency else ()
        args = ("taskworker", "--types", task_type, *options, *extra)
        return [self.pool.start(*args, env=env) for _ in range(count)]

    def preload(self, n: int, *, one_transaction: bool) -> None:
        from django.db import transaction

        import taskflow

        size = self.plan.bulk_batch
        with transaction.atomic() if one_transaction else _nothing():
            # Each list built when sent: a million requests at once would weigh on this process.
            for start in range(0, n, size):
                end = min(start + size, n)
                taskflow.enqueue_many([{"task_type": TASK_TYPE, "payload": {"i": i}} for i in range(start, end)])

    def wait_registered(self, count: int, timeout: float = 60.0) -> bool:
        """Wait until `count` workers have written their liveness row (their threads are up)."""
        from taskflow.models import WorkerProcess

        if poll(lambda: WorkerProcess.objects.count() >= count, timeout):
            return True
        self.note(f"workers did not register within {timeout:.0f}s")
        for proc in self.pool.procs[-count:]:
            self.note(self.pool.tail(proc))
        return False

    def wait_finished(self, n: int, timeout: float) -> bool:
        from taskflow.models import Status, Task

        return poll(lambda: Task.objects.filter(status=Status.SUCCESS).count() >= n, timeout, interval=0.2)

    def wait_ids(self, ids: list[int], timeout: float) -> bool:
        from taskflow.models import Status, Task

        return poll(lambda: Task.objects.filter(id__in=ids, status=Status.SUCCESS).count() >= len(ids), timeout, 0.1)

    def check_count(self, n: int, label: str) -> None:
        from taskflow.models import Task

        found = Task.objects.count()
        if found != n:
            self.note(f"{label}: expected {n} task rows, found {found}")


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def poll(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Call `predicate` until it is true or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def rss_mb(pid: int) -> float:
    """A process's resident set size in MB (Linux /proc), or NaN if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def print_header(args: argparse.Namespace, plan: Plan, has_redis: bool) -> None:
    import django

    from taskflow.conf import get_settings
    from taskflow.engine.configs import configs

    cfg = configs.get(TASK_TYPE)
    print("taskflow core benchmark", "(quick)" if args.quick else "(full)")
    print(f"  code: {_code_version()}")
    print(f"  python {platform.python_version()}, django {django.get_version()}, {os.cpu_count()} CPUs")
    print(f"  load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"  database: {database.describe()}")
    print(f"  redis: {os.environ.get('REDIS_URL') if has_redis else 'none (polling only)'}")
    print(f"  TASKFLOW: {dataclasses.asdict(get_settings())}")
    print(
        f"  ScheduleCfg {TASK_TYPE}: schedule_limit={cfg.schedule_limit} schedule_interval={cfg.schedule_interval}s "
        f"concurrency_limit={cfg.concurrency_limit}"
    )
    print(f"  plan: {dataclasses.asdict(plan)}", flush=True)


def _code_version() -> str:
    """The commit measured, and whether taskflow/ had uncommitted changes (figures move with them)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "taskflow"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown (no git)"
    return f"{head.stdout.strip() or '?'}{' + uncommitted changes in taskflow/' if dirty.stdout.strip() else ''}"


def _figure(value: float, decimals: int) -> str:
    """A figure for the table: thousands separated, small ones (ratios) with two decimals."""
    if value < 10:
        return f"{value:.2f}"
    return f"{value:,.{decimals}f}" if value >= 100 else f"{value:.1f}"


def print_table(bench: Bench) -> None:
    print("\nresults (median of runs)")
    width = max(len(m.name) for m in bench.metrics.values()) if bench.metrics else 20
    print(f"  {'metric':<{width}}  {'median':>10}  {'unit':<7}  {'runs':<26}  target")
    for m in bench.metrics.values():
        median = _figure(m.median, 1) if m.median is not None else "-"
        runs = ", ".join(_figure(v, 0) for v in m.values)
        target = f"{m.target[0]} {_figure(m.target[1], 0)}  {m.verdict()}" if m.target else ""
        print(f"  {m.name:<{width}}  {median:>10}  {m.unit:<7}  {runs:<26}  {target}")
    print(f"  load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if bench.notes:
        print("notes:")
        for text in bench.notes:
            print(f"  - {text.splitlines()[0]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (about 30 s)")
    parser.add_argument(
        "--phases", default="single,bulk,drain,latency", help=f"comma-separated subset of {','.join(PHASES)}"
    )
    parser.add_argument("--profile", action="store_true", help="also profile one worker draining (needs py-spy)")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "", help="path to the py-spy executable")
    parser.add_argument(
        "--reuse-db", action="store_true", help="keep the existing bench database instead of recreating it"
    )
    parser.add_argument("--json", type=Path, help="also write the metrics to this JSON file")
    parser.add_argument(
        "--drain-concurrency",
        default="",
        help="comma-separated worker concurrencies to drain with, 'default' for the command's defaults "
        "(default: default,32,128)",
    )
    parser.add_argument(
        "--profile-concurrency",
        default="",
        help="the profiled worker's concurrency, 'default' for the command's default (default: 32)",
    )
    parser.add_argument("--memory-tasks", type=int, help="tasks the memory phase drains (default 1,000,000)")
    args = parser.parse_args()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()] + (["profile"] if args.profile else [])
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s): {', '.join(sorted(unknown))}")
    if "profile" in phases and not args.py_spy:
        parser.error("profiling needs py-spy: pip install py-spy, or pass --py-spy PATH")
    if not os.environ.get("DATABASE_URL"):
        parser.error("set DATABASE_URL to a database whose name contains 'bench', e.g. mysql://root@127.0.0.1/tfbench")

    plan = QUICK if args.quick else FULL
    if args.drain_concurrency:
        try:
            levels = tuple(0 if c.strip() == "default" else int(c) for c in args.drain_concurrency.split(","))
        except ValueError:
            parser.error(f"--drain-concurrency takes integers and 'default'; got {args.drain_concurrency!r}")
        plan = dataclasses.replace(plan, drain_concurrency=levels)
    if args.profile_concurrency:
        value = args.profile_concurrency.strip()
        if value != "default" and not value.isdigit():
            parser.error(f"--profile-concurrency takes an integer or 'default'; got {value!r}")
        plan = dataclasses.replace(plan, profile_concurrency=0 if value == "default" else int(value))
    if args.memory_tasks:
        plan = dataclasses.replace(plan, memory_n=args.memory_tasks)
    database.ensure_database(os.environ["DATABASE_URL"], fresh=not args.reuse_db)
    import django

    django.setup()
    database.migrate()
    database.reset_schedule_configs("bench.")
    database.reset_tables()

    from taskflow.engine.redis import get_redis

    has_redis = get_redis() is not None
    print_header(args, plan, has_redis)

    log_dir = Path(tempfile.mkdtemp(prefix="taskflow-bench-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    pool = WorkerPool(log_dir, env)
    bench = Bench(plan, pool, has_redis=has_redis, deadline=time.monotonic() + plan.budget)
    profile_text = ""
    try:
        _warm_up()
        for phase in phases:
            print(f"\n[{phase}]", flush=True)
            if phase == "profile":
                profile_text = bench.profile(args.py_spy, log_dir)
            else:
                getattr(bench, phase)()
    except KeyboardInterrupt:
        bench.note("interrupted")
    finally:
        pool.close()
        database.reset_tables()
    print_table(bench)
    if profile_text:
        level = plan.profile_concurrency or "default"
        print(f"\nworker profile (one burst worker, C={level}, {plan.profile_n} tasks):")
        print(profile_text)
    print(f"\nworker logs: {log_dir}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {
            m.name: {"unit": m.unit, "median": m.median, "runs": m.values, "target": m.target}
            for m in bench.metrics.values()
        }
        args.json.write_text(json.dumps({"quick": args.quick, "metrics": data, "notes": bench.notes}, indent=2))
    return 0


def _warm_up() -> None:
    """Create the type's config row and lease an id node before anything is timed."""
    import taskflow

    for i in range(10):
        taskflow.enqueue(TASK_TYPE, {"warm": i})
    taskflow.enqueue_many([{"task_type": TASK_TYPE} for _ in range(10)])
    database.reset_tables()


if __name__ == "__main__":
    sys.exit(main())

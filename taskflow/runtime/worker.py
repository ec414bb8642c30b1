"""The worker: claims due tasks, runs their handlers in a thread pool, reports results in batches.

Threads: the claim loop (this object's `run`), `concurrency` handler threads, one reporter that
writes finished attempts in batches (and then gives their limiter slots back), one liveness
heartbeat, and (with Redis) a wake-up listener. A thread slot is busy from claim until its handler
returns, so the worker never holds more tasks than it can run; results still waiting to be written
are capped separately, so a slow database pauses claiming rather than piling up results.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Iterable

from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from ..conf import get_settings
from ..engine import registry, wakeup
from ..engine.attempts import ClaimedTask, Outcome, Report
from ..engine.claiming import claim_batch
from ..engine.configs import configs
from ..engine.finishing import finish_attempts
from ..engine.limiter import Limiter
from ..engine.validation import validate_json
from ..exceptions import LeaseLost, NextStage, PermanentFailure, Snooze
from .context import TaskContext
from .liveness import LivenessBeat

log = logging.getLogger("taskflow.worker")


class TooManyStuckHandlers(RuntimeError):
    """More handler threads are stuck past their deadlines than the worker tolerates: restart it."""


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Worker:
    def __init__(
        self,
        task_types: Iterable[str] | None = None,
        *,
        concurrency: int = 8,
        burst: bool = False,
        grace: float | None = None,
        worker_id: str | None = None,
        max_stuck: int | None = None,
    ) -> None:
        types = list(task_types) if task_types else registry.registered_types()
        for task_type in types:
            registry.get_handler(task_type)  # fail fast on a type nobody handles
        if not types:
            raise ValueError("no task types to work on: register handlers or pass --types")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.task_types = types
        self.concurrency = concurrency
        self.burst = burst
        self.grace = get_settings().SHUTDOWN_GRACE if grace is None else grace
        self.worker_id = worker_id or new_worker_id()
        self.host = socket.gethostname()
        self.limiter = Limiter()
        # Stuck handler threads tolerated before the worker stops for a restart (see _release_stuck).
        self.max_stuck = concurrency if max_stuck is None else max_stuck

        self._stopping = threading.Event()  # stop claiming; hand back what has not started
        self._done = threading.Event()  # every thread should exit
        self._wake = threading.Event()
        self._jobs: queue.SimpleQueue[ClaimedTask | None] = queue.SimpleQueue()
        self._reports: queue.SimpleQueue[Report] = queue.SimpleQueue()
        self._reports_ready = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0  # claimed and not yet run to the end: each holds a handler thread
        self._unreported = 0  # finished, result not yet written
        self._running: dict[int, ClaimedTask] = {}  # handler started and not yet returned
        self._stuck: set[tuple[int, int]] = set()  # (id, lease_token) of attempts past their deadline
        self._gave_up = False
        self._backlog: set[str] = set()  # types whose last claim came back full
        self._woken: set[str] = set()
        self._next_poll: dict[str, float] = {t: 0.0 for t in types}
        self._threads: list[threading.Thread] = []
        self.processed = 0

    # -- public --------------------------------------------------------------------------------

    def run(self) -> None:
        """Work until stopped (or, with burst, until nothing is due); then shut down gracefully."""
        log.info(
            "worker %s starting: types=%s concurrency=%d", self.worker_id, ",".join(self.task_types), self.concurrency
        )
        self._start_threads()
        try:
            self._claim_loop()
        finally:
            self._shutdown()
        log.info("worker %s stopped after %d tasks", self.worker_id, self.processed)
        if self._gave_up:
            raise TooManyStuckHandlers(f"{len(self._stuck)} handler thread(s) stuck past their deadlines")

    def request_stop(self) -> None:
        """Stop claiming and begin a graceful shutdown (safe to call from a signal handler)."""
        self._stopping.set()
        self._wake.set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def unreported(self) -> int:
        with self._lock:
            return self._unreported

    # -- threads -------------------------------------------------------------------------------

    def _start_threads(self) -> None:
        for n in range(self.concurrency):
            self._spawn(self._handler_loop, f"taskflow-handler-{n}")
        self._spawn(self._reporter_loop, "taskflow-reporter")
        self._liveness = LivenessBeat(self.worker_id, self.host, self.task_types, self.concurrency, self._done)
        self._liveness.start()
        wakeup.add_local_listener(self._on_wakeup)
        if self.limiter.uses_redis:
            wakeup.RedisListener(self._on_wakeup, self._done).start()

    def _spawn(self, target, name: str) -> None:  # noqa: ANN001
        # Daemon threads: a handler stuck forever must not keep the process alive at exit.
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _on_wakeup(self, task_types: set[str]) -> None:
        with self._lock:
            self._woken.update(task_types or self.task_types)
        self._wake.set()

    # -- claiming ------------------------------------------------------------------------------

    def _claim_loop(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            self._release_stuck()
            # Sampled before the round: a report flushed during it may have requeued work.
            idle = self.in_flight == 0 and self.unreported == 0
            try:
                claimed_any, soonest = self._claim_round()
                failures = 0
            except DatabaseError as exc:
                failures += 1
                delay = min(30.0, 0.5 * 2 ** min(failures, 6)) * (0.5 + random.random() / 2)
                log.warning("claim failed (%s); retrying in %.1fs", exc, delay)
                connection.close()
                self._stopping.wait(delay)
                continue
            if self.burst and idle and not claimed_any:
                break
            timeout = max(0.0, soonest - time.monotonic())
            if timeout > 0:
                self._wake.wait(timeout)
            self._wake.clear()

    def _claim_round(self) -> tuple[bool, float]:
        """Claim for every type that is due; returns (claimed anything, when next to look)."""
        cfgs = configs.get_many(self.task_types)
        now = time.monotonic()
        claimed_any = False
        soonest = now + 1.0
        with self._lock:
            woken, self._woken = self._woken, set()
        order = self.task_types[:]
        random.shuffle(order)  # no type always goes first when slots are scarce
        for task_type in order:
            cfg = cfgs[task_type]
            interval = max(0.01, cfg.schedule_interval)
            due = now >= self._next_poll[task_type] or task_type in woken or task_type in self._backlog
            if cfg.paused or not due:
                soonest = min(soonest, self._next_poll[task_type]) if not cfg.paused else soonest
                continue
            in_flight = self.in_flight
            # A thread is free again when its handler returns; results still being written are
            # capped separately, so a slow or unreachable database stops claims, not handlers.
            free = self.concurrency - in_flight if self.unreported < 2 * self.concurrency else 0
            # While work is still running, wait for a worthwhile batch of free slots: claiming a
            # few tasks at a time would spend the worker on claim round trips instead of tasks.
            worthwhile = max(1, min(cfg.schedule_limit, self.concurrency) // 4)
            if free <= 0 or (in_flight and free < worthwhile and task_type in self._backlog):
                self._backlog.add(task_type)  # a report flush wakes the loop when slots free
                continue
            wanted = min(free, cfg.schedule_limit)
            grant = self.limiter.take(task_type, wanted, cfg.concurrency_limit)
            tasks: list[ClaimedTask] = []
            try:
                tasks = claim_batch(
                    cfg,
                    grant.slots,
                    self.worker_id,
                    host=self.host,
                    exact_limit=self.limiter.exact_db_limit(cfg.concurrency_limit),
                )
            finally:
                self.limiter.confirm(grant, tasks)
            if tasks:
                claimed_any = True
                with self._lock:
                    self._in_flight += len(tasks)
                for task in tasks:
                    self._jobs.put(task)
            # A full batch means more is probably waiting: claim again when slots free up, or at
            # once if a worthwhile number are still free.
            if tasks and len(tasks) == wanted:
                self._backlog.add(task_type)
                if self.concurrency - self.in_flight >= worthwhile:
                    soonest = now
            else:
                self._backlog.discard(task_type)
            self._next_poll[task_type] = now + interval * (0.9 + 0.2 * random.random())
            soonest = min(soonest, self._next_poll[task_type])
        return claimed_any, soonest

    # -- running handlers -------------------------------------------------------------------------

    def _handler_loop(self) -> None:
        while True:
            task = self._jobs.get()
            if task is None:
                return
            report = self._execute(task)
            replaced = self._done_running(task)
            self._queue_report(report)
            if replaced:
                return  # a replacement thread has taken this one's place in the pool

    def _release_stuck(self) -> None:
        """Stop counting handler threads whose attempt is past its deadline, and replace them.

        A Python thread cannot be killed: a stuck handler runs on, but no longer holds a slot, so the
        worker keeps its full capacity (taskwatch takes the task away and its late report is refused).
        Past `max_stuck` such threads the worker stops and run() raises, so a supervisor restarts it.
        """
        now = timezone.now()
        with self._lock:
            late = [
                t
                for t in self._running.values()
                if t.lease_expires_at < now and (t.id, t.lease_token) not in self._stuck
            ]
            for task in late:
                self._stuck.add((task.id, task.lease_token))
                self._in_flight -= 1
            stuck = len(self._stuck)
        for task in late:
            log.warning("task %s attempt %d is past its deadline: its thread is replaced", task.id, task.attempt)
            self._spawn(self._handler_loop, f"taskflow-handler-for-{task.id}")
        if stuck > self.max_stuck and not self._gave_up:
            log.error("%d handler thread(s) stuck (max %d): stopping for a restart", stuck, self.max_stuck)
            self._gave_up = True
            self.request_stop()

    def _done_running(self, task: ClaimedTask) -> bool:
        """Free the attempt's thread slot; True if it had been written off as stuck (and replaced)."""
        with self._lock:
            if (task.id, task.lease_token) in self._stuck:
                self._stuck.discard((task.id, task.lease_token))
                return True  # its slot was freed when it was written off
            self._in_flight -= 1
            return False

    def _queue_report(self, report: Report) -> None:
        with self._lock:
            self._unreported += 1
        self._reports.put(report)
        self._reports_ready.set()

    def _execute(self, task: ClaimedTask) -> Report:
        if self._stopping.is_set():
            return Report(task, Outcome.HANDBACK)
        with self._lock:
            self._running[task.id] = task
        started = time.perf_counter()
        report: Report
        try:
            result = registry.get_handler(task.task_type)(TaskContext(task))
            validate_json("result", result)
            report = Report(task, Outcome.SUCCESS, result=result)
        except Snooze as signal:
            report = Report(task, Outcome.SNOOZE, delay=signal.delay, error=signal.reason)
        except PermanentFailure as signal:
            report = Report(task, Outcome.FAIL, error=signal.reason)
        except NextStage as signal:
            report = Report(task, Outcome.NEXT_STAGE, next_stage=signal)
        except LeaseLost as exc:
            log.warning("%s", exc)
            report = Report(task, Outcome.LOST)
        except Exception as exc:
            report = Report(
                task, Outcome.ERROR, error=f"{type(exc).__name__}: {exc}", detail=traceback.format_exc(limit=20)
            )
        report.cost_ms = int((time.perf_counter() - started) * 1000)
        with self._lock:
            # The same task may run again here after a rescue while this stuck attempt lingered.
            if self._running.get(task.id) is task:
                del self._running[task.id]
        return report

    # -- reporting -----------------------------------------------------------------------------

    def _reporter_loop(self) -> None:
        interval = get_settings().REPORT_INTERVAL
        pending: list[Report] = []
        failures = 0
        while True:
            self._reports_ready.wait(timeout=0.5)
            self._reports_ready.clear()
            if interval:
                time.sleep(interval)  # let a batch accumulate
            while True:
                try:
                    pending.append(self._reports.get_nowait())
                except queue.Empty:
                    break
            if pending:
                try:
                    self._flush(pending)
                    pending = []
                    failures = 0
                except DatabaseError as exc:
                    # Keep the reports and try again: a result is never dropped because the
                    # database blinked.
                    failures += 1
                    log.warning("could not write %d report(s) (%s); retrying", len(pending), exc)
                    connection.close()
                    time.sleep(min(10.0, 0.2 * 2 ** min(failures, 6)))
                    self._reports_ready.set()
                    continue
            if self._done.is_set() and self._reports.empty() and not pending:
                return

    def _flush(self, reports: list[Report]) -> None:
        accepted = finish_attempts(reports, limiter=self.limiter)
        refused = sum(1 for r in reports if r.outcome != Outcome.LOST) - len(accepted)
        if refused > 0:
            log.warning("%d stale report(s) refused (their attempts were taken away)", refused)
        with self._lock:
            self._unreported -= len(reports)
            self.processed += sum(1 for r in accepted if r.outcome != Outcome.HANDBACK)
        self._wake.set()

    # -- shutdown ------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        self._stopping.set()
        wakeup.remove_local_listener(self._on_wakeup)
        deadline = time.monotonic() + self.grace
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            # Stuck attempts are past their deadline already: taskwatch rescues them.
            unfinished = [t for t in self._running.values() if (t.id, t.lease_token) not in self._stuck]
        if unfinished:
            # Past the grace period: count the attempt and requeue by the retry policy, so a
            # task longer than any deploy window cannot loop forever.
            log.warning("grace period over: requeueing %d unfinished task(s)", len(unfinished))
            for task in unfinished:
                self._queue_report(
                    Report(task, Outcome.ERROR, error="interrupted: the worker stopped before it finished")
                )
        deadline = time.monotonic() + 10
        while self.unreported and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(self.concurrency):
            self._jobs.put(None)
        self._done.set()
        self._reports_ready.set()
        for thread in self._threads:
            if thread.name == "taskflow-reporter":
                thread.join(timeout=10)
        self._liveness.stop()
        close_old_connections()

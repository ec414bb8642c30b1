"""The worker: claims due tasks, runs their handlers in a thread pool, reports results in batches.

Threads: the claim loop (this object's `run`), `concurrency` handler threads, one reporter that
writes finished attempts in batches (and then gives their limiter slots back), one liveness
heartbeat, and (with Redis or PostgreSQL) a wake-up listener. A thread slot is busy from claim until its handler
returns, so the worker never holds more tasks than it can run; results still waiting to be written
are capped separately, so a slow database pauses claiming rather than piling up results.

Every one of those threads is a supervised loop (`supervision.Loop`): errors are logged and waited
out, and a thread that cannot go on makes the whole worker stop heartbeating and exit (`run` raises
WorkerFailed) rather than run on half-dead. Each thread drops a database connection that can no
longer serve before using it (`connections.drop_unusable`), so a database restart costs at most
the attempts that were using it at the time.
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
from collections.abc import Callable, Iterable

from django.db import DatabaseError, DataError, IntegrityError, close_old_connections
from django.utils import timezone

from ..conf import get_settings
from ..engine import registry, tasklog, validation, wakeup
from ..engine.attempts import ClaimedTask, DatabaseChannel, Outcome, Report, lost_attempts
from ..engine.claiming import claim_batch
from ..engine.configs import configs
from ..engine.finishing import finish_attempts
from ..engine.limiter import Limiter
from ..exceptions import (
    AttemptInterrupted,
    InvalidTask,
    LeaseLost,
    NextStage,
    PermanentFailure,
    Snooze,
    class_path,
)
from . import connections
from .context import TaskContext
from .liveness import LivenessBeat
from .supervision import Loop

log = logging.getLogger("taskflow.worker")


class WorkerFailed(RuntimeError):
    """The worker could not go on (one of its threads died or kept failing): restart it."""


class TooManyStuckHandlers(WorkerFailed):
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
        select_types: Callable[[], list[str]] | None = None,
    ) -> None:
        """`select_types`: how the task types were chosen, asked again every CONFIG_REFRESH for new ones
        (a django.tasks queue first used after the worker started, say)."""
        types = list(task_types) if task_types else registry.registered_types()
        for task_type in types:
            registry.get_handler(task_type)  # fail fast on a type nobody handles
        if not types:
            raise ValueError("no task types to work on: register handlers or pass --types")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.task_types = types
        self._select_types = select_types
        self._next_selection = 0.0
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
        self._failure: WorkerFailed | None = None  # why the worker is stopping, if it must be restarted
        self._backlog: set[str] = set()  # types whose last claim came back full
        self._woken: set[str] = set()
        self._next_poll: dict[str, float] = {}  # per type; set at its first round
        self._threads: list[threading.Thread] = []
        self._pending: list[Report] = []  # taken from the report queue, not yet written
        self._liveness = LivenessBeat(
            self.worker_id,
            self.host,
            self.task_types,
            self.concurrency,
            on_fatal=self._give_up,
            after_beat=self._notice_lost_attempts,
        )
        self.processed = 0

    # -- public --------------------------------------------------------------------------------

    def run(self) -> None:
        """Work until stopped (or, with burst, until nothing is due); then shut down gracefully."""
        log.info(
            "worker %s starting: types=%s concurrency=%d", self.worker_id, ",".join(self.task_types), self.concurrency
        )
        self._start_threads()
        try:
            Loop("taskflow-claim-loop", self._claim_step, on_fatal=self._give_up, stop=self._stopping).run()
        finally:
            self._shutdown()
        log.info("worker %s stopped after %d tasks", self.worker_id, self.processed)
        if self._failure is not None:
            raise self._failure

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
            self._spawn_handler(f"taskflow-handler-{n}")
        self._reporter = Loop("taskflow-reporter", self._report_step, on_fatal=self._give_up).start_thread()
        self._liveness.start()
        wakeup.add_local_listener(self._on_wakeup)
        wakeup.add_local_stop_listener(self._on_stop)
        # Redis pub/sub, PostgreSQL LISTEN or none; a listener that cannot go on stops the worker.
        wakeup.start_listener(self._on_wakeup, self._done, self._on_stop, on_fatal=self._give_up)

    def _spawn_handler(self, name: str) -> None:
        self._threads.append(Loop(name, self._handler_step, on_fatal=self._give_up).start_thread())

    def _give_up(self, reason: str) -> None:
        """A thread cannot go on: stop heartbeating at once, stop claiming, and exit for a restart.

        Running tasks get no grace period: a worker that does not beat will have them rescued, and
        they must not run on here meanwhile. They are reported as interrupted if the reporter lives.
        """
        log.error("worker %s cannot go on (%s): stopping for a restart", self.worker_id, reason)
        with self._lock:
            if self._failure is None:
                self._failure = WorkerFailed(reason)
        self._liveness.halt()
        self.grace = 0.0
        self.request_stop()

    def _on_stop(self, attempts: dict[int, int]) -> None:
        """Tell running handlers whose attempt ({task id: lease token}) was stopped (ctx.stop_requested)."""
        with self._lock:
            for task in self._running.values():
                if attempts.get(task.id) == task.lease_token:
                    task.stop_requested.set()

    def _notice_lost_attempts(self) -> None:
        """After each liveness beat: flag running attempts whose task was taken away (works without Redis)."""
        with self._lock:
            running = [t for t in self._running.values() if not t.stop_requested.is_set()]
        for task in lost_attempts(running):
            task.stop_requested.set()

    def _on_wakeup(self, task_types: set[str]) -> None:
        with self._lock:
            self._woken.update(task_types or self.task_types)
        self._wake.set()

    # -- claiming ------------------------------------------------------------------------------

    def _claim_step(self) -> bool:
        """One claim round, then wait until the next is due; False when a burst worker is done."""
        self._release_stuck()
        self._add_new_types()
        # Sampled before the round: a report flushed during it may have requeued work.
        idle = self.in_flight == 0 and self.unreported == 0
        connections.drop_unusable()
        claimed_any, soonest = self._claim_round()
        if self.burst and idle and not claimed_any:
            return False
        timeout = max(0.0, soonest - time.monotonic())
        if timeout > 0:
            self._wake.wait(timeout)
        self._wake.clear()
        return True

    def _add_new_types(self) -> None:
        """Serve the task types the worker's selection names now and did not before (e.g. a new queue)."""
        if self._select_types is None or time.monotonic() < self._next_selection:
            return
        self._next_selection = time.monotonic() + get_settings().CONFIG_REFRESH
        new = [t for t in self._select_types() if t not in self.task_types]
        if new:
            for task_type in new:
                registry.get_handler(task_type)  # the selection registered it; fail here if not
            # A new list, not an append: other threads read the old one meanwhile.
            self.task_types = [*self.task_types, *new]
            self._liveness.task_types = self.task_types
            log.info("worker %s now also serves %s", self.worker_id, ",".join(new))

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
            if task_type not in self._next_poll:
                # Workers started together must not poll in step: each first polls at a random point
                # of its interval, capped at a second so a restart never leaves due work waiting for
                # a long interval (a burst worker looks at once; a wake-up makes anyone look at once).
                offset = random.random() * min(interval, 1.0)
                self._next_poll[task_type] = now if self.burst else now + offset
            polled = now >= self._next_poll[task_type]
            due = polled or task_type in woken or task_type in self._backlog
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
            if polled:
                # Only a poll moves the poll schedule, so wake-ups (which reach every worker at
                # once) do not bring workers back into step.
                self._next_poll[task_type] = now + interval * (0.9 + 0.2 * random.random())
            soonest = min(soonest, self._next_poll[task_type])
        return claimed_any, soonest

    # -- running handlers -------------------------------------------------------------------------

    def _handler_step(self) -> bool:
        """Run the next job; False when this thread should end."""
        task = self._jobs.get()
        if task is None:
            return False
        report = self._execute(task)
        replaced = self._done_running(task)
        self._queue_report(report)
        return not replaced  # a replaced thread ends: another has taken its place in the pool

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
            log.warning(
                "task %s attempt %d is past its deadline: its thread is replaced",
                task.id,
                task.attempt,
                extra=tasklog.about(task),
            )
            self._spawn_handler(f"taskflow-handler-for-{task.id}")
        if stuck > self.max_stuck and self._failure is None:
            log.error("%d handler thread(s) stuck (max %d): stopping for a restart", stuck, self.max_stuck)
            self._failure = TooManyStuckHandlers(f"{stuck} handler thread(s) stuck past their deadlines")
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
        # A connection the server dropped since this thread's last task must not fail this one.
        connections.drop_unusable()
        with self._lock:
            self._running[task.id] = task
        started = time.perf_counter()
        try:
            with tasklog.running(task):
                report = self._run_handler(task)
        finally:
            with self._lock:
                # The same task may run again here after a rescue while this stuck attempt lingered.
                if self._running.get(task.id) is task:
                    del self._running[task.id]
        report.cost_ms = int((time.perf_counter() - started) * 1000)
        return report

    def _run_handler(self, task: ClaimedTask) -> Report:
        """Run the task's handler; whatever it does or raises becomes this attempt's report."""
        try:
            return self._outcome(task)
        except LeaseLost as exc:
            log.warning("%s", exc)
            return Report(task, Outcome.LOST)
        except InvalidTask as exc:
            # Bad input from the handler (a malformed signal, a result that cannot be stored, a bad
            # enqueue): another attempt would do the same, so the task fails now, and only it.
            return Report(task, Outcome.FAIL, error=_error(exc), detail=_traceback(), exception=class_path(exc))
        except BaseException as exc:  # SystemExit too: a handler must not end its thread
            if isinstance(exc, DatabaseError) and not isinstance(exc, (DataError, IntegrityError)):
                connections.suspect_all()  # the server may have gone away for every thread
            if isinstance(exc, KeyboardInterrupt):
                # Someone wants the process to end (as Django's own backends let it): the attempt
                # counts as failed, and the worker stops gracefully.
                log.warning("task %s raised KeyboardInterrupt: the worker stops", task.id)
                self.request_stop()
            return Report(task, Outcome.ERROR, error=_error(exc), detail=_traceback(), exception=class_path(exc))

    def _outcome(self, task: ClaimedTask) -> Report:
        try:
            result = registry.get_handler(task.task_type)(TaskContext(task, DatabaseChannel(task)))
        except Snooze as signal:
            return Report(task, Outcome.SNOOZE, delay=signal.delay, error=signal.reason)
        except PermanentFailure as signal:
            return Report(task, Outcome.FAIL, error=signal.reason)
        except NextStage as signal:
            if signal.context is not None:
                validation.json_text("context", signal.context)  # the size limit of stored JSON
            return Report(task, Outcome.NEXT_STAGE, next_stage=signal)
        # Checked here, so a result the database could not store fails its own task, not a batch.
        size = len(validation.json_text("result", result))
        return Report(task, Outcome.SUCCESS, result=result, result_size=size)

    # -- reporting -----------------------------------------------------------------------------

    def _report_step(self) -> bool:
        """Write what has finished, in one batch; False once the worker is done and all is written."""
        self._reports_ready.wait(timeout=0.5)
        self._reports_ready.clear()
        interval = get_settings().REPORT_INTERVAL
        if interval:
            time.sleep(interval)  # let a batch accumulate
        while True:
            try:
                self._pending.append(self._reports.get_nowait())
            except queue.Empty:
                break
        if self._pending:
            connections.drop_unusable()
            try:
                self._flush()
            except BaseException:
                # Kept, and tried again after the loop's pause: a result is never dropped because
                # the database blinked.
                self._reports_ready.set()
                raise
        return not (self._done.is_set() and self._reports.empty() and not self._pending)

    def _flush(self) -> None:
        reports = self._pending
        try:
            accepted = finish_attempts(reports, limiter=self.limiter)
        except BaseException:
            # An outage stopped the flush part-way: what was written is done, the rest stays.
            written = [r for r in reports if r.written is not None]
            self._pending = [r for r in reports if r.written is None]
            self._count_written(len(written), written)
            raise
        self._pending = []
        refused = sum(1 for r in reports if r.outcome != Outcome.LOST) - len(accepted)
        if refused > 0:
            log.warning("%d stale report(s) refused (their attempts were taken away)", refused)
        self._count_written(len(reports), accepted)

    def _count_written(self, finished: int, accepted: list[Report]) -> None:
        # A concurrency slot of a limited type freed here may let waiting tasks of it start: look
        # again now rather than at the next poll (slots freed by other workers wait for a poll).
        limited = {r.task.task_type for r in accepted} & self._limited_types()
        with self._lock:
            self._unreported -= finished
            self.processed += sum(1 for r in accepted if r.outcome != Outcome.HANDBACK)
            self._woken |= limited
        self._wake.set()

    def _limited_types(self) -> set[str]:
        cfgs = configs.get_many(self.task_types)
        if get_settings().GLOBAL_CONCURRENCY_LIMIT > 0:
            return set(cfgs)
        return {task_type for task_type, cfg in cfgs.items() if cfg.concurrency_limit > 0}

    # -- shutdown ------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        self._stopping.set()
        wakeup.remove_local_listener(self._on_wakeup)
        wakeup.remove_local_stop_listener(self._on_stop)
        started = time.monotonic()
        # self.grace is read again each time: a worker that must stop at once (_give_up) sets it to 0.
        # Claimed tasks still queued are handed back by idle handler threads within moments.
        while self.in_flight and (
            time.monotonic() - started < self.grace or (not self._jobs.empty() and time.monotonic() - started < 1)
        ):
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
                    Report(
                        task,
                        Outcome.ERROR,
                        error="interrupted: the worker stopped before it finished",
                        exception=class_path(AttemptInterrupted),
                    )
                )
        deadline = time.monotonic() + 10
        while self.unreported and time.monotonic() < deadline and self._reporter.is_alive():
            time.sleep(0.05)
        for _ in range(self.concurrency):
            self._jobs.put(None)
        self._done.set()
        self._reports_ready.set()
        self._reporter.join(timeout=10)
        # A worker that must be restarted keeps its row: it looks dead, and taskwatch rescues
        # whatever it could not report.
        self._liveness.stop(forget=self._failure is None)
        close_old_connections()


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _traceback() -> str:
    return traceback.format_exc(limit=20)

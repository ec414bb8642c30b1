"""The worker runtime, written once for every way of reaching the tasks (see connector.py).

Threads: the claim loop (`run`), `concurrency` handler threads, one reporter that sends finished
attempts in batches, and whatever the connector runs beside them (a liveness beat, wake-up
listeners). A thread slot is busy from claim until its handler returns, so the worker never holds
more tasks than it can run; results still waiting to be sent are capped separately, so a slow or
unreachable store pauses claiming rather than piling up results.

Every thread is a supervised loop (`supervision.Loop`): the connector's outages are waited out,
other errors logged and waited out, and a thread that cannot go on makes the worker stop beating
and exit (`run` raises WorkerFailed) rather than run on half-dead.

A handler past its deadline cannot be killed (a Python thread cannot): it no longer holds its slot
and a new thread takes its place; past `max_stuck` such threads the worker stops for a restart. On a
stop, attempts not started are handed back (pending again, the attempt not counted), running ones
get `grace` seconds, and what is still running then is reported as interrupted (a counted attempt).

Async handlers (`async def`) run on one event loop thread instead (`event_loop.py`), up to
`async_concurrency` at once, claimed for separately from the thread slots; past its deadline, on a
stop of its task, or past the grace period of a shutdown, an async handler is cancelled.

Nothing here imports Django: the remote worker uses this runtime with no settings.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine import registry, tasklog
from ..engine.outcomes import Outcome, Report
from ..exceptions import (
    AttemptInterrupted,
    AttemptTimedOut,
    InvalidTask,
    LeaseLost,
    NextStage,
    PermanentFailure,
    Snooze,
    class_path,
)
from .connector import ChannelFailed, Claim, Connector
from .context import TaskContext
from .event_loop import EventLoopThread

log = logging.getLogger("taskflow.worker")

# Defaults of the TASKFLOW settings of the same names (conf.py), which the remote worker has not.
PREFETCH = 256  # attempts claimed ahead of free threads, at most
PREFETCH_WAIT = 1.0  # seconds an attempt claimed ahead may wait unstarted before it is handed back
ASYNC_CONCURRENCY = 1000  # async handlers run at once on the event loop, at most
ASYNC_WATCH_INTERVAL = 0.2  # seconds between looks for async handlers to cancel (past their deadline, stopped)
# Seconds of work, at the pace threads take attempts, that the worker starts ahead of its free threads:
# one start UPDATE then covers many attempts, and a thread that frees takes the next without waiting
# for the claim loop. An attempt started ahead that no thread takes within PREFETCH_WAIT is handed back.
START_AHEAD = 0.05
PACE_SAMPLE = 0.01  # seconds between samples of how many attempts threads have taken


class WorkerFailed(RuntimeError):
    """The worker could not go on (one of its threads died or kept failing): restart it."""


class TooManyStuckHandlers(WorkerFailed):
    """More handler threads are stuck past their deadlines than the worker tolerates: restart it."""


@dataclass(eq=False)
class Job:
    """One attempt the worker holds, from its claim until its report is settled."""

    attempt: Any
    reserved: bool = False  # claimed ahead and not started yet: the connector starts it before it runs
    held_since: float = 0.0  # time.monotonic() of its claim
    running: bool = False  # its handler started and has not returned
    taken: bool = False  # a handler thread took it (under the runner's lock)
    withdrawn: bool = False  # handed back while it waited for a thread: the thread that gets it skips it
    stuck: bool = False  # written off past its deadline while its handler runs on
    reported: bool = False  # its end was reported when it was written off: the handler's late one is dropped
    settled: bool = False  # its report was applied or refused
    coroutine: bool = False  # an async handler's: it runs on the event loop, not in a thread
    task: asyncio.Task | None = None  # the coroutine's task on the event loop, once created
    cancelled: str = ""  # why its coroutine was cancelled: "timeout", "stopped" or "shutdown"


class Runner:
    """Claims, runs and reports attempts through a connector until stopped (or, with burst, until nothing is due)."""

    def __init__(
        self,
        connector: Connector,
        task_types: Iterable[str] | None,
        *,
        concurrency: int,
        burst: bool,
        grace: float,
        max_stuck: int | None,
        flush_timeout: float,
        report_interval: float = 0.005,
        prefetch: int = PREFETCH,
        prefetch_wait: float = PREFETCH_WAIT,
        async_concurrency: int = ASYNC_CONCURRENCY,
        start_ahead: float = START_AHEAD,
    ) -> None:
        types = list(task_types) if task_types else registry.registered_types()
        for task_type in types:
            registry.get_handler(task_type)  # fail fast on a type nobody handles
        if not types:
            raise ValueError("no task types to work on: register handlers or pass --types")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if prefetch < 0:
            raise ValueError("prefetch must be 0 or more")
        if async_concurrency < 1:
            raise ValueError("async concurrency must be at least 1")
        self.connector = connector
        self.task_types = types
        self.concurrency = concurrency
        self.burst = burst
        self.grace = grace
        # Stuck handler threads tolerated before the worker stops for a restart (see _release_stuck).
        self.max_stuck = concurrency if max_stuck is None else max_stuck
        self.flush_timeout = flush_timeout
        self.report_interval = report_interval
        # Claim-ahead: up to `prefetch` attempts beyond the free threads, as many as the threads
        # started in the last quarter of `prefetch_wait` (so slow handlers get none), each handed
        # back if it waits longer than `prefetch_wait` unstarted.
        self.prefetch = prefetch
        self.prefetch_wait = prefetch_wait
        # Seconds of work started ahead of free threads (START_AHEAD): a connector whose start is a
        # slower round trip (HTTP) starts more at a time, so threads do not wait for the next start.
        self.start_ahead = min(start_ahead, prefetch_wait / 2)
        self._buffer: deque[Job] = deque()  # claimed, not yet given to a thread (claim order)
        self._waiting: deque[Job] = deque()  # started and queued for a thread, not yet taken (claim order)
        self._taken = 0  # attempts handler threads have taken, ever
        self._pace: deque[tuple[float, int]] = deque()  # (when, self._taken then), every PACE_SAMPLE seconds

        self._stopping = threading.Event()  # stop claiming; hand back what has not started
        self._done = threading.Event()  # every thread should exit
        self._abandon = threading.Event()  # stop trying to send reports: the flush timeout passed
        self._wake = threading.Event()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._reports_ready = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0  # claimed and not yet run to the end: each holds a handler thread
        self._held: dict[int, Job] = {}  # by id(attempt): claimed and not yet settled
        self._reports: dict[int, Report] = {}  # by id(report): finished, not yet applied or refused
        self._stuck = 0  # handlers written off past their deadline that have not returned
        self._failure: BaseException | None = None  # why the worker stopped, if run() must raise
        self.processed = 0  # reports applied (hand-backs not counted)
        self.refused = 0  # reports refused: their attempts were taken away (or the report applied before)
        self.lost = 0  # reports still unsent when the worker gave up flushing
        # Async handlers: their own capacity, counted apart from the threads (see _claim_async).
        self.async_concurrency = async_concurrency
        self._async_running = 0  # claimed for the event loop and not yet ended
        self._event_loop: EventLoopThread | None = None  # started when the first async attempt is claimed
        self._next_async_watch = 0.0
        connector.bind(self)

    # -- public --------------------------------------------------------------------------------

    def run(self) -> None:
        """Work until stopped (or, with burst, until nothing is due); then shut down gracefully."""
        self.connector.banner()
        self.connector.open()
        self._start_threads()
        try:
            self._loop("taskflow-claim-loop", self._claim_step, stop=self._stopping).run()
        finally:
            self._shutdown()
        log.info(
            "%s stopped after %d tasks (%d reports refused, %d unsent)",
            self.connector.describe(),
            self.processed,
            self.refused,
            self.lost,
        )
        if self._failure is not None:
            raise self._failure

    def request_stop(self) -> None:
        """Stop claiming and shut down gracefully (from any thread; not from a signal handler: see stop_signals)."""
        self._stopping.set()
        self._wake.set()

    def wake(self) -> None:
        """Claim again now rather than at the next poll (a wake-up, freed slots)."""
        self._wake.set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def async_running(self) -> int:
        """Async handlers claimed for the event loop and not yet ended."""
        with self._lock:
            return self._async_running

    @property
    def unreported(self) -> int:
        with self._lock:
            return len(self._reports)

    def running_attempts(self) -> list[Any]:
        """The attempts whose handler runs now (stuck ones too)."""
        with self._lock:
            return [job.attempt for job in self._held.values() if job.running]

    def held_attempts(self) -> list[Any]:
        """Every attempt claimed and not yet settled: queued, running, or its report not yet applied or refused."""
        with self._lock:
            return [job.attempt for job in self._held.values()]

    def give_up(self, reason: str) -> None:
        """A thread cannot go on: stop beating at once, stop claiming, and exit for a restart.

        Running tasks get no grace period: a worker that does not beat will have them rescued, and
        they must not run on here meanwhile. They are reported as interrupted if the reporter lives.
        """
        log.error("%s cannot go on (%s): stopping for a restart", self.connector.describe(), reason)
        self._fail(WorkerFailed(reason))
        self.connector.halt()
        self.grace = 0.0
        self.request_stop()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
        self.request_stop()

    # -- threads -------------------------------------------------------------------------------

    def _loop(self, name: str, step: Any, stop: threading.Event | None = None) -> Any:
        return self.connector.loop(name, step, on_fatal=self.give_up, stop=stop)

    def _start_threads(self) -> None:
        for n in range(self.concurrency):
            self._spawn_handler(f"taskflow-handler-{n}")
        self._reporter = self._loop("taskflow-reporter", self._report_step, stop=self._abandon).start_thread()

    def _spawn_handler(self, name: str) -> None:
        self._loop(name, self._handler_step).start_thread()

    # -- claiming ------------------------------------------------------------------------------

    def _claim_step(self) -> bool:
        """One claim round, then wait until the next is due; False when a burst worker is done."""
        self._release_stuck()
        self._sample_pace()
        self._hand_back_stale()
        # Sampled before the round: a report settled during it may have requeued work.
        idle = self.in_flight == 0 and self.async_running == 0 and self.unreported == 0 and not self._buffer
        self.connector.prepare()
        try:
            self._dispatch()
            claim = self._claim()
            self._dispatch()
            async_claim = self._claim_async()
        except ChannelFailed as exc:
            self._fail(exc.error)
            return False
        self.connector.between_claims(self.held_attempts())
        if self.burst and idle and not claim.attempts and not async_claim.attempts:
            log.info("nothing is due: a burst worker stops")
            return False
        timeout = min(claim.next_look, async_claim.next_look) - time.monotonic()
        if timeout > 0:
            self._wake.wait(timeout)
        self._wake.clear()
        return True

    def _claim(self) -> Any:
        task_types = self._handler_types(coroutine=False)
        if not task_types:
            return Claim([], time.monotonic() + 1.0)
        in_flight = self.in_flight
        # A thread is free again when its handler returns; results still being sent are capped
        # separately, so a slow or unreachable store stops claims, not handlers.
        if self._reports_piled_up():
            room = ahead = 0
        else:
            room = max(0, self.concurrency - in_flight - len(self._buffer))
            ahead = max(0, self._ahead() - max(0, len(self._buffer) - (self.concurrency - in_flight)))
        # Of `ahead`, what _dispatch would start right after this claim: the claim may start those at once
        # instead of reserving them (no start of their own).
        start_ahead = max(0, min(ahead, self._start_room(in_flight) - room))
        claim = self.connector.claim(
            room, ahead, self.concurrency, in_flight > 0, task_types=task_types, start_ahead=start_ahead
        )
        if claim.attempts:
            now = time.monotonic()
            reserved = {id(a) for a in claim.reserved}
            jobs = [Job(a, reserved=id(a) in reserved, held_since=now) for a in claim.attempts]
            with self._lock:
                for job in jobs:
                    self._held[id(job.attempt)] = job
            self._buffer.extend(jobs)
        return claim

    def _reports_piled_up(self) -> bool:
        """Whether results waiting to be sent are so many that claiming should pause until some are."""
        async_capacity = self.async_concurrency if self._event_loop is not None else 0
        return self.unreported >= 2 * (self.concurrency + self.prefetch + async_capacity)

    def _handler_types(self, *, coroutine: bool) -> list[str]:
        """The task types served whose handler is (or is not) an `async def` function."""
        return [t for t in self.task_types if registry.is_async(t) == coroutine]

    def _ahead(self) -> int:
        """How many attempts to claim ahead of free threads: as many as went to threads lately, up to prefetch.

        "Lately" is a quarter of prefetch_wait, so at the current pace an attempt claimed ahead waits
        about that long, well within the bound after which it is handed back.
        """
        if not self.prefetch:
            return 0
        return min(self.prefetch, int(self._pace_per_second(self.prefetch_wait / 4) * self.prefetch_wait / 4))

    def _start_room(self, in_flight: int) -> int:
        """How many more attempts _dispatch would start now, for idle threads and `start_ahead` beyond them."""
        waiting = len(self._waiting)
        idle = self.concurrency - (in_flight - waiting)
        return max(0, idle + self._started_ahead() - waiting - len(self._buffer))

    def _started_ahead(self) -> int:
        """How many attempts to start ahead of free threads: `start_ahead` seconds of work at the threads' pace."""
        return int(self._pace_per_second(self.start_ahead) * self.start_ahead) if self.prefetch else 0

    def _sample_pace(self) -> None:
        now = time.monotonic()
        if not self._pace or now - self._pace[-1][0] >= PACE_SAMPLE:
            with self._lock:
                self._pace.append((now, self._taken))
        # Keep one sample at or before the longest window asked about.
        since = now - max(self.prefetch_wait / 4, self.start_ahead)
        while len(self._pace) > 1 and self._pace[1][0] <= since:
            self._pace.popleft()

    def _pace_per_second(self, seconds: float) -> float:
        """How many attempts a second threads took over about the last `seconds` (from the samples)."""
        now = time.monotonic()
        since = now - seconds
        if not self._pace:
            return 0.0
        # The newest sample at or before `since`, else the oldest kept; a rate, so a gap in sampling
        # (the claim loop blocked on a slow query) does not count as a burst.
        when, then = next(((w, t) for w, t in reversed(self._pace) if w <= since), self._pace[0])
        return (self._taken - then) / max(now - when, PACE_SAMPLE)

    def _dispatch(self) -> None:
        """Start claimed attempts for free threads and `start_ahead` seconds of work beyond them, in claim order,
        and queue them.

        Reserved ones are started by the connector first, in one batch: with short handlers the threads
        then run a batch started by one UPDATE instead of one UPDATE per few free threads.
        """
        while self._waiting and self._waiting[0].taken:
            self._waiting.popleft()
        waiting = len(self._waiting)
        idle = self.concurrency - (self.in_flight - waiting)
        ahead = self._started_ahead()
        wanted = min(len(self._buffer), idle + ahead - waiting)
        # Top the queue up by a worthwhile batch of starts, unless threads would idle meanwhile; attempts
        # the claim started already cost no UPDATE, and wait for none.
        if wanted <= 0 or (waiting >= idle and wanted < max(1, ahead // 2) and self._buffer[0].reserved):
            return
        jobs = [self._buffer.popleft() for _ in range(wanted)]
        reserved = [j.attempt for j in jobs if j.reserved]
        try:
            started = {id(a) for a in self.connector.start(reserved)} if reserved else set()
        except BaseException:
            self._buffer.extendleft(reversed(jobs))  # still held, in order: started at the next try
            raise
        ready: list[Job] = []
        for job in jobs:
            if (job.reserved and id(job.attempt) not in started) or job.attempt.stop_requested.is_set():
                self._queue_report(Report(job.attempt, Outcome.LOST))  # taken away while it waited
            else:
                job.reserved = False
                ready.append(job)
        with self._lock:
            self._in_flight += len(ready)
        self._waiting.extend(ready)
        for job in ready:
            self._jobs.put(job)

    def _hand_back_stale(self) -> None:
        """Hand back attempts claimed ahead that waited for a thread over prefetch_wait: other workers may run them.

        Those started ahead and queued for a thread too (their attempt is not counted either: no handler ran).
        """
        cutoff = time.monotonic() - self.prefetch_wait
        stale = 0
        while self._waiting and (self._waiting[0].taken or self._waiting[0].held_since < cutoff):
            job = self._waiting.popleft()
            with self._lock:
                if job.taken:
                    continue
                job.withdrawn = True
                self._in_flight -= 1
            self._queue_report(Report(job.attempt, Outcome.HANDBACK))
            stale += 1
        while self._buffer and self._buffer[0].held_since < cutoff:
            self._queue_report(Report(self._buffer.popleft().attempt, Outcome.HANDBACK))
            stale += 1
        if stale:
            log.info("handed back %d task(s) claimed ahead that waited %.1fs unstarted", stale, self.prefetch_wait)

    # -- running handlers -------------------------------------------------------------------------

    def _handler_step(self) -> bool:
        """Run the next job; False when this thread should end."""
        job = self._jobs.get()
        if job is None:
            return False
        with self._lock:
            if job.withdrawn:
                return True  # handed back while it waited (see _hand_back_stale)
            job.taken = True
            self._taken += 1
        if job.attempt.stop_requested.is_set():
            report = Report(job.attempt, Outcome.LOST)  # stopped while it waited for a thread
        else:
            report = self.execute(job.attempt, job)
        with self._lock:
            replaced = job.stuck
            if job.stuck:
                self._stuck -= 1  # its slot was freed when it was written off
            else:
                self._in_flight -= 1
            if job.reported and job.settled:
                self._held.pop(id(job.attempt), None)
        if not job.reported:
            self._queue_report(report)
        self._wake.set()  # a thread is free: the claim loop may claim
        return not replaced  # a replaced thread ends: another has taken its place in the pool

    def execute(self, attempt: Any, job: Job | None = None) -> Report:
        """Run the attempt's handler on this thread and time it; whatever it does or raises becomes its report.

        A handler thread's step runs it; taskflow.testing.run_tasks runs tasks inline with it.
        """
        if self._stopping.is_set():
            return Report(attempt, Outcome.HANDBACK)
        job = job or Job(attempt)
        # A connection the server dropped since this thread's last task must not fail this one.
        self.connector.prepare()
        with self._lock:
            job.running = True
        started = time.perf_counter()
        try:
            with tasklog.running(attempt):
                report = self._run_handler(attempt)
        finally:
            with self._lock:
                job.running = False
        report.cost_ms = int((time.perf_counter() - started) * 1000)
        return report

    def _run_handler(self, attempt: Any) -> Report:
        try:
            return self._outcome(attempt)
        except BaseException as exc:  # SystemExit too: a handler must not end its thread
            return self._raised(attempt, exc)

    def _raised(self, attempt: Any, exc: BaseException) -> Report:
        """The report of a handler that raised `exc` (called in its `except` block: the traceback is read here)."""
        if isinstance(exc, LeaseLost):
            log.warning("%s", exc)
            return Report(attempt, Outcome.LOST)
        if isinstance(exc, InvalidTask):
            # Bad input from the handler (a malformed signal, a result that cannot be stored, a bad
            # enqueue): another attempt would do the same, so the task fails now, and only it.
            return Report(attempt, Outcome.FAIL, error=_error(exc), detail=_traceback(), exception=class_path(exc))
        self.connector.after_error(exc)
        if isinstance(exc, KeyboardInterrupt):
            # Someone wants the process to end (as Django's own backends let it): the attempt
            # counts as failed, and the worker stops gracefully.
            log.warning("task %s raised KeyboardInterrupt: the worker stops", attempt.id)
            self.request_stop()
        return Report(attempt, Outcome.ERROR, error=_error(exc), detail=_traceback(), exception=class_path(exc))

    def _outcome(self, attempt: Any) -> Report:
        ctx = TaskContext(attempt, self.connector.channel(attempt))
        try:
            result = ctx.run(registry.get_handler(attempt.task_type))
        except (Snooze, PermanentFailure, NextStage) as signal:
            return self._signalled(attempt, signal)
        return self._succeeded(attempt, result)

    def _signalled(self, attempt: Any, signal: Snooze | PermanentFailure | NextStage) -> Report:
        """The report of a handler that raised one of the signals (ctx.snooze(), ctx.fail(), ctx.next_stage())."""
        if isinstance(signal, Snooze):
            return Report(attempt, Outcome.SNOOZE, delay=signal.delay, error=signal.reason)
        if isinstance(signal, PermanentFailure):
            return Report(attempt, Outcome.FAIL, error=signal.reason)
        if signal.context is not None:
            self.connector.check_json("context", signal.context)  # the size limit of stored JSON
        return Report(attempt, Outcome.NEXT_STAGE, next_stage=signal)

    def _succeeded(self, attempt: Any, result: Any) -> Report:
        # Checked here, so a result the store cannot keep fails its own task, not a batch.
        size = self.connector.check_json("result", result)
        return Report(attempt, Outcome.SUCCESS, result=result, result_size=size)

    # -- running async handlers -----------------------------------------------------------------

    def _claim_async(self) -> Claim:
        """Claim attempts of async handler types, as many as the event loop has room for, and start them.

        Their capacity is `async_concurrency`, apart from the threads. They are not claimed ahead:
        claim-ahead hides a claim's round trip behind short handlers while threads are scarce; here
        a claim round fills hundreds of free places at once. Limited types go through the limiter
        in the connector's claim as any type does, so a limit of N never has more than N running.
        """
        task_types = self._handler_types(coroutine=True)
        if not task_types:
            return Claim([], time.monotonic() + 1.0)
        running = self.async_running
        room = 0 if self._reports_piled_up() else self.async_concurrency - running
        claim = self.connector.claim(room, 0, self.async_concurrency, running > 0, task_types=task_types)
        if claim.attempts:
            self._start_async(claim.attempts)
        return claim

    def _start_async(self, attempts: list[Any]) -> None:
        now = time.monotonic()
        jobs = [Job(a, held_since=now, running=True, coroutine=True) for a in attempts]
        with self._lock:
            for job in jobs:
                self._held[id(job.attempt)] = job
            self._async_running += len(jobs)
        if self._event_loop is None:
            self._event_loop = EventLoopThread(
                "taskflow-event-loop", io_threads=self.concurrency, before_call=self.connector.prepare
            ).start()

        def started(i: int, task: asyncio.Task) -> None:
            jobs[i].task = task

        self._event_loop.submit([self._run_async(job) for job in jobs], started)

    async def _run_async(self, job: Job) -> None:
        """Run an async handler on the event loop, as _handler_step and execute run a sync one in a thread."""
        attempt = job.attempt
        try:
            if self._stopping.is_set():
                report = Report(attempt, Outcome.HANDBACK)
            else:
                started = time.perf_counter()
                with tasklog.running(attempt):
                    report = await self._arun_handler(job)
                report.cost_ms = int((time.perf_counter() - started) * 1000)
        finally:
            with self._lock:
                job.running = False
                self._async_running -= 1
                running = self._async_running
                if job.reported and job.settled:
                    self._held.pop(id(attempt), None)
        if not job.reported:
            self._queue_report(report)
        # Claim again once a worthwhile share of the loop's places is free (not at each of thousands of ends).
        if running == 0 or self.async_concurrency - running == max(1, self.async_concurrency // 8):
            self._wake.set()

    async def _arun_handler(self, job: Job) -> Report:
        attempt = job.attempt
        try:
            ctx = TaskContext(attempt, self.connector.channel(attempt))
            try:
                result = await ctx.arun(registry.get_handler(attempt.task_type))
            except (Snooze, PermanentFailure, NextStage) as signal:
                report = self._signalled(attempt, signal)
            else:
                report = self._succeeded(attempt, result)
        except asyncio.CancelledError:
            return self._cancelled(job)
        except BaseException as exc:
            report = self._raised(attempt, exc)
        # A handler that swallowed its cancellation ends as cancelled all the same.
        return self._cancelled(job) if job.cancelled else report

    def _cancelled(self, job: Job) -> Report:
        """The report of an async handler the worker cancelled (a shutdown's is sent before, as interrupted)."""
        attempt = job.attempt
        if job.cancelled == "timeout":
            error = f"attempt {attempt.attempt} ran past its deadline without a heartbeat: cancelled"
            return Report(attempt, Outcome.ERROR, error=error, exception=class_path(AttemptTimedOut))
        # Stopped: the attempt was taken away, so this is refused like any late report.
        return Report(attempt, Outcome.ERROR, error="cancelled: the attempt was taken away")

    def _watch_async(self) -> None:
        """Cancel async handlers past their deadline (a timeout, retried by the policy) or whose attempt was taken away.

        Unlike a thread, a coroutine can be cancelled: it frees its place at once, and its end is
        reported by the worker itself rather than left to taskwatch's rescue.
        """
        now = time.monotonic()
        if self._event_loop is None or now < self._next_async_watch:
            return
        self._next_async_watch = now + ASYNC_WATCH_INTERVAL
        with self._lock:
            jobs = [j for j in self._held.values() if j.coroutine and j.running and not j.cancelled]
        for job in jobs:
            if job.attempt.stop_requested.is_set():
                self._cancel_async(job, "stopped")
            elif self.connector.past_deadline(job.attempt):
                log.warning(
                    "task %s attempt %d is past its deadline: its handler is cancelled",
                    job.attempt.id,
                    job.attempt.attempt,
                    extra=tasklog.about(job.attempt),
                )
                self._cancel_async(job, "timeout")

    def _cancel_async(self, job: Job, why: str) -> None:
        assert self._event_loop is not None
        job.cancelled = why
        self._event_loop.cancel(lambda: job.task)

    def _release_stuck(self) -> None:
        """Stop counting handler threads whose attempt is past its deadline, and replace them.

        A Python thread cannot be killed: a stuck handler runs on, but no longer holds a slot, so the
        worker keeps its full capacity. The store takes the attempt away (taskwatch, or the remote
        worker's own failure report) and the handler's late report is refused or dropped. Past
        `max_stuck` such threads the worker stops and run() raises, so a supervisor restarts it.
        """
        self._watch_async()
        with self._lock:
            late = [j for j in self._held.values() if j.running and not j.stuck and not j.coroutine]
        late = [j for j in late if self.connector.past_deadline(j.attempt)]
        if not late:
            return
        with self._lock:
            for job in late:
                job.stuck = True
                self._in_flight -= 1
            self._stuck += len(late)
            stuck = self._stuck
        for job in late:
            attempt = job.attempt
            report = self.connector.overdue(attempt)
            log.warning(
                "task %s attempt %d is past its deadline: its thread is replaced%s",
                attempt.id,
                attempt.attempt,
                " (reported as failed)" if report else "",
                extra=tasklog.about(attempt),
            )
            if report is not None:
                attempt.stop_requested.set()
                job.reported = True
                self._queue_report(report)
            self._spawn_handler(f"taskflow-handler-for-{attempt.id}")
        if stuck > self.max_stuck and self._failure is None:
            log.error("%d handler thread(s) stuck (max %d): stopping for a restart", stuck, self.max_stuck)
            self._fail(TooManyStuckHandlers(f"{stuck} handler thread(s) stuck past their deadlines"))

    # -- reporting -----------------------------------------------------------------------------

    def _queue_report(self, report: Report) -> None:
        with self._lock:
            self._reports[id(report)] = report
        self._reports_ready.set()

    def _report_step(self) -> bool:
        """Send what has finished, in one batch; False once the worker is done and all is sent."""
        self._reports_ready.wait(timeout=0.5)
        self._reports_ready.clear()
        if self.report_interval:
            time.sleep(self.report_interval)  # let a batch gather
        with self._lock:
            pending = list(self._reports.values())
        if pending:
            self.connector.prepare()
            try:
                self.connector.report(pending, self._settle)
            except ChannelFailed as exc:
                self._fail(exc.error)
                return False
            except BaseException:
                # Kept, and tried again after the loop's pause: a result is never dropped because
                # the store blinked.
                self._reports_ready.set()
                raise
            if self.unreported:
                self._reports_ready.set()  # some were replaced (a refused result, say): send them now
        return not (self._done.is_set() and not self.unreported)

    def _settle(self, reports: Sequence[Report], applied: Sequence[Report]) -> None:
        """These reports are done with: `applied` were written, the others refused (or had nothing to write)."""
        accepted = {id(r) for r in applied}
        with self._lock:
            for report in reports:
                if self._reports.pop(id(report), None) is None:
                    continue
                job = self._held.get(id(report.task))
                if job is not None:
                    job.settled = True
                    if not job.running:
                        del self._held[id(report.task)]
                if report.outcome in (Outcome.HANDBACK, Outcome.LOST):
                    continue
                if id(report) in accepted:
                    self.processed += 1
                else:
                    self.refused += 1
        self._wake.set()  # claiming may have paused while reports piled up

    # -- shutdown ------------------------------------------------------------------------------

    def _hand_back_unstarted(self) -> None:
        """Hand back the attempts claimed and not started (their attempt is not counted)."""
        while self._buffer:
            self._queue_report(Report(self._buffer.popleft().attempt, Outcome.HANDBACK))
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            with self._lock:
                if job.withdrawn:
                    continue  # handed back already
                job.withdrawn = True
                self._in_flight -= 1
            self._queue_report(Report(job.attempt, Outcome.HANDBACK))

    def _shutdown(self) -> None:
        self._stopping.set()
        self.connector.stopping()
        started = time.monotonic()
        self._hand_back_unstarted()
        # self.grace is read again each time: a worker that must stop at once (give_up) sets it to 0.
        while (self.in_flight or self.async_running) and time.monotonic() - started < self.grace:
            self._release_stuck()
            self._hand_back_unstarted()
            self.connector.between_claims(self.held_attempts())
            time.sleep(0.05)
        self._hand_back_unstarted()
        with self._lock:
            # Stuck attempts are past their deadline already: the store takes them away.
            unfinished_jobs = [j for j in self._held.values() if j.running and not j.stuck]
            unfinished = [j.attempt for j in unfinished_jobs]
            for job in unfinished_jobs:
                job.reported = True
        for job in unfinished_jobs:
            if job.coroutine:
                self._cancel_async(job, "shutdown")  # a coroutine, unlike a thread, is stopped
        if unfinished:
            # Past the grace period: count the attempt and requeue by the retry policy, so a
            # task longer than any deploy window cannot loop forever.
            log.warning("grace period over: requeueing %d unfinished task(s)", len(unfinished))
            for attempt in unfinished:
                self._queue_report(
                    Report(
                        attempt,
                        Outcome.ERROR,
                        error="interrupted: the worker stopped before it finished",
                        exception=class_path(AttemptInterrupted),
                    )
                )
        deadline = time.monotonic() + self.flush_timeout
        while self.unreported and time.monotonic() < deadline and self._reporter.is_alive():
            self.connector.between_claims(self.held_attempts())
            time.sleep(0.05)
        for _ in range(self.concurrency):  # stuck threads end by themselves when their handler returns
            self._jobs.put(None)
        if self._event_loop is not None:
            self._event_loop.stop()
        self._done.set()
        self._abandon.set()
        self._reports_ready.set()
        self._reporter.join(timeout=10)
        with self._lock:
            self.lost = len(self._reports)
        if self.lost:
            log.error("%d report(s) could not be sent before giving up: their tasks will be rescued", self.lost)
        # A worker that must be restarted keeps looking alive no longer, and its row stays: it looks
        # dead, and taskwatch rescues whatever it could not report.
        self.connector.close(failed=self._failure is not None)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _traceback() -> str:
    return traceback.format_exc(limit=20)

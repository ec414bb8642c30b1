"""The remote worker: runs registered handlers on a machine with no database, through the HTTP API.

It does what the local worker does, over HTTP: registers (`POST workers/`: the server issues its
worker id and key, sent with every later call), holds due tasks in batches sized by its free handler
threads (`POST tasks/hold/`), runs each with the same TaskContext as the local worker (its lease
kept by `HttpChannel`), reports finished attempts in batches with their leases and attempt keys
(`POST tasks/set/`), beats its liveness (`POST tasks/heartbeat/` with `beat` and every attempt it
holds: the server answers which were taken away, and hands back any it claimed for this worker
whose hold answer was lost), and on a graceful stop hands unstarted tasks back (`POST tasks/release/`).

The server may be unreachable at any time. Holding then waits; finished reports stay in memory and
are sent again with a back-off capped at MAX_BACKOFF seconds, never dropped; a report refused as
`lease_lost` after such a retry is final (it was applied before the connection broke, or the attempt
was taken away meanwhile). A handler's heartbeat or checkpoint is retried until its lease would
expire, then raises LeaseLost. A 401 or 403 stops the worker (`run` raises AccessDenied), except a
refused worker credential (the server's SECRET_KEY changed): the worker registers again, and the
attempts it held under its old id are refused as `forbidden` and left to taskwatch's rescue.

Nothing here imports the Django ORM or needs Django settings: the server applies every rule
(validation, retry policy, state machine); the signals a handler raises check their own arguments
(taskflow.exceptions) exactly as for the local worker.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from ..engine import registry
from ..engine.progress import Progress
from ..exceptions import InvalidTask, LeaseLost, NextStage, PermanentFailure, Snooze
from . import logs
from .context import TaskContext
from .remote_client import AccessDenied, ApiClient, ApiError, Rejected, Unreachable

log = logging.getLogger("taskflow.remote")

MAX_BACKOFF = 30.0  # seconds between tries while the server is unreachable, at most
FIRST_BACKOFF = 0.5
MAX_HOLD = 1000  # the API's largest hold
REPORT_BATCH = 500  # items per report request
REPORT_BATCH_BYTES = 4 * 1024 * 1024  # well under the server's default MAX_REQUEST_BYTES (8 MiB)


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def host_name() -> str:
    """This machine's name as the server takes it for a worker id's host part (letters, digits, '_.@/+-')."""
    host = re.sub(r"[^A-Za-z0-9_.@/+-]", "-", socket.gethostname())[:100]
    return host if host[:1].isalnum() else ("h" + host)[:100]


@dataclass
class RemoteAttempt:
    """A task held over HTTP: what its context shows, plus its lease and a local deadline."""

    id: int
    task_type: str
    key: str | None
    version: int
    priority: int
    payload: Any
    attempt: int
    max_retries: int
    stage: str
    context: Any
    checkpoint: Any
    trace_id: str
    worker_id: str
    lease: Any  # echoed back exactly as the server sent it
    attempt_key: str  # the server's proof that this worker holds the attempt, sent with every report
    lease_expires_at: datetime
    # The lease's length as the server granted it, so an extension can be estimated if the server
    # does not say; and the local monotonic clock's reading of the deadline (immune to clock skew).
    lease_seconds: float
    local_deadline: float
    stop_requested: threading.Event = field(default_factory=threading.Event, repr=False)

    @classmethod
    def from_json(cls, task: dict[str, Any], asked_at: float, server_now: datetime | None) -> RemoteAttempt:
        expires = _parse_time(task.get("lease_expires_at")) or datetime.now(UTC) + timedelta(seconds=60)
        now = server_now or datetime.now(UTC)
        # The Date header has whole seconds: count the lease a second shorter, never longer.
        seconds = max(1.0, (expires - now).total_seconds() - 1.0)
        return cls(
            id=int(task["task_id"]),
            task_type=task["task_type"],
            key=task.get("key"),
            version=task.get("version", 0),
            priority=task.get("priority", 0),
            payload=task.get("payload"),
            attempt=task.get("attempts", 1),
            max_retries=task.get("max_retries", 0),
            stage=task.get("stage") or "",
            context=task.get("context"),
            checkpoint=task.get("checkpoint"),
            trace_id=task.get("trace_id") or "",
            worker_id=task.get("worker_id") or "",
            lease=task["lease"],
            attempt_key=task.get("attempt_key") or "",
            lease_expires_at=expires,
            lease_seconds=seconds,
            local_deadline=asked_at + seconds,
        )

    @property
    def fence_key(self) -> tuple[int, Any]:
        """This attempt among all of its task's: the task and the lease."""
        return (self.id, self.lease)

    @property
    def fence(self) -> dict[str, Any]:
        """What identifies this attempt to the server in every report, and proves this worker holds it."""
        return {"task_id": str(self.id), "lease": self.lease, "attempt_key": self.attempt_key}

    def extended(self, answer: dict[str, Any] | None) -> datetime:
        """Record an applied heartbeat (the server's new deadline if it sent one); returns the deadline."""
        expires = _parse_time((answer or {}).get("lease_expires_at"))
        now = datetime.now(UTC)
        if expires is None:
            expires = now + timedelta(seconds=self.lease_seconds)
        self.lease_expires_at = expires
        self.local_deadline = time.monotonic() + max(0.0, (expires - now).total_seconds())
        return expires


class HttpChannel:
    """The remote worker's AttemptChannel: heartbeats, checkpoints, progress go to the API, retried through outages."""

    def __init__(self, client: ApiClient, attempt: RemoteAttempt) -> None:
        self.client, self.attempt = client, attempt

    @property
    def deadline(self) -> datetime:
        return self.attempt.lease_expires_at

    @property
    def stop_requested(self) -> bool:
        return self.attempt.stop_requested.is_set()

    def heartbeat(self, checkpoint: Any = ..., progress: Progress | None = None) -> datetime:
        if checkpoint is not ...:
            _json_text("checkpoint", checkpoint)
        pause = FIRST_BACKOFF
        while True:
            try:
                return self._send(checkpoint, progress)
            except Unreachable as exc:
                left = self.attempt.local_deadline - time.monotonic()
                if left <= 0:
                    raise LeaseLost(
                        f"task {self.attempt.id} attempt {self.attempt.attempt}: the server was unreachable "
                        f"until its lease expired ({exc})"
                    ) from None
                log.warning("heartbeat of task %s: %s; trying again", self.attempt.id, exc)
                time.sleep(min(pause, left))
                pause = min(pause * 2, MAX_BACKOFF)

    def _send(self, checkpoint: Any, progress: Progress | None) -> datetime:
        lost = LeaseLost(f"task {self.attempt.id} attempt {self.attempt.attempt} no longer holds its lease")
        carried = {} if progress is None else {"progress": progress.as_json()}
        if checkpoint is ...:
            [result] = self.client.batch("tasks/heartbeat/", [{**self.attempt.fence, **carried}])
            if result.get("outcome") != "applied":
                self.attempt.stop_requested.set()
                raise lost
            return self.attempt.extended(result)
        body = {"lease": self.attempt.lease, "attempt_key": self.attempt.attempt_key, "checkpoint": checkpoint}
        body.update(carried)
        try:
            answer = self.client.set_task(str(self.attempt.id), body)
        except AccessDenied as exc:
            # Not this worker's attempt any more (its credential was refused, or the key): as lost.
            self.attempt.stop_requested.set()
            raise LeaseLost(f"{lost}: {_detail(exc.body) or exc}") from None
        except Rejected as exc:
            if exc.status == 409:
                self.attempt.stop_requested.set()
                raise lost from None
            # The server's rule (the size of stored JSON, say): the same error as the local worker's.
            raise InvalidTask(_detail(exc.body) or str(exc)) from None
        return self.attempt.extended(answer)


def _detail(body: Any) -> str:
    if not isinstance(body, dict):
        return ""
    parts = [str(body.get("detail") or body.get("error") or "")]
    fields = body.get("fields")
    if isinstance(fields, dict):
        parts += [f"{name}: {' '.join(map(str, messages))}" for name, messages in fields.items()]
    return "; ".join(p for p in parts if p)


def _json_text(name: str, value: Any) -> str:
    """`value` as JSON text, or InvalidTask; its size and storability are the server's to judge."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidTask(f"{name} must be JSON-serialisable: {exc}") from None


@dataclass(eq=False)  # compared by identity: two reports are never "the same"
class RemoteReport:
    """One finished attempt waiting to be sent: the item of `POST tasks/set/` (or None: nothing to send)."""

    attempt: RemoteAttempt
    item: dict[str, Any] | None
    tries: int = 0


def failure_item(attempt: RemoteAttempt, error: str, *, retry: bool = True, detail: str = "") -> dict[str, Any]:
    item: dict[str, Any] = {**attempt.fence, "status": "failed", "error": error[:4000]}
    if not retry:
        item["retry"] = False
    if detail:
        item["detail"] = detail[-4000:]
    return item


class RemoteWorker:
    """Holds, runs and reports tasks over HTTP until stopped (or, with burst, until nothing is due)."""

    def __init__(
        self,
        client: ApiClient,
        task_types: Iterable[str] | None = None,
        *,
        concurrency: int = 8,
        burst: bool = False,
        grace: float = 30.0,
        poll_interval: float = 1.0,
        beat_interval: float = 5.0,
        flush_timeout: float = 60.0,
    ) -> None:
        types = list(task_types) if task_types else registry.registered_types()
        for task_type in types:
            registry.get_handler(task_type)  # fail fast on a type nobody handles here
        if not types:
            raise ValueError("no task types to work on: import a module that registers handlers, or pass --types")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.client = client
        self.task_types = types
        self.concurrency = concurrency
        self.burst = burst
        self.grace = grace
        self.poll_interval = poll_interval
        self.beat_interval = beat_interval
        self.flush_timeout = flush_timeout

        self._stopping = threading.Event()
        self._done = threading.Event()
        self._wake = threading.Event()
        self._reports_ready = threading.Event()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[RemoteAttempt | None] = queue.SimpleQueue()
        self._reports: list[RemoteReport] = []  # finished, not yet accepted or refused by the server
        self._in_flight = 0  # held and not yet run to the end
        # Keyed by (task id, lease): a task rescued and held again here is another attempt.
        self._running: dict[tuple[int, Any], RemoteAttempt] = {}  # handler started and not yet returned
        # Every attempt held and not yet settled (queued, running, or its report not yet applied or
        # refused): what each liveness beat lists, so the server can hand back what this worker
        # does not know it holds (a hold whose answer was lost).
        self._held: dict[tuple[int, Any], RemoteAttempt] = {}
        self._overdue: set[tuple[int, Any]] = set()  # running attempts written off past their deadline
        self._last_beat = 0.0
        self._beat_problem = ""
        self._threads: list[threading.Thread] = []
        self._failure: ApiError | None = None
        self.processed = 0  # reports the server applied
        self.refused = 0  # reports the server refused (their attempts were taken away, or applied before)
        self.lost = 0  # reports still unsent when the worker gave up flushing

    # -- public --------------------------------------------------------------------------------

    @property
    def worker_id(self) -> str:
        """The id the server issued at registration ("" before it)."""
        credential = self.client.credential
        return credential[0] if credential else ""

    def run(self) -> None:
        """Work until stopped; then hand back, finish and flush. Raises AccessDenied on a 401/403."""
        logs.remote_worker_banner(self)
        for n in range(self.concurrency):
            self._start(f"taskflow-remote-handler-{n}", self._handler_loop)
        self._reporter = self._start("taskflow-remote-reporter", self._report_loop)
        try:
            self._hold_loop()
        finally:
            self._shutdown()
        log.info(
            "remote worker %s stopped: %d reports applied, %d refused, %d unsent",
            self.worker_id,
            self.processed,
            self.refused,
            self.lost,
        )
        if self._failure is not None:
            raise self._failure

    def request_stop(self) -> None:
        """Stop holding and shut down gracefully (safe to call from a signal handler)."""
        self._stopping.set()
        self._wake.set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def unreported(self) -> int:
        with self._lock:
            return len(self._reports)

    def _start(self, name: str, target: Any) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def _forget_credential(self, exc: AccessDenied) -> None:
        """The server no longer accepts this worker's id and key: the next hold registers again."""
        if self.client.credential is not None and self.client.credential == exc.credential:
            log.warning("the server refused this worker's credential (%s): registering again", _detail(exc.body) or exc)
            self.client.credential = None

    def _fatal(self, exc: ApiError) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc
        if not isinstance(exc, AccessDenied):  # said once, in one line, by whoever runs the worker
            log.error("%s", exc)
        self.request_stop()

    # -- holding -------------------------------------------------------------------------------

    def _hold_loop(self) -> None:
        pause = FIRST_BACKOFF
        while not self._stopping.is_set():
            self._write_off_overdue()
            idle = self.in_flight == 0 and self.unreported == 0
            try:
                held, full = self._hold()
            except Unreachable as exc:
                log.warning("cannot hold tasks: %s; trying again in %.1fs", exc, pause)
                self._stopping.wait(pause)
                pause = min(pause * 2, MAX_BACKOFF)
                continue
            except AccessDenied as exc:
                if not exc.credential_refused:
                    self._fatal(exc)
                    return
                self._forget_credential(exc)
                self._stopping.wait(pause)
                pause = min(pause * 2, MAX_BACKOFF)
                continue
            except ApiError as exc:
                self._fatal(exc)
                return
            pause = FIRST_BACKOFF
            self._maybe_beat()
            if self.burst and idle and not held:
                log.info("nothing is due: a burst worker stops")
                return
            if not full:
                # Woken early when a thread frees up after a full hold, or on a stop; never past a beat.
                next_beat = self._last_beat + self.beat_interval - time.monotonic()
                self._wake.wait(min(self.poll_interval, max(0.05, next_beat)))
            self._wake.clear()

    def _hold(self) -> tuple[int, bool]:
        """Hold as many due tasks as there are free threads; returns (how many, whether that filled them)."""
        in_flight = self.in_flight
        free = self.concurrency - in_flight
        # Finished reports waiting for an unreachable server cap holding, as the local worker's do.
        if self.unreported >= 2 * self.concurrency or free <= 0:
            return 0, False
        # While work runs, wait for a worthwhile batch of free threads instead of many small holds.
        if in_flight and free < max(1, self.concurrency // 4):
            return 0, False
        limit = min(free, MAX_HOLD)
        if self.client.credential is None:
            concurrency = min(self.concurrency, MAX_HOLD)  # as the server counts it
            worker_id = self.client.register(host_name(), os.getpid(), self.task_types, concurrency)
            log.info("registered as remote worker %s", worker_id)
        asked_at = time.monotonic()
        tasks, server_now = self.client.hold(self.task_types, limit)
        for task in tasks:
            attempt = RemoteAttempt.from_json(task, asked_at, server_now)
            with self._lock:
                self._in_flight += 1
                self._held[attempt.fence_key] = attempt
            self._jobs.put(attempt)
        return len(tasks), len(tasks) == limit

    # -- running handlers ------------------------------------------------------------------------

    def _handler_loop(self) -> None:
        while True:
            attempt = self._jobs.get()
            if attempt is None:
                return
            if self._stopping.is_set():
                self._jobs.put(attempt)  # handed back by the shutdown, unstarted
                self._stopping.wait(0.05)
                continue
            with self._lock:
                self._running[attempt.fence_key] = attempt
            try:
                report = self._execute(attempt)
            finally:
                with self._lock:
                    self._running.pop(attempt.fence_key, None)
                    overdue = attempt.fence_key in self._overdue
                    self._overdue.discard(attempt.fence_key)
            if overdue:
                return  # written off when it ran late (its end reported then); another thread took its place
            self._queue_report(report)
            with self._lock:
                self._in_flight -= 1
            self._wake.set()

    def _write_off_overdue(self) -> None:
        """End attempts whose handler ran past its deadline without a heartbeat, and replace their threads.

        What taskwatch does to a local worker's overdue attempt, done here because the liveness beat
        keeps a remote worker's leases alive on the server: the attempt is reported as failed (retried
        or failed by the task's retry policy), its thread no longer counts (a Python thread cannot be
        killed: the handler runs on, and whatever it returns is dropped), and a new thread takes its place.
        """
        now = time.monotonic()
        with self._lock:
            late = [a for a in self._running.values() if a.local_deadline < now and a.fence_key not in self._overdue]
            for attempt in late:
                self._overdue.add(attempt.fence_key)
                self._in_flight -= 1
        for attempt in late:
            log.warning("task %s attempt %d ran past its deadline: reported as failed", attempt.id, attempt.attempt)
            attempt.stop_requested.set()
            error = f"attempt {attempt.attempt} ran past its deadline without a heartbeat"
            self._queue_report(RemoteReport(attempt, failure_item(attempt, error)))
            self._start(f"taskflow-remote-handler-for-{attempt.id}", self._handler_loop)

    def _execute(self, attempt: RemoteAttempt) -> RemoteReport:
        """Run the handler and time it; whatever it does or raises becomes the attempt's report."""
        started = time.perf_counter()
        report = self._run_handler(attempt)
        if report.item is not None:
            report.item["cost_ms"] = int((time.perf_counter() - started) * 1000)
        return report

    def _run_handler(self, attempt: RemoteAttempt) -> RemoteReport:
        ctx = TaskContext(attempt, HttpChannel(self.client, attempt))
        try:
            result = ctx.run(registry.get_handler(attempt.task_type))
            _json_text("result", result)
            item: dict[str, Any] = {**attempt.fence, "status": "success", "result": result}
        except Snooze as signal:
            # A worker's "pending" is a snooze: back after `delay`, the attempt not counted.
            item = {**attempt.fence, "status": "pending", "delay": signal.delay}
            if signal.reason:
                item["error"] = signal.reason
        except PermanentFailure as signal:
            item = failure_item(attempt, signal.reason, retry=False)
        except NextStage as signal:
            item = {**attempt.fence, "stage": signal.stage, "delay": signal.delay}
            if signal.context is not None:
                item["context"] = signal.context
            if signal.priority is not None:
                item["priority"] = signal.priority
        except LeaseLost as exc:
            log.warning("%s", exc)
            return RemoteReport(attempt, None)
        except InvalidTask as exc:
            # A malformed signal or value: another attempt would do the same, so the task fails now.
            item = failure_item(attempt, f"{type(exc).__name__}: {exc}", retry=False, detail=_traceback())
        except BaseException as exc:  # SystemExit too: a handler must not end its thread
            item = failure_item(attempt, f"{type(exc).__name__}: {exc}", detail=_traceback())
        return RemoteReport(attempt, item)

    def _queue_report(self, report: RemoteReport) -> None:
        if report.item is None:
            with self._lock:
                self._held.pop(report.attempt.fence_key, None)
            return
        with self._lock:
            self._reports.append(report)
        self._reports_ready.set()

    # -- reporting -----------------------------------------------------------------------------

    def _report_loop(self) -> None:
        pause = FIRST_BACKOFF
        while True:
            self._reports_ready.wait(timeout=0.5)
            self._reports_ready.clear()
            time.sleep(0.005)  # let a batch gather
            with self._lock:
                pending = list(self._reports)
            if not pending:
                if self._done.is_set():
                    return
                continue
            try:
                self._send_reports(pending)
            except AccessDenied as exc:
                if not exc.credential_refused:
                    self._fatal(exc)
                    return
                # Kept until the hold loop has registered again; then refused as `forbidden`, and settled.
                self._forget_credential(exc)
                if self._done.wait(pause) and self._give_up_flushing():
                    return
                pause = min(pause * 2, MAX_BACKOFF)
                self._reports_ready.set()
                continue
            except Unreachable as exc:
                log.warning(
                    "%d report(s) kept until the server answers: %s; next try in %.1fs", len(pending), exc, pause
                )
                if self._done.wait(pause) and self._give_up_flushing():
                    return
                pause = min(pause * 2, MAX_BACKOFF)
                self._reports_ready.set()
                continue
            except ApiError as exc:
                self._fatal(exc)
                return
            except Exception:
                # A bug must not silence the reporter: the reports stay, and are tried again.
                log.exception("sending %d report(s) failed; trying again in %.1fs", len(pending), pause)
                if self._done.wait(pause) and self._give_up_flushing():
                    return
                pause = min(pause * 2, MAX_BACKOFF)
                self._reports_ready.set()
                continue
            pause = FIRST_BACKOFF

    def _give_up_flushing(self) -> bool:
        return time.monotonic() > self._flush_deadline

    def _send_reports(self, pending: list[RemoteReport]) -> None:
        """Send these reports in bounded batches; each batch's are settled (applied, refused) as it returns."""
        batch: list[RemoteReport] = []
        size = 0
        for report in pending:
            item_size = len(_json_text("report", report.item))
            if batch and (len(batch) >= REPORT_BATCH or size + item_size > REPORT_BATCH_BYTES):
                self._send_batch(batch)
                batch, size = [], 0
            batch.append(report)
            size += item_size
        if batch:
            self._send_batch(batch)

    def _send_batch(self, batch: list[RemoteReport]) -> None:
        for report in batch:
            report.tries += 1
        try:
            results = self.client.batch("tasks/set/", [r.item for r in batch])  # type: ignore[misc]
        except Rejected as exc:
            # The whole request was refused (a body over the server's limit, an item it cannot parse):
            # halve until the report it chokes on is alone, then fail that task with the reason.
            if len(batch) > 1:
                middle = len(batch) // 2
                self._send_batch(batch[:middle])
                self._send_batch(batch[middle:])
                return
            self._refused(batch[0], exc.body if isinstance(exc.body, dict) else {"detail": str(exc)})
            return
        for report, result in zip(batch, results, strict=True):
            if result.get("outcome") == "applied":
                self._settle(report, applied=True)
            else:
                self._refused(report, result)
        self._wake.set()  # holding may have paused while reports piled up

    def _refused(self, report: RemoteReport, result: dict[str, Any]) -> None:
        error = result.get("error") or ""
        item = report.item or {}
        final_failure = item.get("status") == "failed" and item.get("retry") is False
        # `forbidden`: not this worker's attempt (held under an id whose credential was refused since).
        taken_away = error in ("lease_lost", "forbidden")
        if not taken_away and not final_failure:
            # A value the server will not store (a result over its size limit, say): the local
            # worker fails such a task rather than lose its report, and so does this one.
            reason = _detail(result) or error or "refused by the server"
            log.warning("task %s: report refused (%s): failing the task", report.attempt.id, reason)
            replacement = failure_item(report.attempt, f"report refused by the server: {reason}", retry=False)
            with self._lock:
                index = next(i for i, r in enumerate(self._reports) if r is report)
                self._reports[index] = RemoteReport(report.attempt, replacement, report.tries)
            self._reports_ready.set()
            return
        if not taken_away:
            log.error("task %s: its failure report was refused too (%s): dropped", report.attempt.id, _detail(result))
        elif report.tries > 1:
            log.info("task %s: a retried report was refused (lease_lost): applied before, or fenced", report.attempt.id)
        else:
            log.warning("task %s: report refused (%s): the attempt was taken away", report.attempt.id, error)
        self._settle(report, applied=False)

    def _settle(self, report: RemoteReport, *, applied: bool) -> None:
        with self._lock:
            self._reports.remove(report)
            self._held.pop(report.attempt.fence_key, None)
            if applied:
                self.processed += 1
            else:
                self.refused += 1
        logs.remote_attempt_ended(report.attempt, report.item, applied=applied)

    # -- liveness ------------------------------------------------------------------------------

    def _maybe_beat(self) -> None:
        """Beat if one is due. Called only between holds (never while one is in flight), see _held."""
        if time.monotonic() - self._last_beat < self.beat_interval or self.client.credential is None:
            return
        self._last_beat = time.monotonic()
        with self._lock:
            held = list(self._held.values())
        try:
            results, n_back = self.client.beat([a.fence for a in held])
        except AccessDenied as exc:
            if exc.credential_refused:
                self._forget_credential(exc)
            else:
                self._fatal(exc)
            return
        except ApiError as exc:
            if str(exc) != self._beat_problem:  # said once, not at every beat
                log.warning("liveness beat failed: %s", exc)
            self._beat_problem = str(exc)
            return
        self._beat_problem = ""
        if n_back:
            log.warning("the server handed back %d task(s) held for this worker whose hold answer was lost", n_back)
        for attempt, result in zip(held, results, strict=True):
            if result.get("outcome") != "applied":
                attempt.stop_requested.set()

    # -- shutdown ------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        self._stopping.set()
        started = time.monotonic()
        self._release_unstarted()
        while self.in_flight and time.monotonic() - started < self.grace:
            self._write_off_overdue()
            self._release_unstarted()
            self._maybe_beat()
            time.sleep(0.05)
        self._release_unstarted()
        with self._lock:
            unfinished = [a for a in self._running.values() if a.fence_key not in self._overdue]
        if unfinished:
            # Past the grace period: a counted attempt, retried by the policy, as the local worker does.
            log.warning("grace period over: reporting %d unfinished task(s) as interrupted", len(unfinished))
            for attempt in unfinished:
                self._queue_report(
                    RemoteReport(attempt, failure_item(attempt, "interrupted: the worker stopped before it finished"))
                )
        self._flush_deadline = time.monotonic() + self.flush_timeout
        while self.unreported and time.monotonic() < self._flush_deadline and self._reporter.is_alive():
            self._maybe_beat()
            time.sleep(0.05)
        for _ in range(self.concurrency):
            self._jobs.put(None)
        self._done.set()
        self._reports_ready.set()
        self._reporter.join(timeout=5)
        with self._lock:
            self.lost = len(self._reports)
        if self.lost:
            log.error("%d report(s) could not be sent before giving up: taskwatch will rescue their tasks", self.lost)

    _flush_deadline = float("inf")

    def _release_unstarted(self) -> None:
        """Hand back tasks held but not started (their attempt is not counted), retrying through an outage."""
        unstarted: list[RemoteAttempt] = []
        while True:
            try:
                attempt = self._jobs.get_nowait()
            except queue.Empty:
                break
            if attempt is not None:
                unstarted.append(attempt)
        if not unstarted:
            return
        pause = FIRST_BACKOFF
        deadline = time.monotonic() + max(self.grace, 5.0)
        while True:
            try:
                results = self.client.batch("tasks/release/", [a.fence for a in unstarted])
                break
            except Unreachable as exc:
                if time.monotonic() + pause > deadline:
                    log.error("could not hand back %d task(s): %s; taskwatch will rescue them", len(unstarted), exc)
                    results = []
                    break
                time.sleep(pause)
                pause = min(pause * 2, MAX_BACKOFF)
            except ApiError as exc:
                log.error("could not hand back %d task(s): %s", len(unstarted), exc)
                results = []
                break
        released = sum(1 for r in results if r.get("outcome") == "applied")
        log.info("handed back %d unstarted task(s)", released)
        with self._lock:
            self._in_flight -= len(unstarted)
            for attempt in unstarted:
                self._held.pop(attempt.fence_key, None)


def _traceback() -> str:
    import traceback

    return traceback.format_exc(limit=20)

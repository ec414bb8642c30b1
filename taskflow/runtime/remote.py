"""The remote worker: runs registered handlers on a machine with no database, through the HTTP API.

It is the worker runtime (runner.py) over `HttpConnector`: it registers (`POST workers/`: the server
issues its worker id and key, sent with every later call), holds due tasks in batches sized by its
free handler threads (`POST tasks/hold/`), runs each with the same TaskContext as the local worker
(its lease kept by `HttpChannel`), reports finished attempts in batches with their leases and attempt
keys (`POST tasks/set/`), beats its liveness (`POST tasks/heartbeat/` with `beat` and every attempt it
holds: the server answers which were taken away, and hands back any it claimed for this worker whose
hold answer was lost), and hands unstarted tasks back (`POST tasks/release/`).

The server may be unreachable at any time. Holding then waits; finished reports stay in memory and
are sent again with a back-off, never dropped; a report refused as `lease_lost` after such a retry is
final (it was applied before the connection broke, or the attempt was taken away meanwhile). A
handler's heartbeat or checkpoint is retried until its lease would expire, then raises LeaseLost. A
401 or 403 stops the worker (`run` raises AccessDenied), except a refused worker credential (the
server's SECRET_KEY changed): the worker registers again, and the attempts it held under its old id
are refused as `forbidden` and left to taskwatch's rescue.

Nothing here imports the Django ORM or needs Django settings: the server applies every rule
(validation, retry policy, state machine); the signals a handler raises check their own arguments
(taskflow.exceptions) exactly as for the local worker.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from ..engine.outcomes import Outcome, Report, StopRequest
from ..engine.progress import Progress
from ..exceptions import InvalidTask, LeaseLost
from . import logs
from .connector import ChannelFailed, Claim, Settle
from .remote_client import AccessDenied, ApiClient, ApiError, Rejected, Unreachable
from .runner import ASYNC_CONCURRENCY, PREFETCH, PREFETCH_WAIT, Runner
from .supervision import Loop, Step

log = logging.getLogger("taskflow.remote")

MAX_BACKOFF = 30.0  # seconds between a heartbeat's tries while the server is unreachable, at most
FIRST_BACKOFF = 0.5
MAX_HOLD = 1000  # the API's largest hold
REPORT_BATCH = 500  # items per report request
REPORT_BATCH_BYTES = 4 * 1024 * 1024  # well under the server's default MAX_REQUEST_BYTES (8 MiB)
# Seconds of work started ahead of free threads (the local worker's START_AHEAD is 0.05): a start is
# an HTTP round trip, and threads must not run dry while the claim loop waits for a hold or a start.
# A worker that dies loses those attempts as failed ones (they started); reserved ones go back uncounted.
REMOTE_START_AHEAD = 0.2


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
    reserved: bool = False  # claimed ahead, not started: HttpConnector.start starts it as a thread takes it
    stop_requested: StopRequest = field(default_factory=StopRequest, repr=False)

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
            reserved=task.get("reserved") is True,
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



def failure_item(attempt: RemoteAttempt, error: str, *, retry: bool = True, detail: str = "") -> dict[str, Any]:
    item: dict[str, Any] = {**attempt.fence, "status": "failed", "error": error[:4000]}
    if not retry:
        item["retry"] = False
    if detail:
        item["detail"] = detail[-4000:]
    return item


def report_item(report: Report) -> dict[str, Any]:
    """A report as an item of `POST tasks/set/`."""
    attempt: RemoteAttempt = report.task
    outcome = report.outcome
    if outcome == Outcome.SUCCESS:
        item: dict[str, Any] = {**attempt.fence, "status": "success", "result": report.result}
    elif outcome == Outcome.SNOOZE:
        # A worker's "pending" is a snooze: back after `delay`, the attempt not counted.
        item = {**attempt.fence, "status": "pending", "delay": report.delay}
        if report.error:
            item["error"] = report.error
    elif outcome == Outcome.NEXT_STAGE and report.next_stage is not None:
        signal = report.next_stage
        item = {**attempt.fence, "stage": signal.stage, "delay": signal.delay}
        if signal.context is not None:
            item["context"] = signal.context
        if signal.priority is not None:
            item["priority"] = signal.priority
    else:
        item = failure_item(attempt, report.error, retry=outcome != Outcome.FAIL, detail=report.detail)
    if report.cost_ms:
        item["cost_ms"] = report.cost_ms
    return item


class HttpConnector:
    """The worker runtime's way to the HTTP API (see connector.Connector): it holds, reports and beats over HTTP."""

    def __init__(self, client: ApiClient, *, poll_interval: float = 1.0, beat_interval: float = 5.0) -> None:
        self.client = client
        self.poll_interval = poll_interval
        self.beat_interval = beat_interval
        self._worker: Runner | None = None
        self._last_beat = 0.0
        self._beat_problem = ""
        self._halted = False
        self._tries: dict[int, int] = {}  # by id(report): sends so far

    @property
    def worker(self) -> Runner:
        assert self._worker is not None, "the connector is opened by its worker"
        return self._worker

    def describe(self) -> str:
        credential = self.client.credential
        if credential:
            return f"remote worker {credential[0]}"
        return f"remote worker of {logs.redact_url(self.client.root)}"  # no password in a log line

    def banner(self) -> None:
        logs.remote_worker_banner(self.worker)

    # -- threads -------------------------------------------------------------------------------

    def bind(self, worker: Runner) -> None:
        self._worker = worker

    def open(self) -> None:
        """Nothing runs beside the claim loop: it beats between holds."""

    def loop(self, name: str, step: Step, *, on_fatal: Callable[[str], None], stop: threading.Event | None) -> Loop:
        return Loop(name, step, on_fatal=on_fatal, stop=stop, outages=(Unreachable,))

    def stopping(self) -> None:
        """Nothing listens: stops are heard at the next beat."""

    def halt(self) -> None:
        self._halted = True

    def close(self, *, failed: bool) -> None:
        """Nothing to stop: the server forgets a worker that no longer calls."""

    def _forget_credential(self, exc: AccessDenied) -> None:
        """The server no longer accepts this worker's id and key: the next hold registers again."""
        if self.client.credential is not None and self.client.credential == exc.credential:
            log.warning("the server refused this worker's credential (%s): registering again", _detail(exc.body) or exc)
            self.client.credential = None

    def _failed(self, exc: ApiError) -> BaseException:
        """What to raise for an error of a call: an outage to wait out, or ChannelFailed."""
        if isinstance(exc, Unreachable):
            return exc
        if isinstance(exc, AccessDenied) and exc.credential_refused:
            self._forget_credential(exc)
            return Unreachable(f"credential refused: registering again ({_detail(exc.body) or exc})")
        if not isinstance(exc, AccessDenied):  # said once, in one line, by whoever runs the worker
            log.error("%s", exc)
        return ChannelFailed(exc)

    # -- holding -------------------------------------------------------------------------------

    def claim(
        self,
        room: int,
        ahead: int,
        capacity: int,
        busy: bool,
        task_types: list[str] | None = None,
        start_ahead: int = 0,
    ) -> Claim:
        """Hold as many due tasks as there is room for, and `ahead` more: those the worker would start next
        (`start_ahead`) started by the hold, a start being a round trip of its own; the rest reserved."""
        now = time.monotonic()
        # Woken early when a thread frees up, or on a stop; never past a beat.
        next_look = now + min(self.poll_interval, max(0.05, self._last_beat + self.beat_interval - now))
        # While work runs, wait for a worthwhile batch of free threads instead of many small holds.
        if room + ahead <= 0 or (busy and room + ahead < max(1, capacity // 4)):
            return Claim([], next_look)
        limit = min(room + start_ahead, MAX_HOLD)
        reserve = min(ahead - start_ahead, MAX_HOLD - limit)
        worker = self.worker
        try:
            if self.client.credential is None:
                concurrency = min(capacity, MAX_HOLD)  # as the server counts it
                worker_id = self.client.register(host_name(), os.getpid(), worker.task_types, concurrency)
                log.info("registered as remote worker %s", worker_id)
            asked_at = time.monotonic()
            types = worker.task_types if task_types is None else task_types
            tasks, server_now = self.client.hold(types, limit, reserve)
        except ApiError as exc:
            raise self._failed(exc) from None
        attempts = [RemoteAttempt.from_json(task, asked_at, server_now) for task in tasks]
        full = len(attempts) == limit + reserve
        return Claim(attempts, now if full else next_look, [a for a in attempts if a.reserved])

    def start(self, reserved: list[RemoteAttempt]) -> list[RemoteAttempt]:
        """Start reserved attempts (`POST tasks/start/`); those refused were taken away meanwhile."""
        started: list[RemoteAttempt] = []
        try:
            for first in range(0, len(reserved), REPORT_BATCH):
                batch = reserved[first : first + REPORT_BATCH]
                results = self.client.batch("tasks/start/", [a.fence for a in batch])
                started += [a for a, result in zip(batch, results, strict=True) if result.get("outcome") == "applied"]
        except ApiError as exc:
            raise self._failed(exc) from None
        for attempt in started:
            attempt.reserved = False
        return started

    # -- liveness ------------------------------------------------------------------------------

    def between_claims(self, held: list[Any]) -> None:
        """Beat if one is due, listing every attempt held. Only between holds (never while one is in flight):
        the server hands back what a beat does not list, taking it for a hold whose answer was lost."""
        if self._halted or time.monotonic() - self._last_beat < self.beat_interval or self.client.credential is None:
            return
        self._last_beat = time.monotonic()
        try:
            results, n_back = self.client.beat([a.fence for a in held])
        except AccessDenied as exc:
            if exc.credential_refused:
                self._forget_credential(exc)
            elif self._worker is not None:
                self._worker._fail(exc)
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

    # -- running and reporting -----------------------------------------------------------------

    def channel(self, attempt: RemoteAttempt) -> HttpChannel:
        return HttpChannel(self.client, attempt)

    def prepare(self) -> None:
        """Nothing to prepare: the client's sessions recover by themselves."""

    def check_json(self, name: str, value: Any) -> int:
        # Only whether it is JSON: its size and storability are the server's to judge.
        return len(_json_text(name, value))

    def after_error(self, exc: BaseException) -> None:
        """Nothing to do: a handler's error says nothing of the connection."""

    def past_deadline(self, attempt: RemoteAttempt) -> bool:
        return attempt.local_deadline < time.monotonic()

    def overdue(self, attempt: RemoteAttempt) -> Report:
        """What taskwatch does to a local worker's overdue attempt, done here by the worker itself: the
        attempt is reported as failed (retried or failed by the task's retry policy)."""
        error = f"attempt {attempt.attempt} ran past its deadline without a heartbeat"
        return Report(attempt, Outcome.ERROR, error=error)

    def report(self, reports: list[Report], settle: Settle) -> None:
        settle([r for r in reports if r.outcome == Outcome.LOST], [])  # nothing to send
        try:
            handbacks = [r for r in reports if r.outcome == Outcome.HANDBACK]
            for start in range(0, len(handbacks), REPORT_BATCH):
                self._hand_back(handbacks[start : start + REPORT_BATCH], settle)
            self._send_reports([r for r in reports if r.outcome not in (Outcome.LOST, Outcome.HANDBACK)], settle)
        except ApiError as exc:
            failure = self._failed(exc)
            if isinstance(failure, Unreachable):
                log.warning("%d report(s) kept until the server answers: %s", len(reports), exc)
            raise failure from None

    def _hand_back(self, reports: list[Report], settle: Settle) -> None:
        """Hand back tasks held but not started (`POST tasks/release/`): pending again, the attempt not counted."""
        results = self.client.batch("tasks/release/", [r.task.fence for r in reports])
        applied = [r for r, result in zip(reports, results, strict=True) if result.get("outcome") == "applied"]
        log.info("handed back %d unstarted task(s)", len(applied))
        settle(reports, applied)

    def _send_reports(self, pending: list[Report], settle: Settle) -> None:
        """Send these reports in bounded batches; each batch's are settled (applied, refused) as it returns."""
        batch: list[tuple[Report, dict[str, Any]]] = []
        size = 0
        for report in pending:
            item = report_item(report)
            item_size = len(_json_text("report", item))
            if batch and (len(batch) >= REPORT_BATCH or size + item_size > REPORT_BATCH_BYTES):
                self._send_batch(batch, settle)
                batch, size = [], 0
            batch.append((report, item))
            size += item_size
        if batch:
            self._send_batch(batch, settle)

    def _send_batch(self, batch: list[tuple[Report, dict[str, Any]]], settle: Settle) -> None:
        for report, _ in batch:
            self._tries[id(report)] = self._tries.get(id(report), 0) + 1
        try:
            results = self.client.batch("tasks/set/", [item for _, item in batch])
        except Rejected as exc:
            # The whole request was refused (a body over the server's limit, an item it cannot parse):
            # halve until the report it chokes on is alone, then fail that task with the reason.
            if len(batch) > 1:
                middle = len(batch) // 2
                self._send_batch(batch[:middle], settle)
                self._send_batch(batch[middle:], settle)
                return
            self._refused(batch[0][0], exc.body if isinstance(exc.body, dict) else {"detail": str(exc)}, settle)
            return
        applied: list[Report] = []
        for (report, item), result in zip(batch, results, strict=True):
            if result.get("outcome") == "applied":
                applied.append(report)
                logs.remote_attempt_ended(report.task, item, applied=True)
            else:
                self._refused(report, result, settle)
        for report in applied:
            self._tries.pop(id(report), None)
        settle(applied, applied)

    def _refused(self, report: Report, result: dict[str, Any], settle: Settle) -> None:
        error = result.get("error") or ""
        final_failure = report.outcome == Outcome.FAIL
        # `forbidden`: not this worker's attempt (held under an id whose credential was refused since).
        taken_away = error in ("lease_lost", "forbidden")
        if not taken_away and not final_failure:
            # A value the server will not store (a result over its size limit, say): the local
            # worker fails such a task rather than lose its report, and so does this one. The report
            # stays unsettled, a failure now, and is sent again at once.
            reason = _detail(result) or error or "refused by the server"
            log.warning("task %s: report refused (%s): failing the task", report.task.id, reason)
            report.outcome, report.result, report.detail = Outcome.FAIL, None, ""
            report.error = f"report refused by the server: {reason}"
            return
        tries = self._tries.pop(id(report), 0)
        if not taken_away:
            log.error("task %s: its failure report was refused too (%s): dropped", report.task.id, _detail(result))
        elif tries > 1:
            log.info("task %s: a retried report was refused (lease_lost): applied before, or fenced", report.task.id)
        else:
            log.warning("task %s: report refused (%s): the attempt was taken away", report.task.id, error)
        logs.remote_attempt_ended(report.task, None, applied=False)
        settle([report], [])


class RemoteWorker(Runner):
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
        max_stuck: int | None = None,
        prefetch: int = PREFETCH,
        prefetch_wait: float = PREFETCH_WAIT,
        async_concurrency: int = ASYNC_CONCURRENCY,
    ) -> None:
        """`prefetch`: tasks claimed ahead of free threads, at most, reserved as a local worker's are (not
        started: a worker that dies has them handed back uncounted); each waits `prefetch_wait` seconds
        for a thread at most, then goes back to pending."""
        self.client = client
        self.connector: HttpConnector = HttpConnector(client, poll_interval=poll_interval, beat_interval=beat_interval)
        super().__init__(
            self.connector,
            task_types,
            concurrency=concurrency,
            burst=burst,
            grace=grace,
            max_stuck=max_stuck,
            flush_timeout=flush_timeout,
            prefetch=prefetch,
            prefetch_wait=prefetch_wait,
            async_concurrency=async_concurrency,
            start_ahead=REMOTE_START_AHEAD,
        )

    @property
    def worker_id(self) -> str:
        """The id the server issued at registration ("" before it)."""
        credential = self.client.credential
        return credential[0] if credential else ""

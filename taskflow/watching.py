"""Task governance: the duties taskwatch runs under leadership, each a small idempotent function.

Two clocks decide when an attempt is taken away. Worker liveness: a worker whose WorkerProcess row
has not been beaten for LIVENESS_TIMEOUT is dead, and all its attempts are rescued at once, however
long they were allowed to run. The attempt deadline: `lease_expires_at`, extended only by the
handler itself (ctx.heartbeat() or a checkpoint), so a stuck handler on a live worker loses its
task too. A rescue is one guarded UPDATE per task that counts the attempt (retry or fail by the
same rules as any failed attempt), bumps the fencing token, and gives the limiter slot back.

Every duty returns how many tasks (or rows) it changed and logs one line when it changed any.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, close_old_connections, connection, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from . import limiter as limiter_module
from .attempts import Outcome, Report, row_changes
from .claiming import TASK_COLUMNS, ClaimedTask
from .conf import get_settings
from .configs import configs
from .leadership import Leadership
from .limiter import Limiter
from .models import ScheduleCfg, Status, Task, WorkerProcess

log = logging.getLogger("taskflow.watch")

RESCUE_BATCH = 100  # rows per rescue transaction: short row locks, bounded memory
BATCH_PAUSE = 0.05  # seconds between bulk batches, so workers' claims get the table in between

KeepGoing = Callable[[], bool]


def _always() -> bool:
    return True


# What a rescue reads: the attempt as claimed, plus who holds it and since when.
_COLUMNS = (*TASK_COLUMNS, "worker_id", "started_at", "lease_expires_at")


# -- rescuing attempts ----------------------------------------------------------------------------


def rescue_dead_workers(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Take away every attempt of workers whose liveness heartbeat is older than LIVENESS_TIMEOUT."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=get_settings().LIVENESS_TIMEOUT)
    beats = dict(WorkerProcess.objects.values_list("worker_id", "heartbeat_at"))
    dead = sorted(w for w, beat in beats.items() if beat < cutoff)
    # Also attempts of a worker with no row at all (it stopped without reporting them, or its row
    # was removed), once the attempt itself has shown no sign of life for the same timeout.
    lost = Task.objects.filter(status=Status.PROCESSING).filter(
        Q(worker_id__in=dead) | (Q(heartbeat_at__lt=cutoff) & ~Q(worker_id__in=list(beats)))
    )

    def reason(row: dict[str, Any]) -> str:
        return f"worker {row['worker_id']} stopped heartbeating"

    outcomes, workers = _rescue(lost, Q(), reason, now, keep_going)
    total = sum(outcomes.values())
    if total:
        log.info(
            "rescued %d task(s) of %d dead worker(s) (%d requeued, %d failed): %s",
            total,
            len(workers),
            outcomes[Status.PENDING],
            outcomes[Status.FAILED],
            ", ".join(sorted(workers)[:5]) + (" ..." if len(workers) > 5 else ""),
        )
    return total


def rescue_expired_attempts(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Take away attempts past their deadline (`lease_expires_at`) even though their worker lives."""
    now = now or timezone.now()
    expired = Task.objects.filter(status=Status.PROCESSING, lease_expires_at__lt=now)

    def reason(row: dict[str, Any]) -> str:
        return f"attempt {row['attempts']} ran past its deadline without a heartbeat"

    # Guarded on the deadline too: a heartbeat between our read and our UPDATE keeps the task.
    outcomes, _ = _rescue(expired, Q(lease_expires_at__lt=now), reason, now, keep_going)
    total = sum(outcomes.values())
    if total:
        log.info(
            "rescued %d task(s) past their deadline (%d requeued, %d failed)",
            total,
            outcomes[Status.PENDING],
            outcomes[Status.FAILED],
        )
    return total


def _rescue(
    lost: QuerySet[Task], guard: Q, reason: Callable[[dict[str, Any]], str], now: datetime, keep_going: KeepGoing
) -> tuple[Counter[str], set[str]]:
    """Rescue the attempts `lost` selects, in batches; returns new statuses counted, and the workers."""
    outcomes: Counter[str] = Counter()
    workers: set[str] = set()
    while keep_going():
        rows = [dict(zip(_COLUMNS, r, strict=True)) for r in lost.values_list(*_COLUMNS)[:RESCUE_BATCH]]
        if not rows:
            break
        changed = _take_away(rows, guard, reason, now)
        for row, status in changed:
            outcomes[status] += 1
            workers.add(row["worker_id"])
        # Rows whose guard failed were changed by someone else: reading them again cannot loop.
        if len(rows) < RESCUE_BATCH or not changed:
            break
    return outcomes, workers


def _take_away(
    rows: list[dict[str, Any]], guard: Q, reason: Callable[[dict[str, Any]], str], now: datetime
) -> list[tuple[dict[str, Any], str]]:
    """One guarded UPDATE per attempt: counted, retried or failed, with a new fencing token."""
    cfgs = configs.get_many({row["task_type"] for row in rows})
    changed: list[tuple[dict[str, Any], str]] = []
    with transaction.atomic():
        for row in rows:
            cfg = cfgs[row["task_type"]]
            changes = rescue_changes(row, cfg, reason(row), now)
            updated = Task.objects.filter(
                guard, id=row["id"], status=Status.PROCESSING, lease_token=row["lease_token"]
            ).update(lease_token=F("lease_token") + 1, **changes)
            if updated:
                changed.append((row, changes["status"]))
    # Slots go back only after the commit, and only for attempts we actually took away: a report
    # that won the race has given its own slot back.
    released: dict[str, int] = defaultdict(int)
    for row, _ in changed:
        released[row["task_type"]] += 1
    limiter = Limiter()
    for task_type, count in released.items():
        limiter.give_back(task_type, count, cfgs[task_type].concurrency_limit)
    return changed


def rescue_changes(row: dict[str, Any], cfg: ScheduleCfg, reason: str, now: datetime) -> dict[str, Any]:
    """The columns a rescue writes: the attempt (already counted at claim) ends as a failed one."""
    started = row["started_at"] or now
    attempt = ClaimedTask.from_row(
        row,
        cfg,
        attempt=row["attempts"],  # counted when it was claimed
        lease_token=row["lease_token"],
        worker_id=row["worker_id"],
        claimed_at=started,
        lease_expires_at=row["lease_expires_at"] or now,
    )
    cost_ms = max(0, int((now - started).total_seconds() * 1000))
    # The state machine decides: a rescued attempt is a failed one (retry with back-off, or fail).
    return row_changes(Report(attempt, Outcome.RESCUED, error=f"rescued: {reason}", cost_ms=cost_ms), cfg, now)


# -- lifetimes of waiting and finished tasks ------------------------------------------------------


def fail_stale_pending(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Fail pending tasks that stayed due longer than their type's pending_timeout (paused types excepted)."""
    now = now or timezone.now()
    total = 0
    for cfg in ScheduleCfg.objects.filter(pending_timeout__gt=0, paused=False):
        cutoff = now - timedelta(seconds=cfg.pending_timeout)
        stale = Q(task_type=cfg.task_type, status=Status.PENDING, run_after__lt=cutoff)
        count = _in_batches(
            stale,
            lambda ids, stale=stale, cfg=cfg: Task.objects.filter(stale, id__in=ids).update(
                status=Status.FAILED,
                status_msg=f"pending timeout: not started within {cfg.pending_timeout}s of its due time",
                finished_at=now,
                updated_at=now,
            ),
            keep_going,
        )
        if count:
            log.info("failed %d %s task(s) pending past %ds", count, cfg.task_type, cfg.pending_timeout)
        total += count
    return total


def expire_successes(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Turn successes older than their type's success_retention into stopped tasks (0 keeps them)."""
    now = now or timezone.now()
    total = 0
    for cfg in ScheduleCfg.objects.filter(success_retention__gt=0):
        cutoff = now - timedelta(seconds=cfg.success_retention)
        old = Q(status=Status.SUCCESS, finished_at__lt=cutoff, task_type=cfg.task_type)
        count = _in_batches(
            old,
            lambda ids, old=old, cfg=cfg: Task.objects.filter(old, id__in=ids).update(
                status=Status.STOPPED, status_msg=f"success kept {cfg.success_retention}s, then stopped", updated_at=now
            ),
            keep_going,
        )
        if count:
            log.info("stopped %d %s success(es) older than %ds", count, cfg.task_type, cfg.success_retention)
        total += count
    return total


def purge_finished(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Delete failed and stopped tasks older than their type's purge_after_days, PURGE_BATCH rows at a time."""
    now = now or timezone.now()
    total = 0
    for cfg in ScheduleCfg.objects.filter(purge_after_days__gt=0):
        old = Q(
            task_type=cfg.task_type,
            status__in=[Status.FAILED, Status.STOPPED],
            # finished_at, not updated_at: it is indexed with status and never moves once set.
            finished_at__lt=now - timedelta(days=cfg.purge_after_days),
        )
        count = _in_batches(old, lambda ids, old=old: Task.objects.filter(old, id__in=ids).delete()[0], keep_going)
        if count:
            log.info("purged %d %s task(s) finished over %d day(s) ago", count, cfg.task_type, cfg.purge_after_days)
        total += count
    return total


def _in_batches(which: Q, apply: Callable[[list[int]], int], keep_going: KeepGoing) -> int:
    """Apply a bulk change by primary key, PURGE_BATCH rows per statement, pausing in between."""
    batch = max(1, get_settings().PURGE_BATCH)
    total = 0
    while keep_going():
        # Selecting ids first keeps each write a short primary-key statement, and `apply` repeats
        # the condition so a row that changed meanwhile is left alone.
        ids = list(Task.objects.filter(which).values_list("id", flat=True)[:batch])
        if not ids:
            break
        done = apply(ids)
        total += done
        if len(ids) < batch or not done:
            break
        time.sleep(BATCH_PAUSE)
    return total


# -- workers --------------------------------------------------------------------------------------


def reap_dead_worker_rows(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Delete liveness rows of dead workers once none of their attempts remains processing."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=get_settings().LIVENESS_TIMEOUT)
    dead = list(WorkerProcess.objects.filter(heartbeat_at__lt=cutoff).values_list("worker_id", flat=True))
    if not dead or not keep_going():
        return 0
    busy = set(
        Task.objects.filter(status=Status.PROCESSING, worker_id__in=dead).values_list("worker_id", flat=True).distinct()
    )
    idle = [w for w in dead if w not in busy]
    # Guarded on the stale beat: a worker that beats again in between keeps its row.
    count = WorkerProcess.objects.filter(worker_id__in=idle, heartbeat_at__lt=cutoff).delete()[0] if idle else 0
    if count:
        log.info("removed %d dead worker row(s)", count)
    return count


def reconcile_counters() -> int:
    """Correct the limiter's Redis counters to the true processing counts; returns how many it checked.

    The limiter logs the corrections it makes; without Redis there are no counters to correct.
    """
    return len(limiter_module.reconcile_counters())


# -- the watcher ----------------------------------------------------------------------------------

Duty = Callable[[datetime | None, KeepGoing], int]

# Order matters: rescue before reaping worker rows, and dead workers before deadlines so the log
# says the more useful reason.
DUTIES: tuple[tuple[str, Duty], ...] = (
    ("rescue_dead_workers", rescue_dead_workers),
    ("rescue_expired_attempts", rescue_expired_attempts),
    ("fail_stale_pending", fail_stale_pending),
    ("expire_successes", expire_successes),
    ("purge_finished", purge_finished),
    ("reap_dead_worker_rows", reap_dead_worker_rows),
)


class Watcher:
    """Runs the duties every `interval` seconds while this process holds the leader lease."""

    def __init__(
        self,
        *,
        interval: float | None = None,
        leadership: Leadership | None = None,
        duties: Iterable[tuple[str, Duty]] = DUTIES,
    ) -> None:
        settings = get_settings()
        self.interval = settings.WATCH_INTERVAL if interval is None else interval
        if self.interval <= 0:
            raise ValueError("the watch interval must be positive")
        self.leadership = leadership or Leadership()
        self.duties = list(duties)
        self.reconcile_interval = settings.RECONCILE_INTERVAL
        self._next_reconcile = 0.0
        self._stop = threading.Event()

    def request_stop(self) -> None:
        """Finish the current duty and stop (safe to call from a signal handler)."""
        self._stop.set()

    def keep_going(self) -> bool:
        """Whether a duty may go on with its next batch."""
        return self.leadership.active and not self._stop.is_set()

    def run(self) -> None:
        """Pass every `interval` until stopped, renewing the lease in between; resign on the way out."""
        log.info(
            "taskwatch %s started: interval %.1fs, leader ttl %.1fs",
            self.leadership.owner,
            self.interval,
            self.leadership.ttl,
        )
        next_pass = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_pass:
                    self.run_once()
                    next_pass = time.monotonic() + self.interval
                elif self.leadership.leading:
                    # A pass interval longer than the TTL must not let the lease lapse.
                    self.leadership.renew()
                wait = min(next_pass - time.monotonic(), self.leadership.ttl / 3)
                self._stop.wait(max(0.0, wait))
        finally:
            self.leadership.resign()
            close_old_connections()
        log.info("taskwatch %s stopped", self.leadership.owner)

    def run_once(self) -> dict[str, int] | None:
        """One pass of every duty if this process leads (None if it does not); returns the counts."""
        if not self.leadership.renew():
            return None
        started = time.time()
        counts: dict[str, int] = {}
        for name, duty in self.duties:
            if not self.keep_going():
                break
            counts[name] = self._attempt(name, lambda duty=duty: duty(None, self.keep_going))
        if self.keep_going() and time.monotonic() >= self._next_reconcile:
            self._next_reconcile = time.monotonic() + self.reconcile_interval
            counts["reconcile_counters"] = self._attempt("reconcile_counters", reconcile_counters)
        # Parsed by the tests to prove two watchers never act at the same time.
        log.debug("%s acted from %.6f to %.6f", self.leadership.owner, started, time.time())
        return counts

    def _attempt(self, name: str, call: Callable[[], int]) -> int:
        try:
            return call()
        except DatabaseError as exc:
            log.warning("%s failed (%s); trying again next pass", name, exc)
            connection.close()
        except Exception:
            # One broken duty must not stop the others, nor the next pass.
            log.exception("%s failed; trying again next pass", name)
        return 0

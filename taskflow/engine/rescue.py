"""Taking lost attempts away: from workers that stopped heartbeating, and past their deadline.

Two clocks decide when an attempt is lost. Worker liveness: a worker whose WorkerProcess row has
not been beaten for LIVENESS_TIMEOUT is dead, and all its attempts are rescued at once, however
long they were allowed to run. The attempt deadline: `lease_expires_at`, extended only by the
handler itself (ctx.heartbeat() or a checkpoint), so a stuck handler on a live worker loses its
task too. Both are judged by the database's clock, and checked again by the rescue's own UPDATE
(a worker that beat, or a handler that heartbeated, since the rows were read keeps its task).
A rescue ends the attempt as a failed one through `finish_attempts` (retried or failed by the
same rules as any failed attempt), with a new fencing token, and gives its limiter slot back.
An attempt claimed ahead and never started (`started_at` NULL, see claiming.claim_batch) is handed
back instead: pending again at once, in its place, the attempt not counted.
The same two clocks free the slot of an attempt whose task an operator stopped while its handler
ran on (a lingering attempt, limiter.py), if the handler has not returned first.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from ..conf import get_settings
from ..exceptions import AttemptTimedOut, WorkerLost, class_path
from ..models import Status, Task, WorkerProcess
from . import limiter, sql, workers
from .attempts import ClaimedTask, Outcome, Report
from .configs import configs
from .finishing import finish_attempts

log = logging.getLogger("taskflow.watch")

RESCUE_BATCH = 100  # attempts per rescue statement group: short row locks, bounded memory

KeepGoing = Callable[[], bool]


def _always() -> bool:
    return True


# What a rescue reads: the attempt as claimed, plus who holds it and since when.
_COLUMNS = (*sql.CLAIM_COLUMNS, "worker_id", "started_at", "lease_expires_at")


def rescue_dead_workers(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Take away every attempt of workers whose liveness heartbeat is older than LIVENESS_TIMEOUT.

    Ages are judged by the database's clock; `now` only stamps what the rescue writes.
    """
    now = now or timezone.now()
    cutoff = workers.liveness_cutoff()
    rows = WorkerProcess.objects.filter(worker_id=OuterRef("worker_id"))
    # Dead: no beat since the cutoff. Also attempts of a worker with no row at all (it stopped
    # without reporting them, or its row was removed), once the attempt itself has shown no sign
    # of life for the same timeout. The guard checks the same again as each row changes.
    lost = Task.objects.filter(
        ~Exists(rows.filter(heartbeat_at__gte=cutoff)),
        Exists(rows) | Q(heartbeat_at__lt=cutoff),
        status=Status.PROCESSING,
    )
    guard = sql.Guard.worker_silent(sql.task_table(), get_settings().LIVENESS_TIMEOUT)

    def reason(row: dict[str, Any]) -> str:
        return f"worker {row['worker_id']} stopped heartbeating"

    outcomes, dead = _rescue(lost, guard, reason, now, keep_going, WorkerLost)
    total = sum(outcomes.values())
    if total:
        log.info(
            "rescued %d task(s) of %d dead worker(s) (%d requeued, %d failed): %s",
            total,
            len(dead),
            outcomes[Status.PENDING],
            outcomes[Status.FAILED],
            ", ".join(sorted(dead)[:5]) + (" ..." if len(dead) > 5 else ""),
        )
    return total


def rescue_expired_attempts(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Take away attempts past their deadline (`lease_expires_at`, by the database's clock) while their worker lives."""
    now = now or timezone.now()
    expired = Task.objects.filter(status=Status.PROCESSING, lease_expires_at__lt=sql.database_now())

    def reason(row: dict[str, Any]) -> str:
        return f"attempt {row['attempts']} ran past its deadline without a heartbeat"

    # Guarded on the deadline too: a heartbeat between our read and our UPDATE keeps the task.
    outcomes, _ = _rescue(expired, sql.Guard.past_deadline(), reason, now, keep_going, AttemptTimedOut)
    total = sum(outcomes.values())
    if total:
        log.info(
            "rescued %d task(s) past their deadline (%d requeued, %d failed)",
            total,
            outcomes[Status.PENDING],
            outcomes[Status.FAILED],
        )
    return total


def hand_back_unheld(worker_id: str, held: Iterable[tuple[int, int]], *, claimed_before: datetime | None = None) -> int:
    """Hand back attempts the database gives to live worker `worker_id` that it does not hold; returns how many.

    `held` lists every attempt the worker holds, as (task id, lease token). One it does not hold was
    claimed by a claim whose answer never reached it (the connection died as the claim committed):
    no handler of the worker runs it, and it would otherwise wait out its deadline and then count
    as a failed attempt. It goes back to pending in its place, uncounted, started by the claim or
    not. Only attempts claimed before `claimed_before`, if given (a claim may still be answering).
    Each hand-back is guarded by the attempt's token, so an attempt ended meanwhile is left alone.
    """
    held = set(held)
    rows = Task.objects.filter(status=Status.PROCESSING, worker_id=worker_id)
    if claimed_before is not None:
        # A reserved attempt (claimed ahead, not started) has no start time: its claim time is its first heartbeat_at.
        rows = rows.filter(
            Q(started_at__lt=claimed_before) | Q(started_at__isnull=True, heartbeat_at__lt=claimed_before)
        )
    now = timezone.now()
    unheld = [
        dict(zip(_COLUMNS, r, strict=True))
        for r in rows.values_list(*_COLUMNS)
        if (r[0], r[_COLUMNS.index("lease_token")]) not in held
    ]
    if not unheld:
        return 0
    cfgs = configs.get_many({row["task_type"] for row in unheld})
    reports = [Report(ClaimedTask.running(row, cfgs[row["task_type"]], now), Outcome.HANDBACK) for row in unheld]
    return len(finish_attempts(reports, now=now))


def free_lingering_slots(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """Give back the slots of stopped attempts past their deadline or of dead workers; returns how many."""
    ended = limiter.end_lapsed_lingering()
    if ended:
        limiter.Limiter().release(ended)
        log.info("freed the concurrency slots of %d stopped attempt(s) past their deadline or worker", len(ended))
    return len(ended)


def _rescue(
    lost: QuerySet[Task],
    guard: sql.Guard,
    reason: Callable[[dict[str, Any]], str],
    now: datetime,
    keep_going: KeepGoing,
    cause: type[Exception],
) -> tuple[Counter[str], set[str]]:
    """Rescue the attempts `lost` selects, in batches; returns new statuses counted, and the workers."""
    outcomes: Counter[str] = Counter()
    owners: set[str] = set()
    while keep_going():
        rows = [dict(zip(_COLUMNS, r, strict=True)) for r in lost.values_list(*_COLUMNS)[:RESCUE_BATCH]]
        if not rows:
            break
        reports = [rescue_report(row, reason(row), now, cause) for row in rows]
        # A reserved attempt is handed back uncounted only if it is still unstarted when written: its
        # worker may have started it since it was read (a worker silent for a while, not dead).
        # Left alone then, the next pass rescues it as the started attempt it is.
        handbacks = [r for r in reports if r.outcome == Outcome.HANDBACK]
        started = [r for r in reports if r.outcome != Outcome.HANDBACK]
        accepted = finish_attempts(started, guard=guard, now=now)
        accepted += finish_attempts(handbacks, guard=guard.unstarted(), now=now)
        for report in accepted:
            owners.add(report.task.worker_id)
            outcomes[report.written["status"]] += 1  # type: ignore[index]
        # Rows whose guard failed were changed by someone else: reading them again cannot loop.
        if len(rows) < RESCUE_BATCH or not accepted:
            break
    return outcomes, owners


def rescue_report(row: dict[str, Any], reason: str, now: datetime, cause: type[Exception] = AttemptTimedOut) -> Report:
    """The end of a lost attempt as a rescue reports it: a failed attempt (already counted at claim), named `cause`.

    An attempt claimed ahead and never started is handed back: no handler ran, so nothing failed.
    """
    attempt = ClaimedTask.running(row, configs.get(row["task_type"]), now)
    if row["started_at"] is None and row["worker_id"]:
        return Report(attempt, Outcome.HANDBACK)
    started = attempt.claimed_at
    cost_ms = max(0, int((now - started).total_seconds() * 1000))
    return Report(attempt, Outcome.RESCUED, error=f"rescued: {reason}", exception=class_path(cause), cost_ms=cost_ms)

"""Work held by remote workers: claims, reports, heartbeats and hand-backs that arrive over HTTP.

A remote worker has no database: it names the attempt it holds by task id and lease (the fencing
token its claim returned), and every write here is guarded by both, so a late or repeated report
of an attempt that was rescued, stopped or already reported changes nothing. Claims go through
the same limiter and `claim_batch` as the local worker's, reports through `finish_attempts`, and
every call counts as a liveness beat of the worker holding the attempts, so taskwatch treats a
remote worker exactly like a local one.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from ..exceptions import InvalidTask, LeaseLost, NextStage
from ..models import Status, Task
from . import sql, workers
from .attempts import ClaimedTask, Outcome, Report, heartbeat
from .claiming import claim_batch
from .configs import configs
from .finishing import finish_attempts
from .limiter import Limiter
from .transitions import worker_host
from .validation import json_text, validate_task_type

# Like a local worker's id ("host:pid:suffix"): no spaces or control characters, fits the column.
WORKER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@/+-]{0,199}")
MAX_HOLD = 1000  # tasks per hold call
MAX_HOLD_TYPES = 100
# Seconds after its claim before an attempt its worker does not list is taken for a lost hold answer.
HOLD_ANSWER_GRACE = 2.0
# What is read of an attempt a remote worker names: enough to rebuild it as claimed.
_COLUMNS = (*sql.CLAIM_COLUMNS, "status", "worker_id", "started_at", "lease_expires_at")
# Outcomes a remote worker may report (LOST, RESCUED and TERMINATED are decided on the server).
REPORTABLE = (Outcome.SUCCESS, Outcome.ERROR, Outcome.FAIL, Outcome.SNOOZE, Outcome.NEXT_STAGE, Outcome.HANDBACK)


@dataclass(frozen=True)
class Held:
    """An attempt as a remote worker names it: the task, and the lease its claim returned."""

    task_id: int
    lease: int


@dataclass
class RemoteReport:
    """The end of an attempt as a remote worker reports it."""

    held: Held
    outcome: Outcome
    result: Any = None
    error: str = ""
    detail: str = ""
    delay: float = 0.0
    next_stage: NextStage | None = None
    cost_ms: int = 0


def validate_worker_id(worker_id: object) -> str:
    if not isinstance(worker_id, str) or not WORKER_ID_RE.fullmatch(worker_id):
        raise InvalidTask(
            "worker_id must be 1-200 letters, digits or '_.:@/+-', starting with a letter or digit "
            f"(e.g. 'host:pid:suffix'); got {worker_id!r}"
        )
    return worker_id


_limiter: Limiter | None = None
_limiter_lock = threading.Lock()


def _shared_limiter() -> Limiter:
    """One limiter per server process: it keeps confirms Redis has not received yet."""
    global _limiter
    with _limiter_lock:
        if _limiter is None:
            _limiter = Limiter()
        return _limiter


def hold(task_types: Sequence[str], limit: int, worker_id: str) -> list[ClaimedTask]:
    """Claim up to `limit` due tasks of these types for remote worker `worker_id`, as a local worker would.

    Paused types are skipped, concurrency limits hold (the same limiter and claim as `taskworker`),
    each type gives at most its `schedule_limit` per call, and the worker is recorded as alive.
    """
    worker_id = validate_worker_id(worker_id)
    types = list(dict.fromkeys(validate_task_type(t) for t in task_types))
    if not 1 <= len(types) <= MAX_HOLD_TYPES:
        raise InvalidTask(f"task_types must name 1 to {MAX_HOLD_TYPES} task types")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_HOLD:
        raise InvalidTask(f"limit must be an integer from 1 to {MAX_HOLD}; got {limit!r}")
    host = worker_host(worker_id)
    # Before claiming: an attempt whose worker has no liveness row is soon rescued.
    _register(worker_id, types, limit)
    cfgs = configs.get_many(types)
    limiter = _shared_limiter()
    random.shuffle(types)  # no type always goes first when the limit is small
    held: list[ClaimedTask] = []
    for task_type in types:
        cfg = cfgs[task_type]
        wanted = min(limit - len(held), cfg.schedule_limit)
        if wanted <= 0:
            break
        if cfg.paused:
            continue
        grant = limiter.take(task_type, wanted, cfg.concurrency_limit)
        claimed: list[ClaimedTask] = []
        try:
            claimed = claim_batch(
                cfg, grant.slots, worker_id, host=host, exact_limit=limiter.exact_db_limit(cfg.concurrency_limit)
            )
        finally:
            limiter.confirm(grant, claimed)
        held += claimed
    return held


def held_attempts(helds: Iterable[Held], now: datetime | None = None) -> dict[Held, ClaimedTask]:
    """The attempts among `helds` that still hold their task (processing under that lease), in one query."""
    helds = list(helds)
    if not helds:
        return {}
    now = now or timezone.now()
    rows = Task.objects.filter(id__in={h.task_id for h in helds}, status=Status.PROCESSING).values(*_COLUMNS)
    by_id = {row["id"]: row for row in rows}
    cfgs = configs.get_many({row["task_type"] for row in by_id.values()})
    found = {}
    for h in helds:
        row = by_id.get(h.task_id)
        if row is not None and row["lease_token"] == h.lease:
            found[h] = ClaimedTask.running(row, cfgs[row["task_type"]], now)
    return found


def finish(reports: Sequence[RemoteReport]) -> list[bool]:
    """Write these ends of attempts; for each, whether it was applied (False: the lease was lost).

    A report repeated for the same attempt, in this call or a later one, is applied once.
    """
    now = timezone.now()
    attempts = held_attempts((r.held for r in reports), now)
    built: list[Report | None] = []
    for remote in reports:
        if remote.outcome not in REPORTABLE:
            raise InvalidTask(f"a remote worker cannot report {remote.outcome!s}")
        attempt = attempts.get(remote.held)
        built.append(None if attempt is None else _report(attempt, remote))
    _beat({r.task.worker_id for r in built if r is not None})
    accepted = {id(r) for r in finish_attempts([r for r in built if r is not None], now=now)}
    return [r is not None and id(r) in accepted for r in built]


def beat(worker_id: str) -> None:
    """Record that remote worker `worker_id` is alive (a heartbeat that names it, holding tasks or not)."""
    _register(validate_worker_id(worker_id))


def held_deadlines(helds: Sequence[Held]) -> list[datetime | None]:
    """Each attempt's current deadline, or None where the lease was lost: a check that writes nothing.

    A worker's liveness beat lists its attempts this way. It must not extend them: only the
    handler's own heartbeat or checkpoint does, as for a local worker, so a stuck handler still
    times out and is rescued.
    """
    rows = Task.objects.filter(id__in={h.task_id for h in helds}, status=Status.PROCESSING).values_list(
        "id", "lease_token", "lease_expires_at"
    )
    held = {(task_id, token): deadline for task_id, token, deadline in rows}
    return [held.get((h.task_id, h.lease)) for h in helds]


def hand_back_unlisted(worker_id: str, listed: Iterable[Held], *, grace: float = HOLD_ANSWER_GRACE) -> int:
    """Hand back attempts claimed for `worker_id` that it does not list as held; returns how many.

    A worker lists every attempt it holds; one it does not know of was claimed by a hold whose
    answer never reached it, and would otherwise wait out its deadline and be rescued as a failed
    attempt. Only attempts claimed at least `grace` seconds ago are handed back, so a hold still
    answering is left alone; the hand-back is guarded by each attempt's token like any other.
    """
    worker_id = validate_worker_id(worker_id)
    listed = set(listed)
    cutoff = timezone.now() - timedelta(seconds=grace)
    rows = Task.objects.filter(status=Status.PROCESSING, worker_id=worker_id, started_at__lt=cutoff)
    unknown = [Held(i, token) for i, token in rows.values_list("id", "lease_token") if Held(i, token) not in listed]
    return sum(release(unknown)) if unknown else 0


def release(helds: Sequence[Held]) -> list[bool]:
    """Hand claimed-but-unstarted attempts back: pending again as they were, the attempt not counted."""
    return finish([RemoteReport(h, Outcome.HANDBACK) for h in helds])


def extend(items: Sequence[tuple[Held, Any]]) -> list[datetime | None]:
    """Extend each attempt's deadline by its timeout, saving its checkpoint if one is given (not `...`).

    Returns each attempt's new deadline, or None where the lease was lost. A checkpoint no database
    could store raises InvalidTask before anything is written.
    """
    for _, checkpoint in items:
        if checkpoint is not ...:
            json_text("checkpoint", checkpoint)
    now = timezone.now()
    attempts = held_attempts((h for h, _ in items), now)
    _beat({a.worker_id for a in attempts.values()})
    deadlines: list[datetime | None] = []
    with transaction.atomic():
        for held, checkpoint in items:
            attempt = attempts.get(held)
            try:
                deadlines.append(None if attempt is None else heartbeat(attempt, checkpoint=checkpoint, now=now))
            except LeaseLost:
                deadlines.append(None)
    return deadlines


def _report(attempt: ClaimedTask, remote: RemoteReport) -> Report:
    return Report(
        attempt,
        remote.outcome,
        result=remote.result,
        error=remote.error,
        detail=remote.detail,
        delay=remote.delay,
        next_stage=remote.next_stage,
        cost_ms=remote.cost_ms,
    )


def _beat(worker_ids: set[str]) -> None:
    for worker_id in sorted(worker_ids):
        _register(worker_id)


def _register(worker_id: str, task_types: list[str] | None = None, concurrency: int = 0) -> None:
    """A liveness beat of a remote worker, which has no pid here; registered on its first call."""
    beat = (worker_id, worker_host(worker_id) or "remote", task_types or [], concurrency)
    try:
        with transaction.atomic():
            workers.beat(*beat, pid=0)
    except IntegrityError:  # two of its requests registered it at once: the other one did
        workers.beat(*beat, pid=0)

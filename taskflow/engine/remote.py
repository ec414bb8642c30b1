"""Work held by remote workers: claims, reports, heartbeats and hand-backs that arrive over HTTP.

A remote worker has no database: it names the attempt it holds by task id and lease (the fencing
token its claim returned), and every write here is guarded by both, so a late or repeated report
of an attempt that was rescued, stopped or already reported changes nothing. Claims go through
the same limiter and `claim_batch` as the local worker's, reports through `finish_attempts`, and
every call counts as a liveness beat of the calling worker, so taskwatch treats a remote worker
exactly like a local one (each server process writes one beat a second of a worker at most).

Trust: the caller's worker id is one this server issued to its user (`register`), proven by its
`worker_key`; each attempt is proven by its `attempt_key`, given in the hold answer to its holder
alone. Both are HMACs under SECRET_KEY, so nothing is stored. Every function below takes the
authenticated worker's id and touches only attempts claimed for it whose key is presented.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import random
import re
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.crypto import constant_time_compare

from ..conf import get_settings
from ..exceptions import InvalidTask, LeaseLost, NextStage
from . import sql, workers
from .attempts import ClaimedTask, Outcome, Report, heartbeat
from .claiming import claim_batch, claim_within_limit, start_held
from .configs import configs
from .finishing import finish_attempts, handlers_returned
from .limiter import Limiter
from .progress import Progress
from .rescue import hand_back_unheld
from .transitions import worker_host
from .validation import json_text, validate_task_type

# Like a local worker's id ("host:pid:suffix"): no spaces or control characters, fits the column.
WORKER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@/+-]{0,199}")
MAX_HOLD = 1000  # tasks per hold call
MAX_HOLD_TYPES = 100
# Seconds after its claim before an attempt its worker does not list is taken for a lost hold answer.
HOLD_ANSWER_GRACE = 2.0
# What is read of an attempt a remote worker names: enough to end it, extend it or tell its deadline.
# Not the handler's data: none of those reads it, and a payload may be a megabyte of JSON to decode.
_HANDLER_DATA = ("payload", "context", "checkpoint")
_COLUMNS = (
    *(c for c in sql.CLAIM_COLUMNS if c not in _HANDLER_DATA),
    "status",
    "worker_id",
    "started_at",
    "lease_expires_at",
)
# Outcomes a remote worker may report (LOST, RESCUED and TERMINATED are decided on the server).
REPORTABLE = (Outcome.SUCCESS, Outcome.ERROR, Outcome.FAIL, Outcome.SNOOZE, Outcome.NEXT_STAGE, Outcome.HANDBACK)


WORKER_KEY_SALT = "taskflow.remote.worker"
ATTEMPT_KEY_SALT = "taskflow.remote.attempt"
MAX_HOST = 100  # of the worker id's host part, so that "host:pid:hex" fits the column


class WorkerRefused(Exception):
    """The caller did not prove the worker id it presented: the id was issued to another user, or never."""


class Refused(StrEnum):
    """Why one attempt named by a remote worker was left alone."""

    LEASE_LOST = "lease_lost"  # the worker held it, but it was taken away (rescued, stopped, reported)
    FORBIDDEN = "forbidden"  # the attempt key is not the one its holder was given: not this worker's


@dataclass(frozen=True)
class Held:
    """An attempt as a remote worker names it: the task, the lease its claim returned, and its attempt key."""

    task_id: int
    lease: int
    key: str = field(default="", compare=False)  # its holder's proof; not part of what the attempt is


def _hmac(salt: str, value: str) -> str:
    """salted_hmac(salt, value, algorithm="sha256").hexdigest(), its key derived once per salt and SECRET_KEY."""
    mac = _keyed_hmac(salt, settings.SECRET_KEY).copy()
    mac.update(value.encode())
    return mac.hexdigest()


@lru_cache(maxsize=16)
def _keyed_hmac(salt: str, secret: str) -> hmac.HMAC:
    # As salted_hmac derives its key; deriving it again for every attempt key was 3/4 of the cost.
    return hmac.new(hashlib.sha256((salt + secret).encode()).digest(), digestmod=hashlib.sha256)


def worker_key(user_pk: object, worker_id: str) -> str:
    """The secret proving that `worker_id` was issued to user `user_pk` (keyed by SECRET_KEY: nothing is stored)."""
    return _hmac(WORKER_KEY_SALT, f"{user_pk}:{worker_id}")


def attempt_key(task_id: int, lease: int, worker_id: str) -> str:
    """The secret given to the holder of one attempt alone (256 bits): every report of it must present it."""
    return _hmac(ATTEMPT_KEY_SALT, f"{task_id}:{lease}:{worker_id}")


def register(user_pk: object, host: str, pid: int, task_types: Sequence[str], concurrency: int) -> tuple[str, str]:
    """Issue a new remote worker id ("host:pid:random") to user `user_pk`; returns it and its worker key.

    The worker is recorded as alive. Its id is the server's choice, so no caller can take over
    another worker's id (a local worker's, or another user's remote one).
    """
    if not isinstance(host, str) or not 1 <= len(host) <= MAX_HOST or not WORKER_ID_RE.fullmatch(host) or ":" in host:
        raise InvalidTask(f"host must be 1-{MAX_HOST} letters, digits or '_.@/+-' without ':'; got {host!r:.120}")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid <= 2**31 - 1:
        raise InvalidTask(f"pid must be an integer from 0 to 2147483647; got {pid!r}")
    types = _hold_types(task_types)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_HOLD:
        raise InvalidTask(f"concurrency must be an integer from 1 to {MAX_HOLD}; got {concurrency!r}")
    worker_id = f"{host}:{pid}:{secrets.token_hex(8)}"
    _register(worker_id, types, concurrency)
    return worker_id, worker_key(user_pk, worker_id)


def authenticate(user_pk: object, worker_id: object, key: object) -> str:
    """The worker id if `key` proves it was issued to user `user_pk`; raises WorkerRefused otherwise."""
    if not isinstance(worker_id, str) or not isinstance(key, str) or not WORKER_ID_RE.fullmatch(worker_id):
        raise WorkerRefused("a remote worker presents the worker id and key its registration returned")
    if not constant_time_compare(key, worker_key(user_pk, worker_id)):
        raise WorkerRefused(f"worker {worker_id!r:.210} was not issued to this user, or its key is wrong")
    return worker_id


def _hold_types(task_types: Sequence[str]) -> list[str]:
    types = list(dict.fromkeys(validate_task_type(t) for t in task_types))
    if not 1 <= len(types) <= MAX_HOLD_TYPES:
        raise InvalidTask(f"task_types must name 1 to {MAX_HOLD_TYPES} task types")
    return types


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


def hold(task_types: Sequence[str], limit: int, worker_id: str, *, reserve: int = 0) -> list[ClaimedTask]:
    """Claim up to `limit` due tasks of these types for remote worker `worker_id`, as a local worker would,
    and up to `reserve` more claimed ahead (reserved: their rows' `started_at` stays NULL).

    `worker_id` is the authenticated caller's. Paused types are skipped, and so are types without
    a ScheduleCfg row (never enqueued: nothing is due, and none is created for them); concurrency
    limits hold (the same limiter and claim as `taskworker`), each type gives at most its
    `schedule_limit` per call, and the worker is recorded as alive. Each attempt's key is
    `attempt_key(task.id, task.lease_token, worker_id)`; each carries the row's other fields the API
    shows (`shown`, read by the claim itself).

    Reserved attempts are claimed as a local worker claims ahead (claiming.claim_batch): held but not
    started until the worker starts them (`start`), handed back uncounted if it dies first. Tasks of
    a limited type are never reserved: a reserved task would hold a slot no handler uses.
    """
    worker_id = validate_worker_id(worker_id)
    types = _hold_types(task_types)
    for name, value, least in (("limit", limit, 0), ("reserve", reserve, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_HOLD:
            raise InvalidTask(f"{name} must be an integer from {least} to {MAX_HOLD}; got {value!r}")
    if not 1 <= limit + reserve <= MAX_HOLD:
        raise InvalidTask(f"limit and reserve must add up to 1 to {MAX_HOLD}; got {limit} + {reserve}")
    host = worker_host(worker_id)
    # Before claiming: an attempt whose worker has no liveness row is soon rescued.
    _register(worker_id, types, limit + reserve)
    cfgs = configs.get_many(types, create=False)
    limiter = _shared_limiter()
    limits_all = get_settings().GLOBAL_CONCURRENCY_LIMIT > 0
    types = [t for t in types if t in cfgs]
    random.shuffle(types)  # no type always goes first when the limit is small
    held: list[ClaimedTask] = []
    reserved = 0
    for task_type in types:
        cfg = cfgs[task_type]
        if cfg.paused:
            continue
        free = max(0, limit - (len(held) - reserved))
        if limits_all or cfg.concurrency_limit > 0:
            wanted = min(free, cfg.schedule_limit)
            if wanted <= 0:
                continue
            claimed = claim_within_limit(cfg, wanted, worker_id, limiter, host=host, shown=True)
        else:
            wanted = min(free + max(0, reserve - reserved), cfg.schedule_limit)
            if wanted <= 0:
                continue
            to_start = min(free, wanted)
            claimed = claim_batch(cfg, to_start, worker_id, host=host, reserve=wanted - to_start, shown=True)
            reserved += max(0, len(claimed) - to_start)
        held += claimed
    return held


def start(worker_id: str, helds: Sequence[Held]) -> list[Refused | None]:
    """Start these reserved attempts of `worker_id` (see `hold`); for each, None if it is held and now started,
    or why not.

    The same guarded UPDATE as a local worker's start (claiming.start_reserved), also guarded by the
    worker: an attempt is started only for the worker that holds it, and only if the caller proves
    it with its key. One already started is answered as held (a retry whose first answer was lost).
    """
    proven = [proves(h, worker_id) for h in helds]
    mine = [(h.task_id, h.lease) for h, ok in zip(helds, proven, strict=True) if ok]
    started = start_held(worker_id, mine) if mine else set()
    _register(worker_id)
    return [
        Refused.FORBIDDEN if not ok else (None if (h.task_id, h.lease) in started else Refused.LEASE_LOST)
        for h, ok in zip(helds, proven, strict=True)
    ]


def proves(held: Held, worker_id: str) -> bool:
    """Whether `held` carries the key given to `worker_id` for that attempt."""
    return constant_time_compare(held.key, attempt_key(held.task_id, held.lease, worker_id))


def _sorted_out(worker_id: str, helds: Sequence[Held], now: datetime) -> list[ClaimedTask | Refused]:
    """Each named attempt as still held by `worker_id` (rebuilt as claimed, without the handler's
    payload, context and checkpoint), or why it is not, in one query.

    FORBIDDEN: its key is not the one given to `worker_id` for it (so it is not this worker's to
    name, whatever the row says). LEASE_LOST: the key is right, but the task is no longer
    processing under that lease for this worker.
    """
    proven = [proves(h, worker_id) for h in helds]
    wanted = {h.task_id for h, ok in zip(helds, proven, strict=True) if ok}
    by_id = {}
    if wanted:
        by_id = {row["id"]: row for row in sql.select_held(sql.task_table(), list(wanted), worker_id, _COLUMNS)}
    cfgs = configs.get_many({row["task_type"] for row in by_id.values()}) if by_id else {}
    sorted_out: list[ClaimedTask | Refused] = []
    for h, ok in zip(helds, proven, strict=True):
        row = by_id.get(h.task_id)
        if not ok:
            sorted_out.append(Refused.FORBIDDEN)
        elif row is None or row["lease_token"] != h.lease:
            sorted_out.append(Refused.LEASE_LOST)
        else:
            sorted_out.append(ClaimedTask.running({**row, **_NO_DATA}, cfgs[row["task_type"]], now))
    return sorted_out


_NO_DATA = dict.fromkeys(_HANDLER_DATA)


def finish(worker_id: str, reports: Sequence[RemoteReport]) -> list[Refused | None]:
    """Write these ends of attempts held by `worker_id`; for each, None if applied, or why it was refused.

    A report repeated for the same attempt, in this call or a later one, is applied once.
    """
    for remote in reports:
        if remote.outcome not in REPORTABLE:
            raise InvalidTask(f"a remote worker cannot report {remote.outcome!s}")
    if not reports:
        _register(worker_id)  # still a call of the worker's: a beat
        return []
    now = timezone.now()
    attempts = _sorted_out(worker_id, [r.held for r in reports], now)
    _register(worker_id)
    built = [a if isinstance(a, Refused) else _report(a, r) for a, r in zip(attempts, reports, strict=True)]
    accepted = {id(r) for r in finish_attempts([r for r in built if isinstance(r, Report)], now=now)}
    # An attempt its proven holder reports after it was taken away: if an operator stopped it while
    # it ran, its limit slot was kept for the handler, which has now returned (limiter.py).
    returned = [r.held for r, a in zip(reports, built, strict=True) if a is Refused.LEASE_LOST]
    handlers_returned([(h.task_id, h.lease) for h in returned])
    return [r if isinstance(r, Refused) else (None if id(r) in accepted else Refused.LEASE_LOST) for r in built]


def beat(worker_id: str) -> None:
    """Record that remote worker `worker_id` (the authenticated caller) is alive: its own beat, always written."""
    _register(validate_worker_id(worker_id), always=True)


def held_deadlines(worker_id: str, helds: Sequence[Held]) -> list[datetime | Refused]:
    """Each attempt's current deadline, or why `worker_id` does not hold it: a check that writes nothing.

    A worker's liveness beat lists its attempts this way. It must not extend them: only the
    handler's own heartbeat or checkpoint does, as for a local worker, so a stuck handler still
    times out and is rescued.
    """
    attempts = _sorted_out(worker_id, helds, timezone.now())
    return [a if isinstance(a, Refused) else a.lease_expires_at for a in attempts]


def hand_back_unlisted(worker_id: str, listed: Iterable[Held], *, grace: float = HOLD_ANSWER_GRACE) -> int:
    """Hand back attempts claimed for `worker_id` that it does not list as held; returns how many.

    A worker lists every attempt it holds; one it does not know of was claimed by a hold whose
    answer never reached it, and would otherwise wait out its deadline and be rescued as a failed
    attempt. Only attempts claimed at least `grace` seconds ago are handed back, so a hold still
    answering is left alone; the hand-back is guarded by each attempt's token like any other.
    `worker_id` is the authenticated caller's: no other worker's attempt is ever touched.
    """
    worker_id = validate_worker_id(worker_id)
    held = {(h.task_id, h.lease) for h in listed if proves(h, worker_id)}
    return hand_back_unheld(worker_id, held, claimed_before=timezone.now() - timedelta(seconds=grace))


def release(worker_id: str, helds: Sequence[Held]) -> list[Refused | None]:
    """Hand claimed-but-unstarted attempts back: pending again as they were, the attempt not counted."""
    return finish(worker_id, [RemoteReport(h, Outcome.HANDBACK) for h in helds])


def extend(
    worker_id: str, items: Sequence[tuple[Held, Any]], progress: Sequence[Progress | None] = ()
) -> list[datetime | Refused]:
    """Extend each attempt's deadline by its timeout, saving its checkpoint if one is given (not `...`).

    `progress`, if given, holds each item's progress (or None), saved in the same guarded UPDATE.
    Returns each attempt's new deadline, or why `worker_id` does not hold it. A checkpoint no
    database could store raises InvalidTask before anything is written.
    """
    for _, checkpoint in items:
        if checkpoint is not ...:
            json_text("checkpoint", checkpoint)
    if not items:
        _register(worker_id)  # still a call of the worker's: a beat
        return []
    progress = list(progress) or [None] * len(items)
    now = timezone.now()
    attempts = _sorted_out(worker_id, [h for h, _ in items], now)
    _register(worker_id)
    deadlines: list[datetime | Refused] = []
    with transaction.atomic():
        for (_, checkpoint), shown, attempt in zip(items, progress, attempts, strict=True):
            if isinstance(attempt, Refused):
                deadlines.append(attempt)
                continue
            try:
                deadlines.append(heartbeat(attempt, checkpoint=checkpoint, progress=shown, now=now))
            except LeaseLost:
                deadlines.append(Refused.LEASE_LOST)
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


def _register(
    worker_id: str, task_types: list[str] | None = None, concurrency: int = 0, *, always: bool = False
) -> None:
    """A liveness beat of a remote worker, which has no pid here; registered on its first call.

    Every call of the worker is a beat, but each server process writes at most one per
    `_beat_every()` seconds for it (a beat is a committed write, and a busy worker calls many
    times a second), except the worker's own liveness beat (`always`), every few seconds.
    """
    now = time.monotonic()
    with _beats_lock:
        if not always and now - _beats.get(worker_id, -math.inf) < _beat_every():
            return
        _beats[worker_id] = now
        if len(_beats) > MAX_BEATS_KEPT:
            for stale in [w for w, at in _beats.items() if now - at >= _beat_every()]:
                del _beats[stale]
    try:
        _write_beat(worker_id, task_types, concurrency)
    except BaseException:
        with _beats_lock:  # not written: the next call tries again
            if _beats.get(worker_id) == now:
                del _beats[worker_id]
        raise


def _write_beat(worker_id: str, task_types: list[str] | None, concurrency: int) -> None:
    # The usual case, a registered worker, is one UPDATE and no transaction.
    if workers.touch(worker_id):
        return
    beat = (worker_id, worker_host(worker_id) or "remote", task_types or [], concurrency)
    try:
        with transaction.atomic():
            workers.beat(*beat, pid=0)
    except IntegrityError:  # two of its requests registered it at once: the other one did
        workers.beat(*beat, pid=0)


# When this process last wrote each remote worker's beat (time.monotonic()).
_beats: dict[str, float] = {}
_beats_lock = threading.Lock()
MAX_BEATS_KEPT = 10_000


def _beat_every() -> float:
    """Seconds between two beats of one worker written by one server process: a small part of LIVENESS_TIMEOUT."""
    return min(1.0, get_settings().LIVENESS_TIMEOUT / 10)


def forget_beats() -> None:
    """Write the next call's beat of every worker (for tests that age a worker's beat in the database)."""
    with _beats_lock:
        _beats.clear()

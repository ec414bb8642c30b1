"""Concurrency limits per task type and globally: slots held by attempts in Redis, or an exact count in the database.

With Redis, every limited type (and the global limit) has a sorted set of the slots held now, each
named for its holder, so counting never guesses:
- a claim first takes a *reservation* (one Lua script checks the type's and the global bound
  together and adds that many reservation members, which expire after RESERVATION_TTL on Redis's
  own clock); after the claim's transaction commits, `confirm` swaps the reservation for one member
  per claimed attempt, `<task id>:<lease_token>`, which gives back what was not claimed;
- `release` removes an attempt's member once its final database update was accepted. Removing a
  named member twice changes nothing, so a slot is given back at most once per attempt, whoever
  ends it (the worker's report, a rescue, an operator);
- `reconcile_counters()` (taskwatch, every RECONCILE_INTERVAL) compares the attempts held with the
  processing rows: it frees exactly the attempts read before the database that are no longer
  processing under that token, adds processing attempts Redis does not hold (it restarted, a
  confirm was lost), and drops expired reservations. Claims and reports in flight are never taken
  for drift: a reservation is not an attempt, and an attempt joins the set only after its claim
  committed.
A missing set (Redis restarted or evicted it) is first rebuilt from the processing rows, so a
restart never forgets running tasks.

Without Redis, `exact_room()` runs inside the claim's transaction: it locks the type's ScheduleCfg
row (or, with a global limit, one gate row shared by every claim) and counts processing rows, so
concurrent claimers can never together exceed a limit.

A limit holds at every moment, also when an operator stops a task whose handler still runs
(a thread cannot be killed; a remote handler finishes its step): such an attempt *lingers*. It
keeps its slot until its handler returns (its report, refused, ends it) or its attempt's deadline
passes (taskwatch frees it; a dead worker's too), whichever is first. A lingering attempt is a
`Lock` row named for it (`keep_lingering`), written in the transaction that stops its task; exact
counts add these rows, Redis keeps the attempt's member until they go, and rebuilds and
`reconcile_counters` read them as they read processing rows.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from django.db import transaction
from django.db.models import Q

from ..conf import get_settings
from ..models import Lock, ScheduleCfg, Status, Task, WorkerProcess
from . import sql, workers
from .configs import configs
from .redis import RedisError, get_redis, key

log = logging.getLogger("taskflow.limiter")

# The name reconcile_counters() reports the global slots under; no task type starts with '*'.
GLOBAL = "*"
# The database row every claim locks while a global limit is enforced without Redis.
GATE = "taskflow:concurrency-gate"
_GATE_EXPIRES = datetime(9999, 12, 31, tzinfo=UTC)  # never expires, so no lease logic takes it over

# Seconds a reservation holds its slots if its claim never confirms (the worker died between
# taking the slots and committing its claim). A claim's transaction takes milliseconds; one that
# outlives this may run over the limit until its tasks end (logged by confirm).
RESERVATION_TTL = 60.0

# Every slot set holds this member (scored +inf, never counted) so that an empty set still exists:
# a missing set means Redis forgot it, and it must be rebuilt from the database before use.
_PRESENT = "#"

# Members: attempts `<id>:<token>` and the sentinel score +inf; reservations `r...:<n>` score the
# Redis time (ms) they expire at.
_NOW = """
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS = slot sets; ARGV[1] = wanted, ARGV[2] = reservation id, ARGV[3] = its lifetime (ms),
# ARGV[3+i] = the limit of set i. Reserves the same n (0..wanted) in every set; -1 when a set is
# missing and must be rebuilt from the database first.
_TAKE = (
    _NOW
    + """
local n = tonumber(ARGV[1])
for i = 1, #KEYS do
  if redis.call('exists', KEYS[i]) == 0 then return -1 end
  redis.call('zremrangebyscore', KEYS[i], '-inf', now)
  n = math.min(n, tonumber(ARGV[3 + i]) - (redis.call('zcard', KEYS[i]) - 1))
end
if n <= 0 then return 0 end
local members = {}
for j = 1, n do
  members[2 * j - 1] = now + tonumber(ARGV[3])
  members[2 * j] = ARGV[2] .. ':' .. j
end
for i = 1, #KEYS do redis.call('zadd', KEYS[i], unpack(members)) end
return n
"""
)
# KEYS = slot sets; ARGV[1] = reservation id, ARGV[2] = its size, ARGV[3..] = the attempts claimed
# with it. Returns how many sets still held the whole reservation. A missing set is left alone:
# rebuilt from the database, it will hold these attempts (their claim has committed).
_CONFIRM = """
local size = tonumber(ARGV[2])
local intact = 0
for i = 1, #KEYS do
  if redis.call('exists', KEYS[i]) == 1 then
    local removed = 0
    for j = 1, size do removed = removed + redis.call('zrem', KEYS[i], ARGV[1] .. ':' .. j) end
    if removed == size then intact = intact + 1 end
    for j = 3, #ARGV do redis.call('zadd', KEYS[i], '+inf', ARGV[j]) end
  end
end
return intact
"""
# KEYS = slot sets; ARGV[i] = how many of the members that follow belong to set i. Removing a
# member that is not there (given back already, or never counted) changes nothing.
_RELEASE = """
local at = #KEYS + 1
for i = 1, #KEYS do
  local last = at + tonumber(ARGV[i]) - 1
  for j = at, last do redis.call('zrem', KEYS[i], ARGV[j]) end
  at = last + 1
end
return 0
"""
# KEYS = slot sets; ARGV[i] = how many attempts of those that follow belong to set i. Creates only
# missing sets, from the processing attempts read from the database.
_REBUILD = """
local at = #KEYS + 1
for i = 1, #KEYS do
  local last = at + tonumber(ARGV[i]) - 1
  if redis.call('exists', KEYS[i]) == 0 then
    redis.call('zadd', KEYS[i], '+inf', '#')
    for j = at, last do redis.call('zadd', KEYS[i], '+inf', ARGV[j]) end
  end
  at = last + 1
end
return 0
"""
# KEYS = slot sets; ARGV[3i-2] = 1 if set i existed at the first read, ARGV[3i-1] = how many
# attempts to free, ARGV[3i] = how many to add, then those members set by set. A set that vanished
# since the first read is left for the next take to rebuild. Returns the slots now held (-1: none).
_CORRECT = (
    _NOW
    + """
local at = 3 * #KEYS + 1
local held = {}
for i = 1, #KEYS do
  local free, add = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  local exists = redis.call('exists', KEYS[i]) == 1
  if not exists and ARGV[3 * i - 2] == '0' then
    redis.call('zadd', KEYS[i], '+inf', '#')
    exists = true
  end
  if exists then
    for j = at, at + free - 1 do redis.call('zrem', KEYS[i], ARGV[j]) end
    for j = at + free, at + free + add - 1 do redis.call('zadd', KEYS[i], '+inf', ARGV[j]) end
    redis.call('zremrangebyscore', KEYS[i], '-inf', now)
    held[i] = redis.call('zcard', KEYS[i]) - 1
  else
    held[i] = -1
  end
  at = at + free + add
end
return held
"""
)
# KEYS[1] = a slot set. The slots held now (attempts and live reservations), -1 if it is missing.
_HELD = (
    _NOW
    + """
if redis.call('exists', KEYS[1]) == 0 then return -1 end
return redis.call('zcount', KEYS[1], '(' .. now, '+inf') - 1
"""
)


def slots_key(name: str) -> str:
    """The Redis key of the slots held by tasks of type `name` (GLOBAL: by all tasks)."""
    return key("slots-all") if name == GLOBAL else key("slots", name)


class Attempt(Protocol):
    """What identifies the holder of a slot: one attempt of one task (ClaimedTask has these)."""

    task_type: str
    id: int
    lease_token: int


def holder(attempt: Attempt) -> str:
    """The member naming `attempt` in a slot set."""
    return f"{attempt.id}:{attempt.lease_token}"


@dataclass(frozen=True)
class Grant:
    """Slots granted to one claim: `slots` tasks may be claimed; pass it to `Limiter.confirm` afterwards."""

    task_type: str
    slots: int
    reservation: str = ""  # the reservation holding them in Redis ("" when nothing is held)
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Counter:
    name: str  # a task type, or GLOBAL
    limit: int


class Limiter:
    """Decides how many tasks of a type a worker may claim now, and takes the slots back afterwards."""

    def __init__(self, client: Any | None = ...) -> None:
        self._client = get_redis() if client is ... else client
        self._failures = 0
        # After a failure Redis is left alone for a while: with the client's own retries each
        # call to a dead server can block for seconds, and the claim loop serves every type.
        self._retry_at = 0.0
        self._reservation_prefix = f"r{secrets.token_hex(4)}."
        self._reservation_numbers = itertools.count()  # next() on it is atomic: takes may come from threads
        # Confirms Redis did not receive, sent again before the next take: until then their
        # reservations hold the slots, and they must not expire with the attempts uncounted.
        self._unconfirmed: deque[tuple[Grant, list[str]]] = deque()
        self._lock = threading.Lock()

    @property
    def uses_redis(self) -> bool:
        return self._client is not None

    def take(self, task_type: str, wanted: int, limit: int) -> Grant:
        """Slots for a claim of up to `wanted` tasks (all of them when no limit applies); confirm them after the claim.

        Without Redis the limits are enforced inside the claim itself (see exact_room). If Redis is
        unreachable, a limited type claims nothing until it returns: waiting is safe, running over
        the limit is not.
        """
        counters = _counters(task_type, limit)
        if not counters or self._client is None or wanted <= 0:
            return Grant(task_type, max(0, wanted))
        if time.monotonic() < self._retry_at:
            return Grant(task_type, 0)
        keys = tuple(slots_key(c.name) for c in counters)
        reservation = f"{self._reservation_prefix}{next(self._reservation_numbers)}"
        ttl = int(RESERVATION_TTL * 1000)
        try:
            self._send_unconfirmed()
            for _ in range(2):
                granted = int(
                    self._client.eval(_TAKE, len(keys), *keys, wanted, reservation, ttl, *(c.limit for c in counters))
                )
                if granted >= 0:
                    self._succeeded()
                    return Grant(task_type, granted, reservation, keys) if granted else Grant(task_type, 0)
                self._rebuild(counters)
        except RedisError as exc:
            self._failed(f"not claiming limited types until Redis returns ({exc})")
        return Grant(task_type, 0)

    def confirm(self, grant: Grant, claimed: Sequence[Attempt]) -> None:
        """After the claim: hold the slots of the attempts `claimed` with `grant`, and give back the rest."""
        if not grant.reservation:
            return
        with self._lock:
            self._unconfirmed.append((grant, [holder(a) for a in claimed]))
        if time.monotonic() < self._retry_at:
            return  # sent before the next take
        try:
            self._send_unconfirmed()
            self._succeeded()
        except RedisError as exc:
            self._failed(f"{grant.slots} slot(s) of {grant.task_type} to confirm later ({exc})")

    def release(self, attempts: Iterable[Attempt], limits: Mapping[str, int] | None = None) -> None:
        """Give back the slots held by these attempts, after their final database update (idempotent).

        `limits`: the concurrency limit of each task type (read from ScheduleCfg when not given).
        """
        if self._client is None:
            return
        attempts = list(attempts)
        if limits is None:
            limits = {t: cfg.concurrency_limit for t, cfg in configs.get_many({a.task_type for a in attempts}).items()}
        held: dict[str, list[str]] = defaultdict(list)
        everything = get_settings().GLOBAL_CONCURRENCY_LIMIT > 0
        if not everything and not any(limit > 0 for limit in limits.values()):
            return  # no slot is held for any of them
        for attempt in attempts:
            member = holder(attempt)
            if limits.get(attempt.task_type, 0) > 0:
                held[slots_key(attempt.task_type)].append(member)
            if everything:
                held[slots_key(GLOBAL)].append(member)
        if not held:
            return
        # A slot not given back is safe (too few claims, never too many): reconcile_counters()
        # frees it, and a set rebuilt after a Redis restart leaves finished attempts out anyway.
        if time.monotonic() < self._retry_at:
            log.debug("Redis unavailable: %d slot(s) left to reconciliation", len(attempts))
            return
        keys = list(held)
        try:
            self._client.eval(
                _RELEASE, len(keys), *keys, *(len(held[k]) for k in keys), *(m for k in keys for m in held[k])
            )
            self._succeeded()
        except RedisError as exc:
            self._failed(f"{len(attempts)} slot(s) left to reconciliation ({exc})")

    def exact_db_limit(self, limit: int) -> int:
        """The per-type limit claim_batch must enforce in the database itself (0 when Redis does it)."""
        return limit if self._client is None else 0

    def _send_unconfirmed(self) -> None:
        """Send the confirms Redis has not received yet; raises RedisError, keeping those not sent."""
        while True:
            with self._lock:
                if not self._unconfirmed:
                    return
                grant, members = self._unconfirmed.popleft()
            try:
                keys = grant.keys
                intact = int(self._client.eval(_CONFIRM, len(keys), *keys, grant.reservation, grant.slots, *members))
            except RedisError:
                with self._lock:
                    self._unconfirmed.appendleft((grant, members))
                raise
            if members and intact < len(keys):
                log.warning(
                    "a claim of %d %s task(s) outlived its reservation (%.0fs) or Redis restarted: "
                    "the limit may be exceeded until they end",
                    len(members),
                    grant.task_type,
                    RESERVATION_TTL,
                )

    def _rebuild(self, counters: list[_Counter]) -> None:
        # A claim whose slots were reserved in a Redis that has since restarted may still be
        # committing; the window is one claim transaction, against an outage of at least a reconnect.
        attempts = _processing_attempts([c.name for c in counters])
        keys = [slots_key(c.name) for c in counters]
        members = [attempts[c.name] for c in counters]
        self._client.eval(_REBUILD, len(keys), *keys, *(len(m) for m in members), *itertools.chain(*members))
        log.info("concurrency slots rebuilt from the database: %s", {c.name: len(attempts[c.name]) for c in counters})

    def _failed(self, what: str) -> None:
        if not self._failures:  # once per outage, not once per poll
            log.warning("concurrency limiter unavailable: %s", what)
        self._failures += 1
        self._retry_at = time.monotonic() + min(5.0, 0.5 * 2 ** min(self._failures, 4))

    def _succeeded(self) -> None:
        if self._failures:
            log.info("concurrency limiter available again")
        self._failures = 0


def _counters(task_type: str, limit: int) -> list[_Counter]:
    counters = [_Counter(task_type, limit)] if limit > 0 else []
    global_limit = get_settings().GLOBAL_CONCURRENCY_LIMIT
    if global_limit > 0:
        counters.append(_Counter(GLOBAL, global_limit))
    return counters


def _processing_attempts(names: list[str]) -> dict[str, list[str]]:
    """The attempts holding slots (as slot members) of each task type in `names` (GLOBAL: of all types).

    Processing attempts and lingering ones, read in that order: a stop committing in between is
    then seen twice (one member), never missed.
    """
    processing = Task.objects.filter(status=Status.PROCESSING)
    types = [n for n in names if n != GLOBAL]
    if GLOBAL not in names:
        processing = processing.filter(task_type__in=types)
    attempts: dict[str, list[str]] = {n: [] for n in names}
    wanted = set(types)
    holders = list(processing.values_list("id", "lease_token", "task_type"))
    holders += [(a.id, a.lease_token, a.task_type) for a in lingering_attempts()]
    for task_id, token, task_type in dict.fromkeys(holders):
        member = f"{task_id}:{token}"
        if task_type in wanted:
            attempts[task_type].append(member)
        if GLOBAL in attempts:
            attempts[GLOBAL].append(member)
    return attempts


def held_slots(name: str) -> int | None:
    """Slots held now in Redis for type `name` (GLOBAL: all types), by attempts and reservations; None if unknown."""
    client = get_redis()
    if client is None:
        return None
    held = int(client.eval(_HELD, 1, slots_key(name)))
    return None if held < 0 else held


def reconcile_counters() -> dict[str, int]:
    """Make the Redis slot sets hold exactly the processing attempts (plus live reservations); returns slots by type.

    The global set is reported as GLOBAL; sets of types without a limit are deleted (a later limit
    rebuilds them). The attempts held are read first, the processing rows second: an attempt held
    before the rows were read and not processing in them has ended, whatever is in flight, so it is
    freed; a processing attempt not held is added. Reservations are left to expire. Call it
    outside a transaction, so the rows read are the latest committed. Returns {} without Redis,
    or when Redis is unreachable.
    """
    client = get_redis()
    if client is None:
        return {}
    limits = dict(ScheduleCfg.objects.values_list("task_type", "concurrency_limit"))
    names = sorted(t for t, limit in limits.items() if limit > 0)
    retired = [t for t, limit in limits.items() if limit <= 0]
    if get_settings().GLOBAL_CONCURRENCY_LIMIT > 0:
        names.append(GLOBAL)
    else:
        retired.append(GLOBAL)
    keys = [slots_key(n) for n in names]
    try:
        if retired:
            client.delete(*(slots_key(t) for t in retired))
        if not names:
            return {}
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.zrangebyscore(k, "+inf", "+inf")
        before = [{m.decode() if isinstance(m, bytes) else m for m in found} for found in pipe.execute()]
        processing = _processing_attempts(names)
        args: list[Any] = []
        members: list[str] = []
        freed: dict[str, int] = {}
        added: dict[str, int] = {}
        for name, held in zip(names, before, strict=True):
            existed = _PRESENT in held
            held.discard(_PRESENT)
            now = set(processing[name])
            free, add = sorted(held - now), sorted(now - held)
            args.extend((int(existed), len(free), len(add)))
            members.extend(free + add)
            if free:
                freed[name] = len(free)
            if add:
                added[name] = len(add)
        values = client.eval(_CORRECT, len(keys), *keys, *args, *members)
    except RedisError as exc:
        log.warning("could not reconcile concurrency slots (%s)", exc)
        return {}
    if freed:
        log.warning("concurrency slots held by attempts no longer processing were freed: %s", freed)
    if added:
        log.info("concurrency slots of processing attempts Redis did not hold were added: %s", added)
    return {name: int(value) for name, value in zip(names, values, strict=True) if int(value) >= 0}


def exact_global_limit() -> int:
    """The global limit claim_batch must enforce in the database itself (0 when Redis does it or none is set)."""
    return get_settings().GLOBAL_CONCURRENCY_LIMIT if get_redis() is None else 0


def exact_room(task_type: str, wanted: int, type_limit: int, global_limit: int) -> int:
    """How many of `wanted` tasks may start now under exact database limits; call inside the claim's transaction.

    The locks taken here are held until that transaction commits, so no other claim can count the
    same free slots (on SQLite the IMMEDIATE transaction already serialises every writer).
    """
    processing = Task.objects.filter(status=Status.PROCESSING)
    # Processing rows are counted before lingering attempts: a stop committing in between is then
    # counted twice (too few claims for a moment), never missed.
    if global_limit > 0:
        # One row for every claim of every type: the global count stays true until we commit.
        _lock_gate()
        running = processing.count()
        wanted = min(wanted, global_limit - running - len(lingering_attempts()))
    else:
        list(ScheduleCfg.objects.select_for_update().filter(pk=task_type).values_list("pk"))
    if type_limit > 0 and wanted > 0:
        running = processing.filter(task_type=task_type).count()
        lingering = sum(1 for a in lingering_attempts() if a.task_type == task_type)
        wanted = min(wanted, type_limit - running - lingering)
    return max(0, wanted)


def ensure_gate() -> None:
    """Create the global gate row, if missing, before a claim's transaction needs to lock it."""
    # Outside the claim's transaction: creators racing inside theirs would deadlock on MariaDB,
    # each holding a shared lock on the other's duplicate key.
    Lock.objects.get_or_create(name=GATE, defaults={"owner": "taskflow.limiter", "expires_at": _GATE_EXPIRES})


def _lock_gate() -> None:
    gate = Lock.objects.select_for_update().filter(name=GATE).values_list("pk")
    if list(gate):
        return
    # Deleted since ensure_gate() (only by hand): recreate it here. A concurrent creator may make
    # this claim fail (a deadlock, retried by the worker), but never lets two claims count at once.
    with transaction.atomic():
        Lock.objects.create(name=GATE, owner="taskflow.limiter", expires_at=_GATE_EXPIRES)


# -- attempts that outlive their task ------------------------------------------------------------------

LINGERING = "taskflow:lingering:"  # + "<task id>:<lease token>:<task type>"; the Lock's owner is the worker


@dataclass(frozen=True)
class Lingering:
    """An attempt whose task was stopped while its handler runs on: it holds its slot until it ends."""

    task_type: str
    id: int
    lease_token: int


class RunningAttempt(Attempt, Protocol):
    worker_id: str
    lease_expires_at: datetime


def _lingering_name(attempt: Attempt) -> str:
    return f"{LINGERING}{attempt.id}:{attempt.lease_token}:{attempt.task_type}"


def _parse_lingering(name: str) -> Lingering:
    task_id, token, task_type = name.removeprefix(LINGERING).split(":", 2)
    return Lingering(task_type, int(task_id), int(token))


def keep_lingering(attempts: Iterable[RunningAttempt], now: datetime) -> list[RunningAttempt]:
    """Record these running attempts, whose tasks are being stopped, as holding their slots; returns those kept.

    Call it in the transaction that ends their tasks, so no claim ever sees the task ended and the
    slot free. An attempt already past its deadline is not kept (its slot is free now).
    """
    kept = [a for a in attempts if a.lease_expires_at > now]
    if kept:
        Lock.objects.bulk_create(
            [Lock(name=_lingering_name(a), owner=a.worker_id[:200], expires_at=a.lease_expires_at) for a in kept],
            ignore_conflicts=True,  # stopped twice: one row
        )
    return kept


def end_lingering(attempts: Iterable[tuple[int, int]]) -> list[Lingering]:
    """The handlers of these attempts ((task id, lease token)) returned: delete their rows; returns those deleted.

    Their slots are to be given back (Limiter.release) once this commits. An attempt that was not
    lingering (it ended its task itself, or was rescued) is not among them.
    """
    pairs = set(attempts)
    if not pairs:
        return []
    found = []
    for chunk in itertools.batched(sorted(pairs), 100):
        which = Q()
        for task_id, token in chunk:
            which |= Q(name__startswith=f"{LINGERING}{task_id}:{token}:")
        found += list(Lock.objects.filter(which).values_list("name", flat=True))
    return _delete_lingering(found)


def lingering_attempts() -> list[Lingering]:
    """The lingering attempts whose deadline has not passed (by the database's clock)."""
    names = Lock.objects.filter(name__startswith=LINGERING, expires_at__gt=sql.database_now())
    return [_parse_lingering(name) for name in names.values_list("name", flat=True)]


def lingering_deadline(task_id: int) -> datetime | None:
    """The deadline of a handler of this task still running after an operator stopped it, if one is."""
    names = Lock.objects.filter(name__startswith=f"{LINGERING}{task_id}:", expires_at__gt=sql.database_now())
    return max(names.values_list("expires_at", flat=True), default=None)


def end_lapsed_lingering() -> list[Lingering]:
    """Delete lingering attempts past their deadline or of dead workers (taskwatch); returns those deleted.

    Both judged by the database's clock, as rescues are.
    """
    owners = dict(Lock.objects.filter(name__startswith=LINGERING).values_list("name", "owner"))
    if not owners:
        return []
    lapsed = set(
        Lock.objects.filter(name__in=list(owners), expires_at__lte=sql.database_now()).values_list("name", flat=True)
    )
    alive = set(
        WorkerProcess.objects.filter(
            worker_id__in=set(owners.values()), heartbeat_at__gte=workers.liveness_cutoff()
        ).values_list("worker_id", flat=True)
    )
    return _delete_lingering([name for name, owner in owners.items() if name in lapsed or owner not in alive])


def _delete_lingering(names: list[str]) -> list[Lingering]:
    deleted = []
    for name in names:
        # One by one, so only the deleter of a row gives its slot back (a report and taskwatch may race).
        if Lock.objects.filter(name=name).delete()[0]:
            deleted.append(_parse_lingering(name))
    return deleted

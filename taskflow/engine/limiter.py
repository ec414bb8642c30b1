"""Concurrency limits per task type and globally: Redis slot counters, or an exact count in the database.

With Redis, a worker takes slots *before* claiming (one Lua script checks the type's and the global
bound together), gives back what it did not claim, and gives a slot back only after the task's
final database update for that attempt was accepted. A missing counter (Redis restarted, the key
was evicted) is first initialised from the database, so a restart never forgets running tasks.
`taskwatch` calls `reconcile_counters()` every RECONCILE_INTERVAL, so a crash skews a counter
only until then.

Without Redis, `exact_room()` runs inside the claim's transaction: it locks the type's ScheduleCfg
row (or, with a global limit, one gate row shared by every claim) and counts processing rows, so
concurrent claimers can never together exceed a limit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import transaction
from django.db.models import Count

from ..conf import get_settings
from ..models import Lock, ScheduleCfg, Status, Task
from .redis import RedisError, get_redis, key

log = logging.getLogger("taskflow.limiter")

# The name reconcile_counters() reports the global counter under; no task type starts with '*'.
GLOBAL = "*"
# The database row every claim locks while a global limit is enforced without Redis.
GATE = "taskflow:concurrency-gate"
_GATE_EXPIRES = datetime(9999, 12, 31, tzinfo=UTC)  # never expires, so no lease logic takes it over

# KEYS = counters; ARGV[1] = wanted, ARGV[1+i] = the limit of counter i. Grants the same n
# (0..wanted) on every counter, or returns -1 when a counter is missing and must be initialised
# from the database first.
_TAKE = """
local n = tonumber(ARGV[1])
for i = 1, #KEYS do
  local current = redis.call('get', KEYS[i])
  if not current then return -1 end
  n = math.min(n, tonumber(ARGV[i + 1]) - tonumber(current))
end
if n <= 0 then return 0 end
for i = 1, #KEYS do redis.call('incrby', KEYS[i], n) end
return n
"""
# KEYS = counters; ARGV[1] = slots. Never below zero (a double give-back, which should not happen,
# cannot open extra slots later) and never creates a counter: one initialised later from the
# database already leaves these finished attempts out.
_GIVE = """
for i = 1, #KEYS do
  local current = tonumber(redis.call('get', KEYS[i]) or '0')
  local n = math.min(tonumber(ARGV[1]), current)
  if n > 0 then redis.call('decrby', KEYS[i], n) end
end
return 0
"""
# KEYS = counters; ARGV[i] = processing rows counter i stands for. Only missing counters are set.
_INIT = """
for i = 1, #KEYS do redis.call('set', KEYS[i], ARGV[i], 'NX') end
return 0
"""
# KEYS = counters; ARGV[i] = the drift to remove from counter i (positive when it is too high),
# ARGV[#KEYS+i] = its processing rows, the value for a counter that is missing. Relative, so slots
# taken and given back while the drift was measured are kept. Returns the new values.
_CORRECT = """
local k = #KEYS
local values = {}
for i = 1, k do
  local current = redis.call('get', KEYS[i])
  local value = tonumber(ARGV[k + i])
  if current then value = math.max(0, tonumber(current) - tonumber(ARGV[i])) end
  redis.call('set', KEYS[i], value)
  values[i] = value
end
return values
"""
# Seconds between the two drift measurements of reconcile_counters(): a claim or report in
# progress shows up as drift in one of them, real drift in both.
RECONCILE_GAP = 0.5


def counter_key(task_type: str) -> str:
    """The Redis key counting the slots held by tasks of `task_type` (GLOBAL: by all tasks)."""
    return key("running-all") if task_type == GLOBAL else key("running", task_type)


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

    @property
    def uses_redis(self) -> bool:
        return self._client is not None

    def take(self, task_type: str, wanted: int, limit: int) -> int:
        """Slots granted for a claim of up to `wanted` tasks (all of them when no limit applies).

        Without Redis the limits are enforced inside the claim itself (see exact_room). If Redis is
        unreachable, a limited type claims nothing until it returns: waiting is safe, running over
        the limit is not.
        """
        counters = _counters(task_type, limit)
        if not counters or self._client is None or wanted <= 0:
            return wanted
        if time.monotonic() < self._retry_at:
            return 0
        keys = [counter_key(c.name) for c in counters]
        try:
            for _ in range(2):
                granted = int(self._client.eval(_TAKE, len(keys), *keys, wanted, *(c.limit for c in counters)))
                if granted >= 0:
                    self._succeeded()
                    return granted
                self._initialise(counters)
        except RedisError as exc:
            self._failed(f"not claiming limited types until Redis returns ({exc})")
        return 0

    def give_back(self, task_type: str, count: int, limit: int) -> None:
        """Return slots after the final database update of `count` attempts (or unused grants)."""
        counters = _counters(task_type, limit)
        if not counters or self._client is None or count <= 0:
            return
        # A slot not given back leaves its counter too high, which is safe: reconcile_counters()
        # corrects it, and a Redis that restarted empty recounts from the database anyway.
        if time.monotonic() < self._retry_at:
            log.debug("Redis unavailable: %d slot(s) of %s left to reconciliation", count, task_type)
            return
        keys = [counter_key(c.name) for c in counters]
        try:
            self._client.eval(_GIVE, len(keys), *keys, count)
            self._succeeded()
        except RedisError as exc:
            self._failed(f"{count} slot(s) of {task_type} left to reconciliation ({exc})")

    def exact_db_limit(self, limit: int) -> int:
        """The per-type limit claim_batch must enforce in the database itself (0 when Redis does it)."""
        return limit if self._client is None else 0

    def _initialise(self, counters: list[_Counter]) -> None:
        # A claim granted by a Redis that has since restarted may still be committing; the window is
        # one claim transaction, against an outage that lasted at least a reconnect.
        counts = _processing_counts([c.name for c in counters])
        keys = [counter_key(c.name) for c in counters]
        self._client.eval(_INIT, len(keys), *keys, *(counts[c.name] for c in counters))
        log.info("concurrency counters initialised from the database: %s", counts)

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


def _processing_counts(names: list[str]) -> dict[str, int]:
    """Processing rows per task type in `names` (GLOBAL: all of them)."""
    processing = Task.objects.filter(status=Status.PROCESSING)
    types = [n for n in names if n != GLOBAL]
    counts = dict.fromkeys(names, 0)
    if types:
        rows = processing.filter(task_type__in=types).values("task_type").annotate(n=Count("id")).order_by()
        counts.update({row["task_type"]: row["n"] for row in rows})
    if GLOBAL in counts:
        counts[GLOBAL] = processing.count()
    return counts


def reconcile_counters() -> dict[str, int]:
    """Correct every Redis concurrency counter to the processing rows it stands for; returns the values by type.

    The global counter is reported as GLOBAL; counters of types without a limit are deleted (a
    later limit initialises them afresh). A counter also holds slots of claims and reports in
    progress, which no database count sees, so the drift (counter minus processing rows) is
    measured twice, RECONCILE_GAP apart, and only what both show is removed, as a relative
    change that keeps slots taken or given back meanwhile. The window left: a claim or report
    stalled across both measurements looks like drift, and the counter ends up low by its size
    until the next run. Returns {} without Redis, or when Redis is unreachable.
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
    try:
        if retired:
            client.delete(*(counter_key(t) for t in retired))
        if not names:
            return {}
        first, _ = _drift(client, names)
        time.sleep(RECONCILE_GAP)
        second, counts = _drift(client, names)
        drift = [_persistent(first[n], second[n]) for n in names]
        keys = [counter_key(n) for n in names]
        values = client.eval(_CORRECT, len(keys), *keys, *drift, *(counts[n] for n in names))
    except RedisError as exc:
        log.warning("could not reconcile concurrency counters (%s)", exc)
        return {}
    corrected = {n: d for n, d in zip(names, drift, strict=True) if d}
    if corrected:
        log.warning("concurrency counters were off by %s; corrected", corrected)
    return {name: int(value) for name, value in zip(names, values, strict=True)}


def _drift(client: Any, names: list[str]) -> tuple[dict[str, int | None], dict[str, int]]:
    """Each counter minus its processing rows (None: no counter), and the row counts."""
    values = client.mget([counter_key(n) for n in names])
    counts = _processing_counts(names)
    drift = {n: None if v is None else int(v) - counts[n] for n, v in zip(names, values, strict=True)}
    return drift, counts


def _persistent(first: int | None, second: int | None) -> int:
    """The part of a drift both measurements agree on (0 when they disagree in sign)."""
    if first is None or second is None:
        return 0
    if first > 0 and second > 0:
        return min(first, second)
    if first < 0 and second < 0:
        return max(first, second)
    return 0


def exact_global_limit() -> int:
    """The global limit claim_batch must enforce in the database itself (0 when Redis does it or none is set)."""
    return get_settings().GLOBAL_CONCURRENCY_LIMIT if get_redis() is None else 0


def exact_room(task_type: str, wanted: int, type_limit: int, global_limit: int) -> int:
    """How many of `wanted` tasks may start now under exact database limits; call inside the claim's transaction.

    The locks taken here are held until that transaction commits, so no other claim can count the
    same free slots (on SQLite the IMMEDIATE transaction already serialises every writer).
    """
    processing = Task.objects.filter(status=Status.PROCESSING)
    if global_limit > 0:
        # One row for every claim of every type: the global count stays true until we commit.
        _lock_gate()
        wanted = min(wanted, global_limit - processing.count())
    else:
        list(ScheduleCfg.objects.select_for_update().filter(pk=task_type).values_list("pk"))
    if type_limit > 0 and wanted > 0:
        wanted = min(wanted, type_limit - processing.filter(task_type=task_type).count())
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

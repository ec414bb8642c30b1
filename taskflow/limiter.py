"""Concurrency limits per task type: slots in Redis when configured, an exact count in the database otherwise.

With Redis, a worker takes slots *before* claiming (a Lua script checks the bound atomically),
gives back what it did not claim, and gives a slot back only after the task's final database
update for that attempt. `taskwatch` reconciles the counters with the true number of processing
rows, so a crash skews a counter only until the next reconciliation.
"""

from __future__ import annotations

import logging

from .redis import get_redis, key

log = logging.getLogger("taskflow.limiter")

# KEYS[1] = counter; ARGV = wanted, limit. Returns the slots granted (0..wanted).
_TAKE = """
local current = tonumber(redis.call('get', KEYS[1]) or '0')
local free = tonumber(ARGV[2]) - current
local n = math.min(tonumber(ARGV[1]), free)
if n <= 0 then return 0 end
redis.call('incrby', KEYS[1], n)
return n
"""
# Never below zero: a double give-back (which should not happen) cannot open extra slots later.
_GIVE = """
local current = tonumber(redis.call('get', KEYS[1]) or '0')
local n = math.min(tonumber(ARGV[1]), current)
if n > 0 then redis.call('decrby', KEYS[1], n) end
return n
"""


def counter_key(task_type: str) -> str:
    return key("running", task_type)


class Limiter:
    """Decides how many tasks of a type a worker may claim now."""

    def __init__(self) -> None:
        self._client = get_redis()

    @property
    def uses_redis(self) -> bool:
        return self._client is not None

    def take(self, task_type: str, wanted: int, limit: int) -> int:
        """Slots granted for a claim of up to `wanted` tasks (all of them when unlimited).

        Without Redis the limit is enforced inside the claim itself (see claim_batch's exact_limit).
        If Redis is unreachable, a limited type claims nothing until it returns: waiting is safe,
        running over the limit is not.
        """
        if limit <= 0 or self._client is None or wanted <= 0:
            return wanted
        try:
            return int(self._client.eval(_TAKE, 1, counter_key(task_type), wanted, limit))
        except Exception as exc:
            log.warning("limiter unavailable for %s (%s); not claiming it until Redis returns", task_type, exc)
            return 0

    def give_back(self, task_type: str, count: int, limit: int) -> None:
        """Return slots after the final database update of `count` attempts (or unused grants)."""
        if limit <= 0 or self._client is None or count <= 0:
            return
        try:
            self._client.eval(_GIVE, 1, counter_key(task_type), count)
        except Exception as exc:
            # The counter stays too high (conservative) until taskwatch reconciles it.
            log.warning("could not give back %d slot(s) of %s (%s)", count, task_type, exc)

    def exact_db_limit(self, limit: int) -> int:
        """The limit claim_batch must enforce in the database itself (0 when Redis does it)."""
        return limit if self._client is None else 0

"""When a failed attempt runs again: the back-off strategies."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from ..models import RetryStrategy, ScheduleCfg


@dataclass(frozen=True)
class RetryPolicy:
    strategy: str = RetryStrategy.EXPONENTIAL
    interval: float = 10.0
    max_interval: float = 3600.0
    jitter: float = 0.1

    @classmethod
    def for_config(cls, cfg: ScheduleCfg) -> RetryPolicy:
        return cls(cfg.retry_strategy, cfg.retry_interval, cfg.max_retry_interval, cfg.retry_jitter)

    def base_delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """The delay before retry number `attempt` (1 = first retry), before jitter and cap."""
        n = max(1, attempt)
        if self.strategy == RetryStrategy.FIXED:
            return self.interval
        if self.strategy == RetryStrategy.EXPONENTIAL:
            # Capped exponent: 2 ** 1024 no longer converts to a float, and a task may allow that many
            # retries; any interval > 0 has long reached max_interval by then.
            return self.interval * 2.0 ** min(n - 1, 1000)
        if self.strategy == RetryStrategy.POLYNOMIAL:
            # Sidekiq's formula: grows as n^4, with its own spread so a burst of failures fans out.
            return n**4 + 15 + rand() * 30 * (n + 1)
        raise ValueError(f"unknown retry strategy {self.strategy!r}")

    def next_delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait before retry number `attempt`: capped, then up to `jitter` of it taken off.

        Jitter only ever shortens the delay, so the cap holds and retries of tasks that failed
        together spread out instead of stampeding.
        """
        delay = min(self.base_delay(attempt, rand), self.max_interval)
        return max(0.0, delay * (1.0 - self.jitter * rand()))

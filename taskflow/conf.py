"""The TASKFLOW setting, read once into one typed object with defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed


@dataclass(frozen=True)
class TaskflowSettings:
    # django-redis cache alias; None runs everything on the database alone.
    REDIS_ALIAS: str | None = None

    # Defaults for a task type's ScheduleCfg row when it is first created.
    SCHEDULE_LIMIT: int = 100
    SCHEDULE_INTERVAL: float = 1.0
    MAX_PROCESSING_TIME: int = 300
    MAX_RETRY_NUM: int = 3
    RETRY_STRATEGY: str = "exponential"
    RETRY_INTERVAL: float = 10.0
    MAX_RETRY_INTERVAL: float = 3600.0
    RETRY_JITTER: float = 0.1
    CONCURRENCY_LIMIT: int = 0
    PRIORITY_AGING: float = 1.0
    PENDING_TIMEOUT: int = 0
    SUCCESS_RETENTION: int = 86400
    PURGE_AFTER_DAYS: int = 7

    # The engine's own timings (seconds); tests and small deployments shorten them.
    CONFIG_REFRESH: float = 1.0
    REPORT_INTERVAL: float = 0.005
    HEARTBEAT_INTERVAL: float = 5.0
    LIVENESS_TIMEOUT: float = 30.0
    SHUTDOWN_GRACE: float = 30.0
    GLOBAL_CONCURRENCY_LIMIT: int = 0
    RECONCILE_INTERVAL: float = 30.0
    WATCH_INTERVAL: float = 5.0
    LEADER_TTL: float = 15.0
    PURGE_BATCH: int = 1000


# Settings that were removed because they were unsafe, with what to do instead.
REMOVED = {
    "NODE_ID": (
        "one node number in the project settings is shared by every process that reads them, so they "
        "mint the same ids. Each process now leases a node of its own; delete the setting."
    ),
}


@cache
def get_settings() -> TaskflowSettings:
    """Return the TASKFLOW setting merged over the defaults, rejecting unknown keys."""
    given = getattr(settings, "TASKFLOW", {}) or {}
    for name, why in REMOVED.items():
        if name in given:
            raise ImproperlyConfigured(f"TASKFLOW[{name!r}] is no longer supported: {why}")
    known = {f.name for f in dataclasses.fields(TaskflowSettings)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ImproperlyConfigured(f"Unknown TASKFLOW settings: {', '.join(unknown)}")
    return TaskflowSettings(**given)


def _reset(*, setting: str, **kwargs: object) -> None:
    if setting == "TASKFLOW":
        get_settings.cache_clear()


setting_changed.connect(_reset)

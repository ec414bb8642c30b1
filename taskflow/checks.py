"""System checks: `manage.py check` names each bad TASKFLOW value and each setting taskflow cannot work with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning

from .conf import setting_problems

_IDS = {
    "not-a-dict": "taskflow.E001",
    "unknown": "taskflow.E002",
    "type": "taskflow.E003",
    "range": "taskflow.E004",
    "conflict": "taskflow.E005",
}
_HINTS = {
    "unknown": "See the configuration table in taskflow's README for the known keys.",
}


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The TASKFLOW setting: known keys, types, ranges, a configured Redis alias, and a usable database."""
    given = getattr(settings, "TASKFLOW", None)
    errors: list[CheckMessage] = [
        Error(p.message, hint=_HINTS.get(p.kind), id=_IDS[p.kind]) for p in setting_problems(given)
    ]
    alias = given.get("REDIS_ALIAS") if isinstance(given, Mapping) else None
    if isinstance(alias, str):
        errors += _redis_alias_errors(alias)
    return errors + _database_errors()


def _redis_alias_errors(alias: str) -> list[CheckMessage]:
    caches = getattr(settings, "CACHES", {})
    if alias not in caches:
        return [
            Error(
                f"TASKFLOW['REDIS_ALIAS'] is {alias!r}, which is not a configured cache alias "
                f"(CACHES has {', '.join(map(repr, caches)) or 'none'})",
                hint="Use the alias of a django-redis cache, or None to run without Redis.",
                id="taskflow.E006",
            )
        ]
    backend = str(caches[alias].get("BACKEND", ""))
    if not backend.startswith("django_redis."):
        return [
            Error(
                f"TASKFLOW['REDIS_ALIAS'] is {alias!r}, whose cache backend {backend!r} is not django-redis: "
                "taskflow needs its raw Redis client (Lua scripts, pub/sub)",
                hint="Point REDIS_ALIAS at a cache with BACKEND 'django_redis.cache.RedisCache', or set it to None.",
                id="taskflow.E007",
            )
        ]
    return []


def _database_errors() -> list[CheckMessage]:
    database = settings.DATABASES.get("default", {})
    if not str(database.get("ENGINE", "")).endswith("sqlite3"):
        return []
    mode = str((database.get("OPTIONS") or {}).get("transaction_mode") or "DEFERRED").upper()
    # EXCLUSIVE takes the write lock up front too (and, in WAL mode, is the same as IMMEDIATE).
    if mode in ("IMMEDIATE", "EXCLUSIVE"):
        return []
    return [
        Error(
            f"DATABASES['default'] is SQLite with transaction_mode {mode}: taskflow needs IMMEDIATE transactions. "
            "A claim reads due rows, then updates them, and SQLite has no row locks; in a DEFERRED transaction "
            "the write lock is taken only at the UPDATE, so concurrent claims and reports fail with "
            "'database is locked' instead of waiting their turn",
            hint="Set DATABASES['default']['OPTIONS']['transaction_mode'] = 'IMMEDIATE'.",
            id="taskflow.E008",
        )
    ]


HISTORY_ID = "taskflow.W010"


def check_history_tables(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """History tables (table rolling) whose columns are not the task table's: `migrate` brings them in line."""
    if not databases or "default" not in databases:
        return []
    from django.db import DatabaseError

    from .engine.rolling import schema_drift

    try:
        problems = schema_drift()
    except DatabaseError:  # not migrated yet: migrate's own checks say so
        return []
    return [
        Warning(p, hint="Run `manage.py migrate`: it gives history tables the task table's columns.", id=HISTORY_ID)
        for p in problems
    ]

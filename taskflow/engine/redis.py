"""Access to the optional Redis server, through django-redis."""

from __future__ import annotations

from typing import Any

from ..conf import get_settings


def get_redis() -> Any | None:
    """Return a raw redis-py client for the configured alias, or None when taskflow runs without Redis."""
    alias = get_settings().REDIS_ALIAS
    if not alias:
        return None
    from django_redis import get_redis_connection

    return get_redis_connection(alias)


def key(*parts: object) -> str:
    """One namespace for every key taskflow writes."""
    return "taskflow:" + ":".join(str(p) for p in parts)

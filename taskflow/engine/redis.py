"""Access to the optional Redis server, through django-redis, and the names taskflow uses in it."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from ..conf import get_settings

try:
    from redis.exceptions import RedisError
except ImportError:  # installed without the `redis` extra: no client exists that could raise it

    class RedisError(Exception):  # type: ignore[no-redef]
        """Stands in for redis-py's error when the package is not installed."""


def get_redis() -> Any | None:
    """Return a raw redis-py client for the configured alias, or None when taskflow runs without Redis."""
    alias = get_settings().REDIS_ALIAS
    if not alias:
        return None
    from django_redis import get_redis_connection

    return get_redis_connection(alias)


def key(*parts: object) -> str:
    """The name of a Redis key or pub/sub channel: "taskflow:<namespace>:<parts>"."""
    return f"taskflow:{namespace()}:" + ":".join(str(p) for p in parts)


def namespace() -> str:
    """This deployment's part of Redis: TASKFLOW["REDIS_NAMESPACE"], else one derived from its database.

    Derived at every call, never at import: the test runner renames the database after settings
    load, and a name taken too early would put the tests in the real deployment's namespace.
    """
    given = get_settings().REDIS_NAMESPACE
    if given is not None:
        return given
    conn = connections[DEFAULT_DB_ALIAS]
    db = conn.settings_dict
    identity = (conn.vendor, db.get("HOST"), db.get("PORT"), db.get("NAME"))
    derived = _derived.get(identity)
    if derived is None:
        derived = _derived[identity] = derive_namespace(*identity)
    return derived


_derived: dict[tuple[Any, ...], str] = {}
_DEFAULT_PORTS = {"mysql": "3306", "postgresql": "5432"}


def derive_namespace(vendor: str, host: object, port: object, name: object) -> str:
    """A short name for one database, the same for every process configured for it.

    Spellings are normalised (host case, a default port left out, a relative SQLite path), but a
    host reached by two names (an IP and a DNS name) still gives two namespaces: deployments whose
    processes spell their database differently set TASKFLOW["REDIS_NAMESPACE"] instead.
    """
    host_text = str(host or "").lower()
    port_text = str(port or "") or _DEFAULT_PORTS.get(vendor, "")
    name_text = str(name or "")
    if vendor == "sqlite" and name_text and not name_text.startswith(("file:", ":memory:")):
        name_text = os.path.abspath(name_text)
    identity = "\x1f".join((vendor, host_text, port_text, name_text))
    return "db-" + hashlib.sha256(identity.encode()).hexdigest()[:12]

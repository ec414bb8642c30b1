"""Task column values to and from the database driver, for the hot paths that write their own SQL.

Enqueueing, claiming and reporting run thousands of times a second; the ORM's per-field
preparation would cost them more than the database's own work, so they send the same values it
would, converted here once per distinct value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from django.db import connection
from django.utils.dateparse import parse_datetime

from .models import Task

Adapter = Callable[[Any], Any]


def column(name: str) -> str:
    """The quoted column of a Task field."""
    return connection.ops.quote_name(Task._meta.get_field(name).column)


def placeholder(name: str) -> str:
    """The parameter marker for a Task field (PostgreSQL needs jsonb parameters cast)."""
    model_field = Task._meta.get_field(name)
    if connection.vendor == "postgresql":
        return f"CAST(%s AS {model_field.db_type(connection)})"
    return "%s"


def to_db(name: str) -> Adapter:
    """A converter from a Task field's Python value to the driver's parameter value."""
    kind = Task._meta.get_field(name).get_internal_type()
    if kind == "JSONField":
        return lambda v: None if v is None else json.dumps(v)
    if kind == "DateTimeField":
        adapt = connection.ops.adapt_datetimefield_value
        cache: dict[datetime, Any] = {}

        def adapt_datetime(v: datetime | None) -> Any:
            # A batch shares a handful of timestamps: convert each distinct one once.
            if v is None:
                return None
            if v not in cache:
                cache[v] = adapt(v)
            return cache[v]

        return adapt_datetime
    if kind == "CharField":
        return lambda v: v.value if hasattr(v, "value") else v  # TextChoices -> str
    return lambda v: v


def json_from_db() -> Adapter:
    # Every backend hands JSON back as text here (Django tells psycopg not to decode jsonb).
    return lambda value: json.loads(value) if isinstance(value, (str, bytes)) else value


def datetime_from_db() -> Adapter:
    if connection.vendor == "postgresql":
        return lambda value: value  # already aware
    if connection.vendor == "sqlite":
        return lambda value: parse_datetime(value).replace(tzinfo=UTC) if isinstance(value, str) else value
    return lambda value: None if value is None else value.replace(tzinfo=UTC)  # MySQL: naive UTC

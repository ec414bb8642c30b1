"""Task column values to and from the database driver, for the hot paths that write their own SQL.

Enqueueing, claiming and reporting run thousands of times a second; the ORM's per-field
preparation would cost them more than the database's own work, so they send the same values it
would, converted here once per distinct value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from functools import cache
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


@cache
def to_db(name: str) -> Adapter:
    """A converter from a Task field's Python value to the driver's parameter value."""
    kind = Task._meta.get_field(name).get_internal_type()
    if kind == "JSONField":
        return _json_to_db
    if kind == "DateTimeField":
        return _datetime_to_db
    if kind == "CharField":
        return _text_to_db
    return _as_is


def _json_to_db(value: Any) -> Any:
    return None if value is None else json.dumps(value)


def _datetime_to_db(value: datetime | None) -> Any:
    return None if value is None else connection.ops.adapt_datetimefield_value(value)


def _text_to_db(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value  # TextChoices -> str


def _as_is(value: Any) -> Any:
    return value


def json_from_db() -> Adapter:
    # Every backend hands JSON back as text here (Django tells psycopg not to decode jsonb).
    return lambda value: json.loads(value) if isinstance(value, (str, bytes)) else value


def datetime_from_db() -> Adapter:
    if connection.vendor == "postgresql":
        return lambda value: value  # already aware
    if connection.vendor == "sqlite":
        return lambda value: parse_datetime(value).replace(tzinfo=UTC) if isinstance(value, str) else value
    return lambda value: None if value is None else value.replace(tzinfo=UTC)  # MySQL: naive UTC

"""Every hand-written SQL statement that touches task rows, and the vendor differences they need.

Enqueueing, claiming and reporting run thousands of times a second; the ORM's per-call compilation
and per-field preparation would cost them more than the database's own work, so they are written
out here and send the same values the ORM would, converted once per distinct value. Each statement
takes the table it works on (`table`, a quoted-or-not table name): the hot task table today,
numbered history tables once tables roll. Everything else changes tasks through the ORM.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any

from django.db import connection
from django.utils.dateparse import parse_datetime

from ..models import Status, Task

Adapter = Callable[[Any], Any]
INSERT_BATCH = 1000  # rows per multi-row INSERT


def task_table() -> str:
    """The hot task table: the one workers claim from."""
    return Task._meta.db_table


def quote(name: str) -> str:
    return connection.ops.quote_name(name)


def column(name: str) -> str:
    """The quoted column of a Task field."""
    return quote(Task._meta.get_field(name).column)


# -- values to and from the driver ------------------------------------------------------------------


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
        return json_to_db
    if kind == "DateTimeField":
        return datetime_to_db
    if kind == "CharField":
        return _text_to_db
    return _as_is


def json_to_db(value: Any) -> Any:
    return None if value is None else json.dumps(value)


def datetime_to_db(value: datetime | None) -> Any:
    return None if value is None else connection.ops.adapt_datetimefield_value(value)


def _text_to_db(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value  # TextChoices -> str


def _as_is(value: Any) -> Any:
    return value


def json_from_db(value: Any) -> Any:
    # Every backend hands JSON back as text here (Django tells psycopg not to decode jsonb).
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def datetime_from_db() -> Adapter:
    if connection.vendor == "postgresql":
        return lambda value: value  # already aware
    if connection.vendor == "sqlite":
        return lambda value: parse_datetime(value).replace(tzinfo=UTC) if isinstance(value, str) else value
    return lambda value: None if value is None else value.replace(tzinfo=UTC)  # MySQL: naive UTC


# -- INSERT ------------------------------------------------------------------------------------------


def insert_tasks(table: str, tasks: list[Task]) -> None:
    """INSERT new task rows with multi-row statements of up to INSERT_BATCH rows.

    Hand-built because the ORM's bulk_create prepares every field of every row one call at a time,
    which costs several times more than the database's own work for a table this wide. Columns
    whose value is the same for the whole batch are converted once.
    """
    head, attnames, adapters, placeholders = _insert_plan(connection.vendor, table)
    # mysqlclient quotes every parameter in Python; rendering batch-wide constants into the SQL
    # once saves most of that. Other drivers bind parameters natively and gain nothing.
    connection.ensure_connection()  # the driver's own literal() is needed before any query ran
    literal = connection.connection.literal if connection.vendor == "mysql" else None
    for start in range(0, len(tasks), INSERT_BATCH):
        chunk = tasks[start : start + INSERT_BATCH]
        marks: list[str] = []
        varying: list[int] = []
        for i, name in enumerate(attnames):
            first = getattr(chunk[0], name)
            if literal is not None and all(getattr(t, name) == first for t in chunk):
                rendered = literal(adapters[i](first))
                marks.append((rendered.decode() if isinstance(rendered, bytes) else rendered).replace("%", "%%"))
            else:
                marks.append(placeholders[i])
                varying.append(i)
        getters = [_payload_getter if attnames[i] == "payload" else _getter(attnames[i], adapters[i]) for i in varying]
        params: list[Any] = []
        for task in chunk:
            params.extend(get(task) for get in getters)
        row_sql = "(" + ", ".join(marks) + ")"
        with connection.cursor() as cursor:
            cursor.execute(head + ", ".join([row_sql] * len(chunk)), params)
    for task in tasks:
        task._state.adding = False
        task._state.db = connection.alias


def _getter(attname: str, adapt: Adapter) -> Any:
    return lambda task: adapt(getattr(task, attname))


def _payload_getter(task: Task) -> Any:
    # Validation already serialised the payload; do not do it twice per task.
    text = task.__dict__.get("_payload_text")
    return text if text is not None else json_to_db(task.payload)


@cache
def _insert_plan(vendor: str, table: str) -> tuple[str, list[str], list[Adapter], list[str]]:
    """The INSERT's fixed parts for one vendor and table: its head, and each column's name, converter, marker."""
    fields = Task._meta.concrete_fields
    head = f"INSERT INTO {quote(table)} ({', '.join(quote(f.column) for f in fields)}) VALUES "
    return head, [f.attname for f in fields], [to_db(f.name) for f in fields], [placeholder(f.name) for f in fields]


# -- claiming ------------------------------------------------------------------------------------------

# What a claim reads of each task: enough to build its attempt without another query.
CLAIM_COLUMNS = (
    "id",
    "task_type",
    "key",
    "version",
    "priority",
    "payload",
    "context",
    "checkpoint",
    "stage",
    "attempts",
    "max_retries",
    "timeout",
    "lease_token",
    "trace_id",
    "schedule_log",
    "run_after",
    "retry_same_host",
    "prefer_host",
)
_JSON_COLUMNS = {"payload", "context", "checkpoint", "schedule_log"}


def select_due(table: str, task_type: str, limit: int, host: str, now: datetime) -> list[dict[str, Any]]:
    """Lock and read up to `limit` due pending tasks of a type, in scheduling order (skipping locked rows)."""
    qn = quote
    columns = ", ".join(column(name) for name in CLAIM_COLUMNS)
    at = connection.ops.adapt_datetimefield_value(now)
    hosts = f"{qn('prefer_host')} = '' OR {qn('prefer_host_until')} <= %s"
    params: list[Any] = [Status.PENDING.value, task_type, at, at]
    if host:
        hosts += f" OR {qn('prefer_host')} = %s"
        params.append(host)
    lock = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    sql = (
        f"SELECT {columns} FROM {qn(table)} "
        f"WHERE {qn('status')} = %s AND {qn('task_type')} = %s AND {qn('run_after')} <= %s AND ({hosts}) "
        f"ORDER BY {qn('order_time')} LIMIT %s{lock}"
    )
    params.append(limit)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    to_datetime = datetime_from_db()
    out = []
    for values in rows:
        row = dict(zip(CLAIM_COLUMNS, values, strict=True))
        for name in _JSON_COLUMNS:
            row[name] = json_from_db(row[name])
        row["run_after"] = to_datetime(row["run_after"])
        out.append(row)
    return out


def mark_processing(table: str, ids: Sequence[int], worker_id: str, now: datetime, deadline: datetime) -> int:
    """Start an attempt of each still-pending task in `ids`: count it, bump its fencing token, set its deadline."""
    qn = quote
    adapt = connection.ops.adapt_datetimefield_value
    marks = ", ".join(["%s"] * len(ids))
    sql = (
        f"UPDATE {qn(table)} SET {qn('status')} = %s, "
        f"{qn('attempts')} = {qn('attempts')} + 1, {qn('lease_token')} = {qn('lease_token')} + 1, "
        f"{qn('worker_id')} = %s, {qn('started_at')} = %s, {qn('heartbeat_at')} = %s, "
        f"{qn('lease_expires_at')} = %s, {qn('updated_at')} = %s "
        f"WHERE {qn('id')} IN ({marks}) AND {qn('status')} = %s"
    )
    at = adapt(now)
    params = [Status.PROCESSING.value, worker_id, at, at, adapt(deadline), at, *ids, Status.PENDING.value]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


# -- reports ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Guard:
    """An extra condition on a guarded update, beyond `status = 'processing' AND lease_token = ?`."""

    sql: str = ""
    params: tuple[Any, ...] = field(default=())

    @classmethod
    def deadline_passed(cls, now: datetime) -> Guard:
        """Only attempts still past their deadline: a heartbeat that just extended it keeps the task."""
        return cls(f"{column('lease_expires_at')} < %s", (datetime_to_db(now),))


NO_GUARD = Guard()


def update_attempts(table: str, rows: dict[int, dict[str, Any]], token: int, guard: Guard = NO_GUARD) -> int:
    """One UPDATE of many running attempts that share a fencing token; returns the rows changed.

    Columns equal across the rows are set once, the others through `CASE id`. Only rows still
    `processing` under `token` (and matching `guard`) change, so a late report changes nothing.
    """
    qn = quote
    ids = list(rows)
    assignments: list[str] = []
    params: list[Any] = []
    for name in next(iter(rows.values())):
        convert, mark = to_db(name), placeholder(name)
        values = [rows[i][name] for i in ids]
        first = values[0]
        if all(v == first and type(v) is type(first) for v in values):
            assignments.append(f"{column(name)} = {mark}")
            params.append(convert(first))
        else:
            whens = " ".join([f"WHEN %s THEN {mark}"] * len(ids))
            assignments.append(f"{column(name)} = CASE {qn('id')} {whens} END")
            for i, v in zip(ids, values, strict=True):
                params.extend((i, convert(v)))
    where = f"{qn('id')} IN ({', '.join(['%s'] * len(ids))}) AND {qn('status')} = %s AND {qn('lease_token')} = %s"
    params.extend(ids)
    params.extend((Status.PROCESSING.value, token))
    if guard.sql:
        where += f" AND ({guard.sql})"
        params.extend(guard.params)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {qn(table)} SET {', '.join(assignments)} WHERE {where}", params)
        return cursor.rowcount


def ids_written_at(table: str, ids: Iterable[int], token: int, updated_at: datetime) -> set[int]:
    """Which of `ids` carry `updated_at` under `token` now: the rows a partly refused update did change."""
    qn = quote
    ids = list(ids)
    sql = (
        f"SELECT {qn('id')} FROM {qn(table)} WHERE {qn('id')} IN ({', '.join(['%s'] * len(ids))}) "
        f"AND {qn('lease_token')} = %s AND {qn('updated_at')} = %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*ids, token, datetime_to_db(updated_at)])
        return {row[0] for row in cursor.fetchall()}


def update_tasks_expecting(
    table: str, writes: dict[int, dict[str, Any]], expected_status: dict[int, str], updated_at: datetime
) -> set[int]:
    """One UPDATE giving each row its own changes, only where the row still has the status expected of it.

    Every row's changes must include `updated_at`; columns a row does not change keep their value
    (`CASE id ... ELSE column`). Returns the ids written: the others changed meanwhile.
    """
    qn = quote
    ids = list(writes)
    names = sorted({name for changes in writes.values() for name in changes})
    assignments: list[str] = []
    params: list[Any] = []
    for name in names:
        convert, mark = to_db(name), placeholder(name)
        changing = [i for i in ids if name in writes[i]]
        values = [writes[i][name] for i in changing]
        if len(changing) == len(ids) and all(_same_value(v, values[0]) for v in values):
            assignments.append(f"{column(name)} = {mark}")
            params.append(convert(values[0]))
            continue
        whens = " ".join([f"WHEN %s THEN {mark}"] * len(changing))
        assignments.append(f"{column(name)} = CASE {qn('id')} {whens} ELSE {column(name)} END")
        for i, v in zip(changing, values, strict=True):
            params.extend((i, convert(v)))
    status_whens = " ".join(["WHEN %s THEN %s"] * len(ids))
    where = f"{qn('id')} IN ({', '.join(['%s'] * len(ids))}) AND {qn('status')} = CASE {qn('id')} {status_whens} END"
    params.extend(ids)
    for i in ids:
        params.extend((i, _text_to_db(expected_status[i])))
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {qn(table)} SET {', '.join(assignments)} WHERE {where}", params)
        if cursor.rowcount == len(ids):
            return set(ids)
        cursor.execute(
            f"SELECT {qn('id')} FROM {qn(table)} WHERE {qn('id')} IN ({', '.join(['%s'] * len(ids))}) "
            f"AND {qn('updated_at')} = %s",
            [*ids, datetime_to_db(updated_at)],
        )
        return {row[0] for row in cursor.fetchall()}


def _same_value(a: Any, b: Any) -> bool:
    """Equal and of the same JSON shape: True and 1, or 0.0 and 0, are different values to store."""
    same_json = json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
    return type(a) is type(b) and same_json

"""Every hand-written SQL statement that touches task rows, and the vendor differences they need.

Enqueueing, claiming and reporting run thousands of times a second; the ORM's per-call compilation
and per-field preparation would cost them more than the database's own work, so they are written
out here and send the same values the ORM would, converted once per distinct value. Each statement
takes the table it works on (`table`, a quoted-or-not table name): the hot task table today,
numbered history tables once tables roll. Everything else changes tasks through the ORM.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo
from functools import cache
from itertools import chain
from operator import attrgetter
from typing import Any

from django.db import connection, transaction
from django.db.models import DateTimeField
from django.db.models.expressions import RawSQL
from django.utils.dateparse import parse_datetime

from ..models import SchedulePos, Status, Task, TaskDependency, TaskKey, WorkerProcess

Adapter = Callable[[Any], Any]
INSERT_BATCH = 1000  # rows per multi-row INSERT
# Bytes of row data per multi-row INSERT. A statement must fit the server's packet limit (16 MiB
# on a stock MariaDB); JSON text is ASCII, and quoting at most doubles it.
INSERT_BYTES = 4_000_000
ROW_BYTES = 1_000  # a row's columns besides payload and context, generously


def task_table() -> str:
    """The hot task table: the one workers claim from."""
    return Task._meta.db_table


def quote(name: str) -> str:
    return connection.ops.quote_name(name)


def column(name: str) -> str:
    """The quoted column of a Task field."""
    return quote(Task._meta.get_field(name).column)


# -- transactions ----------------------------------------------------------------------------------


@contextmanager
def transaction_of_statements() -> Iterator[None]:
    """atomic() for a few statements outside any transaction, one round trip shorter on MySQL.

    atomic() switches autocommit off, runs the statements, sends COMMIT and switches autocommit
    back on; MySQL commits the open transaction itself when autocommit goes back on, so the COMMIT
    is left out. Django sees manual transaction management meanwhile, so nothing inside may use
    on_commit() or expect atomic()'s bookkeeping (ids are minted before, for their node lease).
    """
    if connection.vendor != "mysql" or connection.in_atomic_block or not connection.get_autocommit():
        with transaction.atomic():  # (autocommit off: the caller manages the transaction; atomic() knows)
            yield
        return
    connection.set_autocommit(False)
    try:
        yield
    except BaseException:
        connection.rollback()
        raise
    finally:
        connection.set_autocommit(True)


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


def same_value(a: Any, b: Any) -> bool:
    """Whether two values are stored identically, so one literal may stand for both.

    Python's == is too loose: True == 1 == 1.0 and 0.0 == -0.0, which JSON and the database tell
    apart; so types must match all the way down (and dict keys in order, as the JSON text keeps it).
    """
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:
        return len(a) == len(b) and (
            not a
            or all(
                same_value(ka, kb) and same_value(va, vb)
                for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
            )
        )
    if kind is list or kind is tuple:
        return len(a) == len(b) and (not a or all(same_value(x, y) for x, y in zip(a, b, strict=True)))
    if kind is float:
        return repr(a) == repr(b)  # 0.0 and -0.0 are equal but written differently
    return a == b


def json_from_db(value: Any) -> Any:
    # Every backend hands JSON back as text here (Django tells psycopg not to decode jsonb). Most
    # claimed rows hold an empty context and schedule log: those need no parser (a new object each).
    if value == "{}":
        return {}
    if value == "[]":
        return []
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def id_list(ids: Iterable[int]) -> str:
    """Task ids written into a statement (`1, 2, 3`): ints only, so nothing to escape, and no driver
    conversion per id on the hot paths (a claim's or a report's hundred ids)."""
    return ", ".join([str(int(i)) for i in ids])


def datetime_from_db() -> Adapter:
    if connection.vendor == "postgresql":
        return lambda value: value  # already aware
    if connection.vendor == "sqlite":
        # Text, or a naive datetime where Django's sqlite3 converters already parsed it: UTC either way.
        return lambda value: (
            None if value is None else (parse_datetime(value) if isinstance(value, str) else value).replace(tzinfo=UTC)
        )
    return lambda value: None if value is None else value.replace(tzinfo=UTC)  # MySQL: naive UTC


# -- INSERT ------------------------------------------------------------------------------------------


def insert_tasks(table: str, tasks: list[Task]) -> None:
    """INSERT new task rows with as many multi-row statements as `insert_batches` splits them into."""
    for batch in insert_batches(tasks):
        insert_batch(table, batch)


def appends_statements() -> bool:
    """Whether a statement may carry a second one (`insert_batch`'s `then`): psycopg's client-side binding."""
    return connection.vendor == "postgresql" and not connection.settings_dict["OPTIONS"].get("server_side_binding")


def insert_batch(table: str, tasks: list[Task], then: tuple[str, list[Any]] | None = None) -> None:
    """INSERT new task rows with one multi-row statement (see `insert_batches` for its size).

    `then`: a statement and its parameters sent along in the same round trip (see appends_statements).

    Hand-built because the ORM's bulk_create prepares every field of every row one call at a time,
    which costs several times more than the database's own work for a table this wide. Columns
    whose value is the same for the whole batch are converted once, and left out altogether when
    that value is the one the database fills in itself (the model's db_default): most of a new
    task's columns, so the server parses a third of the values.
    """
    if not tasks:
        return
    plan = _insert_plan(connection.vendor, connection.timezone_name, table)
    if len(tasks) == 1:
        _insert_row(plan, tasks[0], then)
        return
    # mysqlclient, and psycopg with client-side binding (Django's default), merge parameters into
    # the statement in Python, psycopg parsing every placeholder of it: rendering batch-wide
    # constants into the SQL once saves most of that. SQLite binds natively and gains nothing.
    connection.ensure_connection()  # the driver's own quoting needs a connection
    literal = _literal_renderer(connection.vendor, connection.connection)
    columns: list[str] = []
    marks: list[str] = []
    types: list[str] = []
    varying: list[list[Any]] = []
    for col in plan.columns:
        name, adapt, mark = col.attname, col.adapt, col.mark
        values = [_payload_getter(t) for t in tasks] if name == "payload" else list(map(attrgetter(name), tasks))
        if (col.is_default is not None or literal is not None) and _constant(values):
            if col.is_default is not None and col.is_default(values[0]):
                continue  # the database's default
            if literal is not None:
                columns.append(col.quoted)
                marks.append(mark.replace("%s", literal(adapt(values[0]))))
                types.append(col.db_type)
                continue
        columns.append(col.quoted)
        marks.append(mark)
        types.append(col.db_type)
        varying.append(values if adapt is _as_is else list(map(adapt, values)))
    head = f"INSERT INTO {plan.table} ({', '.join(columns)}) "
    if connection.vendor == "postgresql":
        # One array per varying column (unnest): a short statement PostgreSQL parses at once,
        # where a VALUES list of thousands of casts took it longer to plan than to write.
        casts, selected = [], []
        for mark, db_type in zip(marks, types, strict=True):
            if "%s" in mark:
                casts.append(f"CAST(%s AS {db_type}[])")
                selected.append(f"u.c{len(casts)}")
            else:
                selected.append(mark)
        aliases = ", ".join(f"c{n}" for n in range(1, len(casts) + 1))
        source = f"unnest({', '.join(casts)}) AS u({aliases})"
        statement = f"{head}SELECT {', '.join(selected)} FROM {source}"
        params = varying
    else:
        params = list(chain.from_iterable(zip(*varying, strict=True))) if varying else []
        row_sql = "(" + ", ".join(marks) + ")"
        statement = head + "VALUES " + ", ".join([row_sql] * len(tasks))
    if then is not None:
        statement, params = f"{statement}; {then[0]}", [*params, *then[1]]
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
    for task in tasks:
        task._state.adding = False
        task._state.db = connection.alias


def _insert_row(plan: InsertPlan, task: Task, then: tuple[str, list[Any]] | None) -> None:
    """insert_batch of one row: the columns not at their database default, each a parameter."""
    values = task.__dict__
    params = []
    left_out = 0  # a bit per column at the database's default: the statement's key
    for bit, name, is_default, adapt in plan.row_steps:
        value = values[name]
        if is_default is not None and is_default(value):
            left_out |= bit
        else:
            params.append(_payload_getter(task) if name == "payload" else adapt(value))
    statement = plan.row_statements.get(left_out)
    if statement is None:
        statement = plan.row_statements[left_out] = plan.row_statement(left_out)
    if then is not None:
        statement, params = f"{statement}; {then[0]}", [*params, *then[1]]
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
    task._state.adding = False
    task._state.db = connection.alias


def _constant(values: list[Any]) -> bool:
    """Whether every value of a column is stored as the first one is (see same_value), checked in C where it can be."""
    first = values[0]
    if values.count(first) != len(values):  # == is looser than same_value, never stricter
        return False
    kind = type(first)
    if kind in (dict, list, tuple) and not first:  # equal to an empty one: empty
        return len(set(map(type, values))) == 1
    if kind in (dict, list, tuple, float):
        return all(same_value(value, first) for value in values)
    return len(set(map(type, values))) == 1


def insert_batches(tasks: list[Task]) -> list[list[Task]]:
    """`tasks` split into the multi-row INSERTs that `insert_tasks` sends: INSERT_BATCH rows or INSERT_BYTES each."""
    if len(tasks) <= 1:
        return [tasks] if tasks else []
    batches: list[list[Task]] = [[]]
    size = 0
    for task in tasks:
        row_size = ROW_BYTES + len(_payload_getter(task) or "") + (len(json_to_db(task.context)) if task.context else 2)
        if batches[-1] and (len(batches[-1]) >= INSERT_BATCH or size + row_size > INSERT_BYTES):
            batches.append([])
            size = 0
        batches[-1].append(task)
        size += row_size
    return batches


def _payload_getter(task: Task) -> Any:
    # Validation already serialised the payload; do not do it twice per task.
    text = task.__dict__.get("_payload_text")
    return text if text is not None else json_to_db(task.payload)


@dataclass(frozen=True)
class InsertColumn:
    """One column of the task INSERT: how its value is converted and marked, and whether the database fills it."""

    attname: str
    quoted: str
    adapt: Adapter
    mark: str
    db_type: str  # for PostgreSQL's arrays (unnest)
    is_default: Callable[[Any], bool] | None  # whether a value is what the database fills in (None: it fills none)


@dataclass
class InsertPlan:
    """The task INSERT's fixed parts for one vendor and table, and its single-row statements by columns left out."""

    table: str
    columns: list[InsertColumn]
    row_statements: dict[int, str] = field(default_factory=dict)
    # What _insert_row reads per column, unpacked: its bit in the statement's key, name, tests.
    row_steps: list[tuple[int, str, Callable[[Any], bool] | None, Adapter]] = field(init=False)

    def __post_init__(self) -> None:
        self.row_steps = [(1 << i, c.attname, c.is_default, c.adapt) for i, c in enumerate(self.columns)]

    def row_statement(self, left_out: int) -> str:
        kept = [col for bit, col in enumerate(self.columns) if not left_out >> bit & 1]
        names = ", ".join(col.quoted for col in kept)
        return f"INSERT INTO {self.table} ({names}) VALUES ({', '.join(col.mark for col in kept)})"


@cache
def _insert_plan(vendor: str, time_zone: str | None, table: str) -> InsertPlan:
    """The INSERT's fixed parts for one vendor and table (connection-independent, so cached by those).

    The payload's values are already its JSON text, as validation left it (_payload_getter).
    """
    columns = []
    zone = connection.timezone if vendor != "postgresql" and time_zone is not None else None
    for f in Task._meta.concrete_fields:
        adapt = to_db(f.name)
        if zone is not None and adapt is datetime_to_db:
            # What Django's adapter does for MySQL and SQLite, without its per-call settings lookups.
            adapt = _naive_text(zone)
        if f.attname == "payload":
            adapt = _as_is
        # A nullable column without a db_default defaults to NULL on every database.
        is_default = _default_test(f, adapt) if f.has_db_default() else (_is_none if f.null else None)
        columns.append(
            InsertColumn(f.attname, quote(f.column), adapt, placeholder(f.name), f.db_type(connection), is_default)
        )
    return InsertPlan(quote(table), columns)


def _is_none(value: Any) -> bool:
    return value is None


def _default_test(model_field: Any, adapt: Adapter) -> Callable[[Any], bool]:
    """A test of whether a value is stored exactly as the field's db_default (so the INSERT may leave it out)."""
    default = model_field.db_default
    default = getattr(default, "value", default)  # Value("{}") for JSON text
    if model_field.get_internal_type() == "JSONField":
        empty = type(json.loads(default))  # "{}" or "[]": an empty dict or list, nothing else
        assert not json.loads(default), "only an empty JSON default can be recognised cheaply"
        return lambda value: type(value) is empty and not value
    stored = _text_to_db(default)
    if isinstance(stored, str):
        return lambda value: value == stored and isinstance(value, str)  # a TextChoices member is its value
    kind = type(stored)
    # Types must match: False == 0 and 0.0 == 0, but the database may store them differently.
    return lambda value: value == stored and type(value) is kind


def _naive_text(zone: tzinfo) -> Adapter:
    """Aware datetimes as the naive text, in the connection's time zone, that MySQL and SQLite store."""

    def adapt(value: datetime | None) -> Any:
        if value is None or value.tzinfo is None:
            return datetime_to_db(value)
        return str(value.astimezone(zone).replace(tzinfo=None))

    return adapt


# Short plain values (status, empty strings, zeros, NULL) recur in every row: quote them once.
# Only text whose quoting cannot depend on the connection (charset, NO_BACKSLASH_ESCAPES) is kept.
_LITERALS: dict[tuple[str, type, Any], str] = {}
_LITERALS_MAX = 512
_PLAIN = frozenset(string.ascii_letters + string.digits + " ._:-")


def _literal_renderer(vendor: str, driver: Any) -> Callable[[Any], str] | None:
    """A function rendering a driver value as SQL text for connection `driver` (None where binding is native)."""
    if vendor == "mysql":

        def quote_value(value: Any) -> str:
            rendered = driver.literal(value)
            return rendered.decode() if isinstance(rendered, bytes) else rendered

    elif appends_statements():  # psycopg's client-side binding
        from psycopg.sql import Literal

        def quote_value(value: Any) -> str:
            return Literal(value).as_string(driver)

    else:
        return None

    def render(value: Any) -> str:
        kind = type(value)
        short = value is None or kind is int or kind is bool or (kind is str and len(value) <= 16)
        if short:
            text = _LITERALS.get((vendor, kind, value))
            if text is not None:
                return text
        text = quote_value(value).replace("%", "%%")
        if short and len(_LITERALS) < _LITERALS_MAX and (kind is not str or _PLAIN.issuperset(value)):
            _LITERALS[(vendor, kind, value)] = text
        return text

    return render


# -- identity (keyed enqueue) -------------------------------------------------------------------------


def lock_task_key(task_type: str, key: str, version: int, now: datetime) -> int | None:
    """Take the row lock of an identity's head, raising its version to `version` if that is newer.

    Returns None if the head was created now (a brand-new key: no task of it exists), else the
    newest version after this call: above `version` means `version` is stale. The lock is held
    until the transaction ends, so concurrent requests for one key run one after another.
    """
    take, read = _task_key_statements(connection.vendor)
    at = datetime_to_db(now)
    mysql = connection.vendor == "mysql"
    with connection.cursor() as cursor:
        cursor.execute(take, [task_type, key, version, at, *((version, at) if mysql else ())])
        if cursor.rowcount == 1:
            return None
        cursor.execute(read, [task_type, key] if mysql else [version, at, task_type, key])
        return cursor.fetchone()[0]


@cache
def _task_key_statements(vendor: str) -> tuple[str, str]:
    """lock_task_key's two statements: create the head if missing; read (elsewhere: lock, raise, read) it."""
    qn = quote
    table = qn(TaskKey._meta.db_table)
    where = f"WHERE {qn('task_type')} = %s AND {qn('task_key')} = %s"
    columns = ", ".join(qn(name) for name in ("task_type", "task_key", "version", "updated_at"))
    insert = f"INSERT INTO {table} ({columns}) VALUES (%s, %s, %s, %s)"
    if vendor == "mysql":
        # An upsert takes the exclusive lock of an existing row at once (INSERT IGNORE would take
        # a shared one, and two requests upgrading theirs deadlock). It must always change an
        # existing row, so MySQL reports 2 rows for it, not 1 as for an insert (Django connects
        # with CLIENT_FOUND_ROWS, which counts an unchanged row as 1): updated_at moves forward.
        upsert = (
            f"{insert} ON DUPLICATE KEY UPDATE {qn('version')} = GREATEST({qn('version')}, %s), "
            f"{qn('updated_at')} = GREATEST(%s, {qn('updated_at')} + INTERVAL 1 MICROSECOND)"
        )
        return upsert, f"SELECT {qn('version')} FROM {table} {where}"
    # Elsewhere a conflict waits for a concurrent inserter to finish and takes no lock; the UPDATE
    # takes it and returns the version.
    greatest = "GREATEST" if vendor == "postgresql" else "MAX"
    update = (
        f"UPDATE {table} SET {qn('version')} = {greatest}({qn('version')}, %s), {qn('updated_at')} = %s {where} "
        f"RETURNING {qn('version')}"
    )
    return f"{insert} ON CONFLICT DO NOTHING", update


# What a task's outcome is read from (a django.tasks result): its identity, state, data and attempts.
OUTCOME_COLUMNS = (
    "id",
    "task_type",
    "key",
    "version",
    "priority",
    "status",
    "status_msg",
    "payload",
    "result",
    "attempts",
    "max_retries",
    "timeout",
    "worker_id",
    "schedule_log",
    "created_at",
    "started_at",
    "finished_at",
)


def read_outcome(table: str, task_id: int) -> dict[str, Any] | None:
    """OUTCOME_COLUMNS of one task, or None: one SELECT without the ORM, as it is read at every attempt."""
    columns = ", ".join(column(name) for name in OUTCOME_COLUMNS)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {columns} FROM {quote(table)} WHERE {quote('id')} = %s", [task_id])
        values = cursor.fetchone()
    if values is None:
        return None
    row = dict(zip(OUTCOME_COLUMNS, values, strict=True))
    for name in ("payload", "result", "schedule_log"):
        row[name] = json_from_db(row[name])
    to_datetime = datetime_from_db()
    for name in ("created_at", "started_at", "finished_at"):
        row[name] = to_datetime(row[name])
    return row


def find_task(table: str, task_type: str, key: str, version: int) -> Task | None:
    """The task of one identity, if any."""
    qn = quote
    sql = f"SELECT * FROM {qn(table)} WHERE {qn('task_type')} = %s AND {qn('task_key')} = %s AND {qn('version')} = %s"
    return next(iter(Task.objects.raw(sql, [task_type, key, version])), None)


def find_task_noting_history(table: str, task_type: str, key: str, version: int) -> tuple[Task | None, bool]:
    """The task of one identity in `table`, if any, and whether history tables are kept: one statement.

    A keyed enqueue that misses the task table must look in history (rolling.find_identity); the
    count of kept tables rides along so that deployments that never rolled pay no extra round trip.
    """
    qn = quote
    positions = qn(SchedulePos._meta.db_table)
    kept = f"(SELECT COUNT(*) AS {qn('history_tables')} FROM {positions} WHERE {qn('dropped_at')} IS NULL) h"
    columns = ", ".join(f"t.{qn(f.column)}" for f in Task._meta.concrete_fields)
    sql = (
        f"SELECT h.{qn('history_tables')}, {columns} FROM {kept} LEFT JOIN {qn(table)} t "
        f"ON t.{qn('task_type')} = %s AND t.{qn('task_key')} = %s AND t.{qn('version')} = %s"
    )
    rows = list(Task.objects.raw(sql, [task_type, key, version]))
    found = next((task for task in rows if task.pk is not None), None)
    return found, bool(rows and rows[0].history_tables)


def supersede_older_versions(table: str, task_type: str, key: str, version: int, now: datetime) -> int:
    """Mark every live older version of a key as superseded by `version`; pending and waiting ones stop now.

    A running one keeps its attempt: its report reads the mark (lock_attempt_settings, and
    update_attempts for callers that did not) and stops the task instead of queueing it again. One
    statement, so each row is either still waiting (and stopped here) or already running (and
    marked): a report landing in between cannot slip through, and row locks order this statement
    and that report either way.
    """
    qn = quote
    waiting = f"{qn('status')} IN (%s, %s)"  # pending, or waiting for its dependencies
    sql = (
        # MySQL assigns left to right and later expressions see earlier assignments: status last.
        f"UPDATE {qn(table)} SET "
        f"{qn('status_msg')} = CASE WHEN {waiting} THEN %s ELSE {qn('status_msg')} END, "
        f"{qn('finished_at')} = CASE WHEN {waiting} THEN %s ELSE {qn('finished_at')} END, "
        f"{qn('updated_at')} = CASE WHEN {waiting} THEN %s ELSE {qn('updated_at')} END, "
        f"{qn('superseded_by')} = %s, "
        f"{qn('status')} = CASE WHEN {waiting} THEN %s ELSE {qn('status')} END "
        f"WHERE {qn('task_type')} = %s AND {qn('task_key')} = %s AND {qn('version')} < %s "
        f"AND {qn('status')} IN (%s, %s, %s)"
    )
    at, waiting_ = datetime_to_db(now), (Status.PENDING.value, Status.WAITING.value)
    params = [
        *(*waiting_, f"superseded by version {version}"),
        *(*waiting_, at),
        *(*waiting_, at),
        version,
        *(*waiting_, Status.STOPPED.value),
        *(task_type, key, version, *waiting_, Status.PROCESSING.value),
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


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
# What a remote worker's hold also answers of each task (the API shows a held task as GET does), beyond
# CLAIM_COLUMNS and what the claim writes: read by the claim itself (`shown=True`), not again after it.
SHOWN_COLUMNS = ("status_msg", "result", "user_id", "created_at", "finished_at")


# How many pending rows beyond its own batch a claim on MariaDB reads as candidates (see select_due):
# room for the rows other workers are locking at the same moment, and for rows at the head of the
# queue that are not due yet or prefer another host.
CANDIDATE_MARGIN = 200

# Task types whose last claim in this process came back full: their queue is long (see select_due).
_long_queues: set[str] = set()


def select_due(
    table: str, task_type: str, limit: int, host: str, now: datetime, *, shown: bool = False
) -> list[dict[str, Any]]:
    """Lock and read up to `limit` due pending tasks of a type, in scheduling order (skipping locked rows):
    CLAIM_COLUMNS, and SHOWN_COLUMNS too if `shown`.

    On MariaDB a locking scan of the claim index is slow behind a busy queue: every task claimed
    since the last purge leaves a delete-marked entry at the head of the pending range, and a
    locking read checks each against its row (a claim of 100 took 1 ms at the start of a 20,000
    task drain and 8 ms by its middle). So there, behind a long queue, the claim first reads
    candidates without locks (index only: the first `limit` + CANDIDATE_MARGIN pending ids in
    order), then locks those that are still due by primary key. The locked read re-checks every
    condition, so a candidate claimed or changed meanwhile is skipped. When that cannot tell it has
    seen the whole queue (no row, or every candidate read and still short), the plain locking scan
    runs, as elsewhere. Only on MariaDB, where it is tested; MySQL keeps the plain scan.

    A long queue is one whose last claim in this process came back full (`_long_queues`). A short
    queue has few such entries and the plain scan is cheaper: the candidate read costs a derived
    table and a window, and the worker that loses a race for a lone task runs the scan after it
    anyway. With candidates for every claim, start latency p50 at 100 tasks/s was about 0.5 ms higher.
    """
    vendor, skip_locked = connection.vendor, connection.features.has_select_for_update_skip_locked
    at = connection.ops.adapt_datetimefield_value(now)
    due = _due_params(task_type, host, at)
    rows: list[tuple[Any, ...]] = []
    with connection.cursor() as cursor:
        if task_type in _long_queues and vendor == "mysql" and skip_locked and connection.mysql_is_mariadb:
            candidates = limit + CANDIDATE_MARGIN
            params = [Status.PENDING.value, task_type, candidates, *due, limit]
            cursor.execute(_select_candidates_sql(table, bool(host), shown), params)
            found = cursor.fetchall()
            if len(found) == limit or (found and found[0][-1] < candidates):
                rows = [values[:-1] for values in found]  # all it wanted, or all the queue holds
        if not rows:
            cursor.execute(_select_due_sql(vendor, table, bool(host), skip_locked, shown), [*due, limit])
            rows = cursor.fetchall()
    if len(rows) == limit:
        _long_queues.add(task_type)
    else:
        _long_queues.discard(task_type)
    return _rows_read(_claim_columns(shown), rows)


def _claim_columns(shown: bool) -> tuple[str, ...]:
    return (*CLAIM_COLUMNS, *SHOWN_COLUMNS) if shown else CLAIM_COLUMNS


# The columns a claim or a hold reads that are converted from what the driver gives (see _rows_read).
_JSON_READ = {*_JSON_COLUMNS, "result"}
_DATETIME_COLUMNS = {"run_after", "started_at", "lease_expires_at", "created_at", "updated_at", "finished_at"}


def _rows_read(columns: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Rows read of these task columns as dicts: JSON decoded, times made aware, the rest as the driver gives them."""
    json_columns = _JSON_READ.intersection(columns)
    datetime_columns = _DATETIME_COLUMNS.intersection(columns)
    to_datetime = datetime_from_db()
    out = []
    for values in rows:
        row = dict(zip(columns, values, strict=True))
        for name in json_columns:
            row[name] = json_from_db(row[name])
        for name in datetime_columns:
            row[name] = to_datetime(row[name])
        out.append(row)
    return out


def _due_params(task_type: str, host: str, at: Any) -> list[Any]:
    """_due_where's parameters: pending, this type, due at `at` (the driver's value), and the host if any."""
    return [Status.PENDING.value, task_type, at, at, *([host] if host else [])]


def _due_where(with_host: bool, prefix: str = "") -> str:
    """The conditions of a due pending task of a type (parameters: _due_params)."""
    qn = quote
    hosts = f"{prefix}{qn('prefer_host')} = '' OR {prefix}{qn('prefer_host_until')} <= %s"
    if with_host:
        hosts += f" OR {prefix}{qn('prefer_host')} = %s"
    kind = f"{prefix}{qn('status')} = %s AND {prefix}{qn('task_type')} = %s"
    return f"{kind} AND {prefix}{qn('run_after')} <= %s AND ({hosts})"


@cache
def _select_due_sql(vendor: str, table: str, with_host: bool, skip_locked: bool, shown: bool) -> str:
    """select_due's statement, built once per shape: a claim runs it many times a second."""
    qn = quote
    columns = ", ".join(column(name) for name in _claim_columns(shown))
    lock = " FOR UPDATE SKIP LOCKED" if skip_locked else ""
    return f"SELECT {columns} FROM {qn(table)} WHERE {_due_where(with_host)} ORDER BY {qn('order_time')} LIMIT %s{lock}"


@cache
def _select_candidates_sql(table: str, with_host: bool, shown: bool) -> str:
    """select_due's statement on MariaDB: candidates read from the claim index alone, then locked by primary key.

    The derived table is read first (STRAIGHT_JOIN) and in order, so rows are locked one candidate
    at a time until the batch is full, not every candidate. Each row also carries how many
    candidates there were, for select_due to tell whether it saw the whole queue.
    """
    qn = quote
    columns = ", ".join(f"t.{column(name)}" for name in _claim_columns(shown))
    first = (
        f"SELECT {qn('id')}, {qn('order_time')} FROM {qn(table)} "
        f"WHERE {qn('status')} = %s AND {qn('task_type')} = %s ORDER BY {qn('order_time')} LIMIT %s"
    )
    # Counted over the first ones only: a window at the level of the LIMIT would count the whole queue.
    candidates = f"SELECT {qn('id')}, {qn('order_time')}, COUNT(*) OVER () AS {qn('seen')} FROM ({first}) AS f"
    return (
        f"SELECT STRAIGHT_JOIN {columns}, c.{qn('seen')} FROM ({candidates}) AS c "
        f"JOIN {qn(table)} AS t ON t.{qn('id')} = c.{qn('id')} WHERE {_due_where(with_host, 't.')} "
        f"ORDER BY c.{qn('order_time')}, c.{qn('id')} LIMIT %s FOR UPDATE SKIP LOCKED"
    )


def select_held(table: str, ids: Sequence[int], worker_id: str, columns: Sequence[str]) -> list[dict[str, Any]]:
    """`columns` of the tasks among `ids` processing for `worker_id` (JSON and times converted), one query.

    What a remote worker's report, checkpoint or beat reads of the attempts it names: written out
    rather than built by the ORM, whose query building cost more than the query on every call.
    """
    head, tail = _select_held_sql(table, tuple(columns))
    with connection.cursor() as cursor:
        cursor.execute(head + ", ".join(["%s"] * len(ids)) + tail, [*ids, Status.PROCESSING.value, worker_id])
        rows = cursor.fetchall()
    return _rows_read(columns, rows)


@cache
def _select_held_sql(table: str, columns: tuple[str, ...]) -> tuple[str, str]:
    """The statement before and after the id placeholders (names are looked up once, not per call)."""
    qn = quote
    head = f"SELECT {', '.join(column(name) for name in columns)} FROM {qn(table)} WHERE {qn('id')} IN ("
    return head, f") AND {qn('status')} = %s AND {qn('worker_id')} = %s"


def claims_in_one_statement() -> bool:
    """Whether `claim_due` works here: a locked read and its UPDATE in one statement (UPDATE ... RETURNING)."""
    return connection.vendor == "postgresql"


def claim_due(
    table: str,
    task_type: str,
    limit: int,
    host: str,
    worker_id: str,
    now: datetime,
    default_timeout: int,
    *,
    shown: bool = False,
) -> list[dict[str, Any]]:
    """`select_due` and `mark_processing` in one statement (see claims_in_one_statement), one round trip.

    Returns the rows as `select_due` does plus `order_time`, with `attempts` and `lease_token`
    already counted; each deadline is `now` plus the task's timeout, else `default_timeout`.
    """
    qn = quote
    read = _claim_columns(shown)
    columns = ", ".join(f"t.{column(name)}" for name in (*read, "order_time"))
    at = connection.ops.adapt_datetimefield_value(now)
    where = _due_params(task_type, host, at)
    sql = (
        f"WITH due AS MATERIALIZED (SELECT {qn('id')} FROM {qn(table)} WHERE {_due_where(bool(host))} "
        f"ORDER BY {qn('order_time')} LIMIT %s FOR UPDATE SKIP LOCKED) "
        f"UPDATE {qn(table)} t SET {qn('status')} = %s, "
        f"{qn('attempts')} = t.{qn('attempts')} + 1, {qn('lease_token')} = t.{qn('lease_token')} + 1, "
        f"{qn('worker_id')} = %s, {qn('started_at')} = %s, {qn('heartbeat_at')} = %s, "
        f"{qn('lease_expires_at')} = CAST(%s AS timestamp with time zone)"
        f" + COALESCE(NULLIF(t.{qn('timeout')}, 0), %s) * INTERVAL '1 second', {qn('updated_at')} = %s "
        f"FROM due WHERE t.{qn('id')} = due.{qn('id')} RETURNING {columns}"
    )
    params = [*where, limit, Status.PROCESSING.value, worker_id, at, at, at, default_timeout, at]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    out = _rows_read((*read, "order_time"), rows)
    out.sort(key=lambda row: (row["order_time"], row["id"]))  # RETURNING keeps no order
    return out


def mark_processing(
    table: str,
    ids: Sequence[int],
    worker_id: str,
    now: datetime,
    deadline: datetime,
    *,
    reserved: Collection[int] = (),
) -> int:
    """Start an attempt of each still-pending task in `ids`: count it, bump its fencing token, set its deadline.

    Those also in `reserved` (claimed ahead) keep `started_at` NULL until mark_started; one statement
    either way, so a claim that starts some and reserves others is still one UPDATE.
    """
    adapt = connection.ops.adapt_datetimefield_value
    at = adapt(now)
    head, tail = _mark_processing_sql(connection.vendor, table)
    if not reserved:
        started_sql, started_params = "%s", [at]
    elif len(reserved) >= len(ids):
        started_sql, started_params = "NULL", []
    else:
        started_sql, started_params = f"CASE WHEN {quote('id')} IN ({id_list(reserved)}) THEN NULL ELSE %s END", [at]
    sql = f"{head}{started_sql}{tail.format(ids=id_list(ids))}"
    params = [Status.PROCESSING.value, worker_id, *started_params, at, adapt(deadline), at, Status.PENDING.value]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


@cache
def _mark_processing_sql(vendor: str, table: str) -> tuple[str, str]:
    """mark_processing's statement, built once: the text before `started_at`'s value, and after it ({ids} to fill)."""
    qn = quote
    head = (
        f"UPDATE {qn(table)} SET {qn('status')} = %s, "
        f"{qn('attempts')} = {qn('attempts')} + 1, {qn('lease_token')} = {qn('lease_token')} + 1, "
        f"{qn('worker_id')} = %s, {qn('started_at')} = "
    )
    tail = (
        f", {qn('heartbeat_at')} = %s, {qn('lease_expires_at')} = %s, {qn('updated_at')} = %s "
        f"WHERE {qn('id')} IN ({{ids}}) AND {qn('status')} = %s"
    )
    return head, tail


def mark_started(table: str, ids: Sequence[int], token: int, worker_id: str, now: datetime) -> int:
    """Start the reserved attempts (`started_at` NULL) of these tasks still held by `worker_id` under `token`."""
    qn = quote
    sql = (
        f"UPDATE {qn(table)} SET {qn('started_at')} = %s "
        f"WHERE {qn('id')} IN ({id_list(ids)}) AND {qn('status')} = %s AND {qn('lease_token')} = %s "
        f"AND {qn('worker_id')} = %s AND {qn('started_at')} IS NULL"
    )
    params = [connection.ops.adapt_datetimefield_value(now), Status.PROCESSING.value, token, worker_id]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def ids_held(table: str, ids: Sequence[int], token: int, worker_id: str) -> list[int]:
    """Which of these tasks `worker_id` still holds under `token` (processing, held by the attempt it names)."""
    qn = quote
    marks = ", ".join(["%s"] * len(ids))
    sql = (
        f"SELECT {qn('id')} FROM {qn(table)} WHERE {qn('id')} IN ({marks}) AND {qn('status')} = %s "
        f"AND {qn('lease_token')} = %s AND {qn('worker_id')} = %s"
    )
    params = [*ids, Status.PROCESSING.value, token, worker_id]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return [row[0] for row in cursor.fetchall()]


# -- reports ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Guard:
    """An extra condition on a guarded update, beyond `status = 'processing' AND lease_token = ?`."""

    sql: str = ""
    params: tuple[Any, ...] = field(default=())

    @classmethod
    def past_deadline(cls) -> Guard:
        """Only attempts past their deadline by the database's clock: a heartbeat that just extended it wins."""
        now, params = now_sql()
        return cls(f"{column('lease_expires_at')} < {now}", tuple(params))

    @classmethod
    def worker_silent(cls, table: str, timeout: float) -> Guard:
        """Only attempts whose worker has not beaten for `timeout` seconds by the database's clock, now.

        A worker that was only stalled and beat again after the rescuer read its rows keeps its tasks.
        An attempt of a worker without a liveness row must itself have been silent that long.
        """
        workers = quote(WorkerProcess._meta.db_table)
        cutoff, params = now_sql(-timeout)
        same_worker = f"{workers}.{quote('worker_id')} = {quote(table)}.{column('worker_id')}"
        beat = f"{workers}.{quote('heartbeat_at')}"
        return cls(
            f"NOT EXISTS (SELECT 1 FROM {workers} WHERE {same_worker} AND {beat} >= {cutoff})"
            f" AND ({quote(table)}.{column('heartbeat_at')} < {cutoff}"
            f" OR EXISTS (SELECT 1 FROM {workers} WHERE {same_worker}))",
            (*params, *params),
        )

    def unstarted(self) -> Guard:
        """This guard, and only attempts still unstarted (`started_at` NULL).

        A hand-back decided from a row read as reserved must not land on an attempt its worker
        started since: that attempt counts, and a handler may be running it.
        """
        clause = f"{column('started_at')} IS NULL"
        return Guard(f"({self.sql}) AND {clause}" if self.sql else clause, self.params)


NO_GUARD = Guard()


# -- the database's clock -------------------------------------------------------------------------------


def now_sql(shift: float = 0.0) -> tuple[str, list[Any]]:
    """SQL for the database's current time plus `shift` seconds (UTC, as datetimes are stored), and its parameters.

    Liveness and deadlines are compared on this one clock, so hosts whose clocks disagree cannot
    make a live worker look dead.
    """
    if connection.vendor == "postgresql":
        return "(STATEMENT_TIMESTAMP() + %s * INTERVAL '1 second')", [shift]
    if connection.vendor == "mysql":
        # UTC_TIMESTAMP, not NOW(): Django stores naive UTC whatever the session's time zone is.
        return "(UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND)", [round(shift * 1_000_000)]
    # SQLite stores datetimes as ISO text, which compares in time order.
    return "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)", [f"{shift:+.6f} seconds"]


def database_now(shift: float = 0.0) -> RawSQL:
    """The database's current time plus `shift` seconds, as an ORM expression (for filters and updates)."""
    now, params = now_sql(shift)
    return RawSQL(now, params, output_field=DateTimeField())


def update_attempts(
    table: str,
    rows: dict[int, dict[str, Any]],
    token: int,
    guard: Guard = NO_GUARD,
    *,
    unless_waited_for: bool = False,
) -> int:
    """One UPDATE of many running attempts that share a fencing token; returns the rows changed.

    `unless_waited_for` leaves out the rows of tasks that other tasks wait for (an open dependency
    edge, read by the statement itself): a write that changes every row needs no release step.

    Columns equal across the rows are set once, the others through `CASE id`. Only rows still
    `processing` under `token` (and matching `guard`) change, so a late report changes nothing.
    A row going back to pending whose task was superseded by a newer version meanwhile is stopped
    instead (see supersede_older_versions): the UPDATE reads the mark under the row lock, so an
    enqueue committing between the report's decision and this statement cannot be missed.
    """
    qn = quote
    ids = list(rows)
    requeued = [i for i in ids if rows[i].get("status") == Status.PENDING]
    assignments: list[str] = []
    params: list[Any] = []
    columns = list(next(iter(rows.values())))
    if requeued and "finished_at" not in columns:
        columns.append("finished_at")
    for name in columns:
        convert, mark = to_db(name), placeholder(name)
        if name not in rows[ids[0]]:
            value_sql, value_params = column(name), []  # added only to be set when superseded
        else:
            values = [rows[i][name] for i in ids]
            first = values[0]
            if _constant(values):
                value_sql, value_params = mark, [convert(first)]
            else:
                value_sql = f"CASE {qn('id')} {' '.join([f'WHEN {int(i)} THEN {mark}' for i in ids])} END"
                value_params = [convert(v) for v in values]
        if requeued and name in ("status", "status_msg", "finished_at"):
            superseded = f"{qn('superseded_by')} IS NOT NULL"
            superseded_params: list[Any] = []
            if len(requeued) < len(ids):
                superseded += f" AND {qn('id')} IN ({', '.join(['%s'] * len(requeued))})"
                superseded_params = list(requeued)
            stopped_sql, stopped_params = _superseded_value(name, rows[requeued[0]]["updated_at"])
            value_sql = f"CASE WHEN {superseded} THEN {stopped_sql} ELSE {value_sql} END"
            value_params = [*superseded_params, *stopped_params, *value_params]
        assignments.append(f"{column(name)} = {value_sql}")
        params.extend(value_params)
    where = f"{qn('id')} IN ({id_list(ids)}) AND {qn('status')} = %s AND {qn('lease_token')} = %s"
    params.extend((Status.PROCESSING.value, token))
    if guard.sql:
        where += f" AND ({guard.sql})"
        params.extend(guard.params)
    if unless_waited_for:
        edges = qn(TaskDependency._meta.db_table)
        where += (
            f" AND NOT EXISTS (SELECT 1 FROM {edges} WHERE {edges}.{qn('outcome')} = ''"
            f" AND {edges}.{qn('depends_on_id')} = {qn(table)}.{qn('id')})"
        )
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {qn(table)} SET {', '.join(assignments)} WHERE {where}", params)
        return cursor.rowcount


def lock_attempt_settings(table: str, ids: Iterable[int]) -> dict[int, tuple[int, int | None, int | None]]:
    """Lock these tasks' rows and read what an operator or a newer version may change while they run.

    Returns {id: (priority, max_retries, superseded_by)}. Called in the transaction that then writes
    their attempts' ends, so a change committed before is seen and one committed after waits for it
    (on SQLite the IMMEDIATE transaction already holds the write lock). Rows locked in id order.
    """
    qn = quote
    ids = sorted(ids)
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    sql = (
        f"SELECT {qn('id')}, {qn('priority')}, {qn('max_retries')}, {qn('superseded_by')} FROM {qn(table)} "
        f"WHERE {qn('id')} IN ({', '.join(['%s'] * len(ids))}) ORDER BY {qn('id')}{lock}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, ids)
        return {row[0]: (row[1], row[2], row[3]) for row in cursor.fetchall()}


def _superseded_value(name: str, now: datetime) -> tuple[str, list[Any]]:
    """What a superseded task's column becomes instead of being queued again."""
    if name == "status":
        return "%s", [Status.STOPPED.value]
    if name == "finished_at":
        return "%s", [datetime_to_db(now)]
    return _concat("'superseded by version '", column("superseded_by")), []


def _concat(*parts: str) -> str:
    return f"CONCAT({', '.join(parts)})" if connection.vendor == "mysql" else " || ".join(parts)


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
        if len(changing) == len(ids) and all(same_value(v, values[0]) for v in values):
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


# -- errors ------------------------------------------------------------------------------------------

_MYSQL_LOCK_CONFLICTS = {1205, 1213}  # lock wait timeout, deadlock
_POSTGRES_LOCK_CONFLICTS = {"40001", "40P01", "55P03"}  # serialization failure, deadlock, lock timeout


def is_lock_conflict(exc: BaseException) -> bool:
    """Whether a database error says the statement waited too long for, or lost to, another's locks.

    Run again later, such a statement may well succeed: it says nothing about the values it carried.
    """
    if connection.vendor == "mysql":
        return bool(exc.args) and exc.args[0] in _MYSQL_LOCK_CONFLICTS
    if connection.vendor == "postgresql":
        return getattr(exc.__cause__, "sqlstate", None) in _POSTGRES_LOCK_CONFLICTS
    return "is locked" in str(exc)  # SQLite: "database is locked", "database table is locked"


# -- rolling: moving rows between the hot table and history tables ---------------------------------------

FINISHED_STATUSES = (Status.SUCCESS.value, Status.FAILED.value, Status.STOPPED.value)


def _all_columns() -> str:
    return ", ".join(quote(f.column) for f in Task._meta.concrete_fields)


def _in(ids: Sequence[int]) -> str:
    # "IN ()" is SQLite's only: elsewhere an empty list would be a syntax error, not "no rows".
    return f"{quote('id')} IN ({', '.join(['%s'] * len(ids))})" if ids else "1 = 0"


def lock_rollable(table: str, cutoff: datetime, limit: int) -> list[tuple[int, datetime]]:
    """Lock up to `limit` finished tasks that finished before `cutoff`, skipping locked rows: (id, finished_at).

    One statement per finished status, so each reads a prefix of the (status, finished_at) index.
    """
    qn = quote
    lock = ""
    if connection.features.has_select_for_update:
        lock = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else " FOR UPDATE"
    sql = (
        f"SELECT {qn('id')}, {qn('finished_at')} FROM {qn(table)} "
        f"WHERE {qn('status')} = %s AND {qn('finished_at')} < %s LIMIT %s{lock}"
    )
    to_datetime = datetime_from_db()
    out: list[tuple[int, datetime]] = []
    with connection.cursor() as cursor:
        for status in FINISHED_STATUSES:
            if len(out) >= limit:
                break
            cursor.execute(sql, [status, datetime_to_db(cutoff), limit - len(out)])
            for task_id, at in cursor.fetchall():
                at = to_datetime(at)
                out.append((task_id, at if at.tzinfo else at.replace(tzinfo=UTC)))  # SQLite may hand back naive UTC
    return out


def count_rollable(table: str, cutoff: datetime) -> int:
    """How many finished tasks finished before `cutoff`."""
    qn = quote
    sql = f"SELECT COUNT(*) FROM {qn(table)} WHERE {qn('status')} IN (%s, %s, %s) AND {qn('finished_at')} < %s"
    with connection.cursor() as cursor:
        cursor.execute(sql, [*FINISHED_STATUSES, datetime_to_db(cutoff)])
        return cursor.fetchone()[0]


def copy_tasks(source: str, target: str, ids: Sequence[int]) -> int:
    """Copy the rows of `ids` from one task table to another (same columns, by name); returns the rows copied."""
    columns = _all_columns()
    sql = f"INSERT INTO {quote(target)} ({columns}) SELECT {columns} FROM {quote(source)} WHERE {_in(ids)}"
    with connection.cursor() as cursor:
        cursor.execute(sql, list(ids))
        return cursor.rowcount


def delete_tasks(table: str, ids: Sequence[int]) -> int:
    """Delete the rows of `ids` from a task table; returns the rows deleted."""
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {quote(table)} WHERE {_in(ids)}", list(ids))
        return cursor.rowcount


def ids_after(table: str, after: int, limit: int) -> list[int]:
    """The next `limit` task ids of a task table above `after`, in order (walks a table by its primary key)."""
    sql = f"SELECT {quote('id')} FROM {quote(table)} WHERE {quote('id')} > %s ORDER BY {quote('id')} LIMIT %s"
    with connection.cursor() as cursor:
        cursor.execute(sql, [after, limit])
        return [row[0] for row in cursor.fetchall()]


def read_tasks(table: str, ids: Sequence[int]) -> list[Task]:
    """The tasks of `ids` that a task table holds, as (unsaved-looking) Task objects."""
    if not ids:
        return []  # "IN ()" is not SQL
    sql = f"SELECT {_all_columns()} FROM {quote(table)} WHERE {_in(ids)}"
    return list(Task.objects.raw(sql, list(ids)))


def find_identity(tables: dict[int, str], task_type: str, key: str, version: int) -> Task | None:
    """The task of one identity in any of `tables` ({position: table}), one UNION ALL of index lookups.

    The task found carries `history_position`, the position of the table it was found in.
    """
    qn = quote
    where = f"WHERE {qn('task_type')} = %s AND {qn('task_key')} = %s AND {qn('version')} = %s"
    parts, params = [], []
    for position, table in tables.items():
        parts.append(f"SELECT {int(position)} AS {qn('history_position')}, {_all_columns()} FROM {qn(table)} {where}")
        params += [task_type, key, version]
    if not parts:
        return None
    return next(iter(Task.objects.raw(" UNION ALL ".join(parts), params)), None)


def versions_of_key(tables: dict[int, str], task_type: str, key: str, limit: int) -> list[Task]:
    """The newest `limit` versions of one key in `tables` ({position: table}), with `history_position`."""
    qn = quote
    columns = ", ".join(column(name) for name in ("id", "task_type", "key", "version", "status", "created_at"))
    where = f"WHERE {qn('task_type')} = %s AND {qn('task_key')} = %s"
    parts, params = [], []
    for position, table in tables.items():
        parts.append(f"SELECT {int(position)} AS {qn('history_position')}, {columns} FROM {qn(table)} {where}")
        params += [task_type, key]
    if not parts:
        return []
    sql = f"{' UNION ALL '.join(parts)} ORDER BY {qn('version')} DESC LIMIT %s"
    return list(Task.objects.raw(sql, [*params, limit]))


def page_of_tasks(
    table: str, columns: Sequence[str], *, task_type: str = "", status: str = "", before_id: int | None, limit: int
) -> list[Task]:
    """Up to `limit` tasks of a task table, newest id first, below `before_id`, optionally of one type and status."""
    qn = quote
    conditions, params = [], []
    if task_type:
        conditions.append(f"{qn('task_type')} = %s")
        params.append(task_type)
    if status:
        conditions.append(f"{qn('status')} = %s")
        params.append(status)
    if before_id is not None:
        conditions.append(f"{qn('id')} < %s")
        params.append(before_id)
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    selected = ", ".join(column(name) for name in columns)
    sql = f"SELECT {selected} FROM {qn(table)}{where} ORDER BY {qn('id')} DESC LIMIT %s"
    return list(Task.objects.raw(sql, [*params, limit]))

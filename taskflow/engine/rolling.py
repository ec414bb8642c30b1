"""Table rolling: old finished tasks move out of the hot task table into numbered history tables, dropped whole.

Workers claim from the hot table (`taskflow_task`); however many tasks a day run, it holds only
live tasks and recent history. `roll()` moves finished tasks whose `finished_at` is older than
ROLL_AFTER into `<task table>_<n>` (same columns), ROLL_BATCH rows per transaction; it starts
table n + 1 when table n holds ROLL_MAX_ROWS rows or is older than ROLL_TABLE_SECONDS, and drops a
table once the newest task in it finished ROLL_RETENTION_DAYS ago. SchedulePos has one row per
history table: its position, when it started, how many rows it holds, the range of ids in it and
its newest `finished_at`.

Rolling is for all task types at once: the hot table is shared by every type, so one set of
history tables keeps the number of tables (and DDL) small and retention a matter of time alone.

Crash safety (docs/rolling.md): each batch copies, deletes and counts in one transaction, so a
kill -9 anywhere leaves every task in exactly one table; creating and dropping a table (DDL, not
transactional on MySQL) is recorded in SchedulePos first and finished by the next run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.apps.registry import Apps
from django.db import DatabaseError, IntegrityError, connection, models, transaction
from django.db.models import F, Q
from django.utils import timezone

from ..conf import get_settings
from ..models import SchedulePos, Task, TaskDependency, TaskEvent
from . import sql

log = logging.getLogger("taskflow.roll")

BATCH_PAUSE = 0.05  # seconds between batches, so workers' claims and reports get the table in between
RACE_RETRIES = 3  # reads that lost a race with a move, a restore or a drop try again this often
FIND_BATCH = 1000  # ids per query of a lookup
DROP_BATCH = 1000  # tasks whose edges and events are deleted per statement before their table is dropped

KeepGoing = Callable[[], bool]


def _always() -> bool:
    return True


class RollError(RuntimeError):
    """A batch found the tables in a state rolling never leaves them in; its transaction was undone."""


@dataclass
class RollResult:
    """What a roll did (or, dry, would do): tasks moved, tables started and dropped."""

    moved: int = 0
    started: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    dry_run: bool = False

    def __str__(self) -> str:
        verb = "would move" if self.dry_run else "moved"
        started = ", ".join(self.started) or "none"
        dropped = ", ".join(self.dropped) or "none"
        start_verb, drop_verb = ("would start", "would drop") if self.dry_run else ("started", "dropped")
        return f"{verb} {self.moved} task(s); {start_verb} {started}; {drop_verb} {dropped}"


# -- the tables -------------------------------------------------------------------------------------


def history_table(position: int) -> str:
    """The name of history table `position`: the task table's name and the number."""
    return f"{sql.task_table()}_{position}"


def kept() -> models.QuerySet[SchedulePos]:
    """The history tables not dropped, oldest first."""
    return SchedulePos.objects.filter(dropped_at__isnull=True).order_by("position")


_history_apps = Apps()  # history models live outside the app registry: migrations never see them
_history_models: dict[tuple[type[models.Model], str], type[models.Model]] = {}  # by (task model, table)


def history_model(table: str, task_model: type[models.Model] = Task) -> type[models.Model]:
    """A model of one history table: the task model's columns, and indexes for identity and browsing only."""
    fields = tuple(task_model._meta.local_concrete_fields)
    cache_key = (task_model, table)
    if cache_key in _history_models:
        return _history_models[cache_key]
    attrs: dict[str, Any] = {"__module__": __name__, **{f.name: f.clone() for f in fields}}
    meta = type(
        "Meta",
        (),
        {
            "app_label": "taskflow",
            "db_table": table,
            "apps": _history_apps,
            "indexes": [
                models.Index(fields=["task_type", "key", "version"], name=f"{table}_identity"),
                models.Index(fields=["task_type", "id"], name=f"{table}_type"),
            ],
        },
    )
    attrs["Meta"] = meta
    name = f"History{len(_history_models)}"
    model = type(name, (models.Model,), attrs)
    _history_models[cache_key] = model
    return model


def sync_table(position: int, task_model: type[models.Model] = Task) -> list[str]:
    """Create history table `position` if missing, and give it the task model's columns and its indexes.

    Idempotent, so it also finishes a creation a crash interrupted (on MySQL each DDL statement
    commits by itself). Returns what it changed, as readable lines.
    """
    table = history_table(position)
    model = history_model(table, task_model)
    changes: list[str] = []
    with connection.cursor() as cursor:
        exists = table in connection.introspection.table_names(cursor)
    if not exists:
        with connection.schema_editor() as editor:
            editor.create_model(model)
        return [f"created {table}"]
    with connection.cursor() as cursor:
        have = {c.name for c in connection.introspection.get_table_description(cursor, table)}
        constraints = connection.introspection.get_constraints(cursor, table)
    wanted = {f.column: f for f in model._meta.local_concrete_fields}
    with connection.schema_editor() as editor:
        for column, model_field in wanted.items():
            if column not in have:
                editor.add_field(model, model_field)
                changes.append(f"added {table}.{column}")
        for column in sorted(have - set(wanted)):
            editor.execute(
                editor.sql_delete_column % {"table": editor.quote_name(table), "column": editor.quote_name(column)}
            )
            changes.append(f"removed {table}.{column}")
        for index in model._meta.indexes:
            if index.name not in constraints:
                editor.add_index(model, index)
                changes.append(f"indexed {table} ({index.name})")
    return changes


def sync_history_tables(task_model: type[models.Model] = Task) -> list[str]:
    """Give every kept history table the task model's columns (run after each `migrate`); returns the changes."""
    changes: list[str] = []
    for pos in kept():
        changes += sync_table(pos.position, task_model)
    for line in changes:
        log.info("history tables: %s", line)
    return changes


def sync_after_migrate(sender: Any = None, apps: Any = None, using: str = "default", **kwargs: Any) -> None:
    """post_migrate: give the history tables the columns of Task as migrated (forwards or backwards)."""
    if apps is None or using != connection.alias:
        return
    try:
        state_task = apps.get_model("taskflow", "Task")
        positions = apps.get_model("taskflow", "SchedulePos")
    except LookupError:
        return
    if "position" not in {f.name for f in positions._meta.get_fields()}:
        return  # migrated back before rolling existed
    sync_history_tables(state_task)


def schema_drift() -> list[str]:
    """Kept history tables that are missing or whose columns differ from the task table's (for `check`)."""
    problems = []
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
        wanted = {f.column for f in Task._meta.local_concrete_fields}
        for pos in kept():
            table = history_table(pos.position)
            if table not in tables:
                if pos.row_count:
                    problems.append(f"history table {table} is recorded in SchedulePos but missing")
                continue
            have = {c.name for c in connection.introspection.get_table_description(cursor, table)}
            if have != wanted:
                missing, extra = sorted(wanted - have), sorted(have - wanted)
                problems.append(f"history table {table} lacks columns {missing} and has extra columns {extra}")
    return problems


# -- rolling ----------------------------------------------------------------------------------------


def roll(
    *,
    now: datetime | None = None,
    dry_run: bool = False,
    keep_going: KeepGoing = _always,
    batch: int | None = None,
    pause: float = BATCH_PAUSE,
) -> RollResult:
    """Drop expired history tables, then move old finished tasks into the current history table in batches."""
    now = now or timezone.now()
    settings = get_settings()
    batch = batch or settings.ROLL_BATCH
    cutoff = now - timedelta(seconds=settings.ROLL_AFTER)
    if dry_run:
        return _plan(now, cutoff)
    result = RollResult(dropped=drop_expired(now))
    hot = sql.task_table()
    synced: set[int] = set()
    while keep_going():
        if not sql.lock_rollable(hot, cutoff, 1):  # nothing to move: start no table for it
            break
        current = _current_table(now, result, synced)
        moved, limit = _move_batch(current.position, cutoff, batch, now)
        result.moved += moved
        if limit == 0:  # a concurrent roll filled the table: the next pass starts another
            continue
        if moved < limit:  # the rest is locked by someone (or a drop raced us): next run
            break
        if pause:
            time.sleep(pause)
    if result.moved or result.started or result.dropped:
        log.info("roll: %s", result)
    return result


def _current_table(now: datetime, result: RollResult, synced: set[int]) -> SchedulePos:
    """The history table being filled, starting the next one when it is full or old; its table exists.

    `synced` holds the positions this roll already checked the table of (once per roll is enough).
    """
    settings = get_settings()
    for _ in range(RACE_RETRIES):
        current = kept().last()
        old = now - timedelta(seconds=settings.ROLL_TABLE_SECONDS)
        if (
            current is None
            or current.row_count >= settings.ROLL_MAX_ROWS
            or (current.row_count and current.started_at <= old)
        ):
            newest = SchedulePos.objects.order_by("position").last()  # dropped ones too: never reuse a name
            position = newest.position + 1 if newest else 1
            with connection.cursor() as cursor:
                exists = history_table(position) in connection.introspection.table_names(cursor)
            if exists:
                if SchedulePos.objects.filter(position=position).exists():
                    continue  # a concurrent roll started it since we looked
                # Not made by rolling (a table is recorded before it is created): never write into it.
                raise RollError(
                    f"{history_table(position)} exists but SchedulePos does not record it; "
                    "rename or drop it (docs/rolling.md)"
                )
            try:
                # Recorded before the table exists: a crash in between leaves a record sync_table completes.
                current = SchedulePos.objects.create(position=position, started_at=now, updated_at=now)
            except IntegrityError:  # another roll started it first
                continue
            result.started.append(history_table(position))
        if current.position not in synced:
            sync_table(current.position)
            synced.add(current.position)
        return current
    raise RollError("could not start the next history table (concurrent rolls kept racing)")


def _move_batch(position: int, cutoff: datetime, batch: int, now: datetime) -> tuple[int, int]:
    """Move up to `batch` old finished tasks into history table `position`: copy, delete and count, one transaction.

    Returns how many moved, and how many it tried to (less than `batch` when the table is nearly full).
    """
    hot, target = sql.task_table(), history_table(position)
    with transaction.atomic():
        # The position row first: it orders moves, restores and drops of this table, and on SQLite
        # the transaction holds the write lock before anything is read.
        if not SchedulePos.objects.filter(position=position, dropped_at__isnull=True).update(updated_at=now):
            return 0, batch
        pos = SchedulePos.objects.get(position=position)
        # Read under that lock: another roll may have filled the table since we chose it.
        limit = max(0, min(batch, get_settings().ROLL_MAX_ROWS - pos.row_count))
        rows = sql.lock_rollable(hot, cutoff, limit) if limit else []
        if not rows:
            return 0, limit
        ids = [task_id for task_id, _ in rows]
        copied = sql.copy_tasks(hot, target, ids)
        deleted = sql.delete_tasks(hot, ids)
        if copied != len(ids) or deleted != len(ids):
            raise RollError(f"moving {len(ids)} tasks to {target}: copied {copied}, deleted {deleted}")
        newest = max(finished for _, finished in rows)
        pos.row_count += len(ids)
        pos.min_id = min(ids) if pos.min_id is None else min(pos.min_id, *ids)
        pos.max_id = max(ids) if pos.max_id is None else max(pos.max_id, *ids)
        pos.newest_finished_at = newest if pos.newest_finished_at is None else max(pos.newest_finished_at, newest)
        pos.save(update_fields=["row_count", "min_id", "max_id", "newest_finished_at"])
    return len(ids), limit


def _expired(now: datetime) -> Q:
    cutoff = now - timedelta(days=get_settings().ROLL_RETENTION_DAYS)
    return Q(newest_finished_at__lt=cutoff) | Q(newest_finished_at__isnull=True, started_at__lt=cutoff)


def drop_expired(now: datetime | None = None) -> list[str]:
    """Drop every history table whose newest task finished ROLL_RETENTION_DAYS ago; returns their names.

    A table is marked dropped in SchedulePos first (from then on nothing reads or writes it), then
    dropped; a table marked by a run that died before dropping it is dropped by the next one.
    """
    now = now or timezone.now()
    dropped = []
    for pos in kept().filter(_expired(now)):
        if pos.min_id is not None:
            # While the table is still read: its tasks long finished, and the dependents that wait
            # for them must have that recorded on their edges before the tasks are gone.
            _settle_dependents(pos.min_id, pos.max_id)
        # Guarded: a restore or a move holding the row finishes first, and a concurrent roll marks it once.
        if SchedulePos.objects.filter(_expired(now), position=pos.position, dropped_at__isnull=True).update(
            dropped_at=now, updated_at=now
        ):
            _drop(history_table(pos.position))
            dropped.append(history_table(pos.position))
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
    for pos in SchedulePos.objects.filter(dropped_at__isnull=False):
        if history_table(pos.position) in tables:  # marked by a run that died before dropping it
            _drop(history_table(pos.position))
            dropped.append(history_table(pos.position))
    return dropped


def _settle_dependents(min_id: int, max_id: int) -> None:
    """Release the dependents still waiting on an open edge for tasks in this id range (the repair's job, done now)."""
    from . import dependencies  # it finds tasks through this module: imported here, not at the top

    open_deps = list(
        TaskDependency.objects.filter(outcome="", depends_on_id__gte=min_id, depends_on_id__lte=max_id)
        .values_list("depends_on_id", flat=True)
        .distinct()
    )
    if open_deps:
        dependencies.release(open_deps)


def _drop(table: str) -> None:
    """Delete the dependency edges and events of the table's tasks, in batches, then drop the table.

    Both kinds of edge go: those its tasks waited by, and those of live tasks that waited for its
    tasks (settled before the table was marked, so each such dependent was already released or
    stopped; a task gone with its table no longer holds back a retry of its dependents). Runs after
    the table is marked dropped, so nothing reads or moves its rows meanwhile; a crash is finished
    by the next run.
    """
    # A table recorded by a roll that died before creating it holds nothing.
    ids = sql.ids_after(table, 0, DROP_BATCH) if _exists(table) else []
    while ids:
        with transaction.atomic():
            TaskDependency.objects.filter(Q(task_id__in=ids) | Q(depends_on_id__in=ids)).delete()
            TaskEvent.objects.filter(task_id__in=ids).delete()
        ids = sql.ids_after(table, ids[-1], DROP_BATCH) if len(ids) == DROP_BATCH else []
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {sql.quote(table)}")


def _exists(table: str) -> bool:
    with connection.cursor() as cursor:
        return table in connection.introspection.table_names(cursor)


def _plan(now: datetime, cutoff: datetime) -> RollResult:
    """What roll() would do now, reading only."""
    settings = get_settings()
    result = RollResult(dry_run=True)
    expired = [p.position for p in kept().filter(_expired(now))]
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
    unfinished = [p.position for p in SchedulePos.objects.filter(dropped_at__isnull=False)]
    result.dropped = [history_table(p) for p in expired] + [
        history_table(p) for p in unfinished if history_table(p) in tables
    ]
    result.moved = sql.count_rollable(sql.task_table(), cutoff)
    if not result.moved:
        return result
    newest = SchedulePos.objects.order_by("position").last()
    next_position = newest.position + 1 if newest else 1
    current = kept().exclude(position__in=expired).last()
    old = now - timedelta(seconds=settings.ROLL_TABLE_SECONDS)
    room = 0
    if current is not None and not (current.row_count and current.started_at <= old):
        room = max(0, settings.ROLL_MAX_ROWS - current.row_count)
    left = result.moved - room
    while left > 0:
        result.started.append(history_table(next_position))
        next_position += 1
        left -= settings.ROLL_MAX_ROWS
    return result


_next_roll = 0.0


def roll_when_due(now: datetime | None = None, keep_going: KeepGoing = _always) -> int:
    """The watcher's duty: roll every ROLL_INTERVAL seconds (never if 0); returns tasks moved plus tables dropped."""
    global _next_roll
    interval = get_settings().ROLL_INTERVAL
    if interval <= 0 or time.monotonic() < _next_roll:
        return 0
    _next_roll = time.monotonic() + interval
    result = roll(now=now, keep_going=keep_going)
    return result.moved + len(result.dropped)


# -- finding and restoring tasks in history ------------------------------------------------------------


def _holding(task_ids: Iterable[int]) -> list[SchedulePos]:
    """The kept history tables whose id range covers any of `task_ids`, newest first."""
    task_ids = list(task_ids)
    if not task_ids:
        return []
    low, high = min(task_ids), max(task_ids)
    candidates = kept().filter(min_id__lte=high, max_id__gte=low).order_by("-position")
    return [p for p in candidates if any(p.min_id <= i <= p.max_id for i in task_ids)]


def _mark(task: Task, position: int) -> Task:
    task.history_position = position  # type: ignore[attr-defined]
    return task


def _still_kept(position: int) -> bool:
    return SchedulePos.objects.filter(position=position, dropped_at__isnull=True).exists()


def _read(position: int, call: Callable[[], Any]) -> Any:
    """Run a read of history table `position`; None if the table was dropped meanwhile."""
    try:
        with transaction.atomic():  # a savepoint: on PostgreSQL a failed statement spoils the transaction
            return call()
    except DatabaseError:
        # Asked of the table itself, not of SchedulePos: a reader's snapshot (MySQL's repeatable
        # read) may predate the drop's mark.
        if _still_kept(position) and _exists(history_table(position)):
            raise
        return None


def _searchable() -> dict[int, str]:
    """{position: table} of the kept history tables that hold tasks, for lookups by identity.

    A table is recorded in SchedulePos before it is created, and gets its id range in the
    transaction that moves its first tasks in: a table without one may not exist yet, and holds
    nothing to find anyway.
    """
    return {p.position: history_table(p.position) for p in kept().filter(min_id__isnull=False)}


def _across_tables(call: Callable[[dict[int, str]], Any], empty: Any) -> Any:
    """Run a read of all searchable history tables (one UNION), leaving out those a concurrent drop removed."""
    tables = _searchable()
    for _ in range(RACE_RETRIES):
        if not tables:
            return empty
        try:
            with transaction.atomic():  # a savepoint: on PostgreSQL a failed statement spoils the transaction
                return call(tables)
        except DatabaseError:
            with connection.cursor() as cursor:
                existing = set(connection.introspection.table_names(cursor))
            if all(table in existing for table in tables.values()):
                raise
            # Dropped since we listed them (marked first, so they hold nothing anyone still needs).
            tables = {p: t for p, t in _searchable().items() if t in existing}
    return empty


def get_task(task_id: int) -> Task:
    """The task with this id, from the hot table or any kept history table; Task.DoesNotExist if none has it.

    A task found in history is a read-only copy: it carries `history_position`, and saving it raises.
    """
    try:
        task_id = int(task_id)
    except (TypeError, ValueError):
        raise Task.DoesNotExist(f"no task {task_id!r}") from None
    # Hot table, then history, then the hot table once more: a restore may move it back meanwhile,
    # and a roll commits its move and its SchedulePos range together, so one of the reads sees it.
    for _ in range(RACE_RETRIES):
        task = Task.objects.filter(pk=task_id).first()
        if task is not None:
            return task
        for pos in _holding([task_id]):
            found = _read(pos.position, lambda pos=pos: sql.read_tasks(history_table(pos.position), [task_id]))
            if found:
                return _mark(found[0], pos.position)
    raise Task.DoesNotExist(f"no task {task_id} in the task table or the history tables kept")


def find_tasks(task_ids: Iterable[int], columns: Sequence[str]) -> dict[int, dict[str, Any]]:
    """{id: {column: value}} of the tasks of `task_ids` wherever they live: the one lookup every rule uses.

    Reads the hot table (one narrow query, all most callers pay), then history for the ids it
    missed, then the hot table once more (a restore may have moved one back meanwhile; a roll
    commits a move and its table's id range together, so one of the reads sees each task). A row
    found in history also carries "history_position". Ids found nowhere are left out.
    """
    columns = tuple(dict.fromkeys(("id", *columns)))
    found: dict[int, dict[str, Any]] = {}

    def read_hot(ids: list[int]) -> None:
        for start in range(0, len(ids), FIND_BATCH):
            for row in Task.objects.filter(id__in=ids[start : start + FIND_BATCH]).values(*columns):
                found[row["id"]] = row

    missing = sorted(set(task_ids))
    read_hot(missing)
    missing = [i for i in missing if i not in found]
    if missing:
        for task in history_tasks(missing):
            row = {name: getattr(task, name) for name in columns}
            found[task.id] = {**row, "history_position": task.history_position}  # type: ignore[attr-defined]
        read_hot([i for i in missing if i not in found])
    return found


def history_tasks(task_ids: Iterable[int]) -> list[Task]:
    """The tasks of `task_ids` found in kept history tables (each with `history_position`)."""
    wanted = set(task_ids)
    out = []
    for pos in _holding(wanted):
        table = history_table(pos.position)
        ids = sorted(i for i in wanted if pos.min_id <= i <= pos.max_id)
        for task in _read(pos.position, lambda table=table, ids=ids: sql.read_tasks(table, ids)) or []:
            out.append(_mark(task, pos.position))
            wanted.discard(task.id)
    return out


def find_identity(task_type: str, key: str, version: int) -> Task | None:
    """The task of one identity if a kept history table holds it (with `history_position`), else None."""
    return _across_tables(lambda tables: sql.find_identity(tables, task_type, key, version), None)


def versions_in_history(task_type: str, key: str, limit: int) -> list[Task]:
    """The newest `limit` versions of one key that kept history tables hold (read-only copies)."""
    return _across_tables(lambda tables: sql.versions_of_key(tables, task_type, key, limit), [])


def restore(task_ids: Iterable[int], now: datetime | None = None) -> int:
    """Move the tasks of `task_ids` that history holds back into the hot table; returns how many moved.

    Runs in the caller's transaction (each table in a savepoint), so a caller that goes on to
    change the tasks commits both together.
    """
    now = now or timezone.now()
    wanted = set(task_ids)
    hot = sql.task_table()
    moved = 0
    for pos in _holding(wanted):
        table = history_table(pos.position)
        ids = sorted(i for i in wanted if pos.min_id <= i <= pos.max_id)
        if not ids:  # all of them were found in a newer table already (id ranges may overlap)
            continue
        with transaction.atomic():
            # The position row orders this with moves into and drops of the same table.
            if not SchedulePos.objects.filter(position=pos.position, dropped_at__isnull=True).update(updated_at=now):
                continue
            present = [t.id for t in sql.read_tasks(table, ids)]
            if not present:
                continue
            copied = sql.copy_tasks(table, hot, present)
            deleted = sql.delete_tasks(table, present)
            if copied != len(present) or deleted != len(present):
                raise RollError(f"restoring {len(present)} tasks from {table}: copied {copied}, deleted {deleted}")
            SchedulePos.objects.filter(position=pos.position).update(row_count=F("row_count") - len(present))
        moved += len(present)
        wanted -= set(present)
    return moved


def browse(
    position: int, *, task_type: str = "", status: str = "", before_id: int | None = None, limit: int = 50
) -> list[Task]:
    """A page of history table `position` for the console, newest id first (empty if it was dropped)."""
    if not _still_kept(position):
        return []
    columns = ("id", "task_type", "key", "version", "status", "attempts", "created_at", "finished_at")
    table = history_table(position)
    page = _read(
        position,
        lambda: sql.page_of_tasks(table, columns, task_type=task_type, status=status, before_id=before_id, limit=limit),
    )
    return [_mark(task, position) for task in page or []]

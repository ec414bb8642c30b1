"""Putting tasks into the table: validation, identity (type + key + version) and wake-ups.

Enqueueing joins the caller's transaction, so a task commits or rolls back with the caller's data;
workers are woken only after the commit.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import signals
from django.db.models.base import ModelState
from django.utils import timezone

from ..exceptions import InvalidTask, StaleVersion
from ..models import Status, Task
from . import dependencies, endings, ids, limiter, rolling, sql, wakeup
from .configs import configs
from .transitions import order_time
from .validation import (
    MAX_INT,
    json_text,
    resolve_run_after,
    validate_json,
    validate_key,
    validate_non_negative_int,
    validate_priority,
    validate_short_text,
    validate_task_type,
)

CREATED, EXISTING, REPLACED = "created", "existing", "replaced"
_SPEC_FIELDS = {
    "task_type",
    "payload",
    "key",
    "version",
    "priority",
    "run_after",
    "max_retries",
    "timeout",
    "stage",
    "user_id",
    "context",
    "trace_id",
    "retry_same_host",
    "depends_on",
    "on_dependency_failure",
}

# The values that mean "not given" for each option (taskflow.enqueue passes every option), known
# by identity: a request holding only these needs no option checked.
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "key": (None, ""),
    "version": (0,),
    "priority": (0,),
    "run_after": (None,),
    "max_retries": (None,),
    "timeout": (None,),
    "stage": (None, ""),
    "user_id": (None, ""),
    "context": (None,),
    "trace_id": (None, ""),
    "retry_same_host": (0,),
    "depends_on": (None, ()),
    "on_dependency_failure": (None, "stop"),
}
_DEFAULT_IDS = {(name, id(value)) for name, values in _DEFAULTS.items() for value in values}


@dataclass
class TaskSpec:
    """A validated request for one task."""

    task_type: str
    payload: Any = field(default_factory=dict)
    key: str | None = None
    version: int = 0
    priority: int = 0
    run_after: datetime | None = None
    max_retries: int | None = None
    timeout: int | None = None
    stage: str = ""
    user_id: str = ""
    context: Any = field(default_factory=dict)
    trace_id: str = ""
    retry_same_host: int = 0
    payload_text: str | None = None  # the payload as validated JSON, reused by the INSERT
    depends_on: tuple[int, ...] = ()  # task ids it waits for (engine/dependencies.py)
    run_on_dependency_failure: bool = False  # on_dependency_failure="run"
    # The status it is created in: set by dependencies.plan once its dependencies are read.
    status: str = Status.PENDING
    status_msg: str = ""

    @classmethod
    def build(cls, now: datetime, task_type: object, payload: Any = None, **options: Any) -> TaskSpec:
        if all((name, id(value)) in _DEFAULT_IDS for name, value in options.items()):
            # Every option at its default (taskflow.enqueue passes them all): only the payload to check.
            payload = {} if payload is None else payload
            payload_text = json_text("payload", payload)
            return cls(
                task_type=validate_task_type(task_type), payload=payload, payload_text=payload_text, run_after=now
            )
        unknown = set(options) - _SPEC_FIELDS
        if unknown:
            raise InvalidTask(f"unknown task option(s): {', '.join(sorted(unknown))}")
        timeout = validate_non_negative_int("timeout", options.get("timeout"), allow_none=True, maximum=MAX_INT)
        if timeout == 0:
            raise InvalidTask("timeout must be a positive number of seconds")
        payload = {} if payload is None else payload
        payload_text = json_text("payload", payload)
        return cls(
            task_type=validate_task_type(task_type),
            payload=payload,
            payload_text=payload_text,
            key=validate_key(options.get("key")),
            version=validate_non_negative_int("version", options.get("version", 0)),  # type: ignore[arg-type]
            priority=validate_priority(options.get("priority", 0)),
            run_after=resolve_run_after(options.get("run_after"), now),
            max_retries=validate_non_negative_int(
                "max_retries", options.get("max_retries"), allow_none=True, maximum=MAX_INT
            ),
            timeout=timeout,
            stage=validate_short_text("stage", options.get("stage") or "", 100),
            user_id=validate_short_text("user_id", str(options.get("user_id") or ""), 64),
            context=_context(options.get("context")),
            trace_id=validate_short_text("trace_id", options.get("trace_id") or "", 32),
            retry_same_host=validate_non_negative_int(  # type: ignore[arg-type]
                "retry_same_host", options.get("retry_same_host", 0), maximum=MAX_INT
            ),
            depends_on=dependencies.validate_depends_on(options.get("depends_on")),
            run_on_dependency_failure=dependencies.validate_on_failure(options.get("on_dependency_failure")),
        )


def _context(value: Any) -> Any:
    # Most tasks carry none: the empty default needs no check.
    return validate_json("context", value) if value else {}


def enqueue(task_type: str, payload: Any = None, **options: Any) -> Task:
    """Create one task (or return/replace the existing one with the same identity)."""
    return enqueue_many([{"task_type": task_type, "payload": payload, **options}])[0]


def enqueue_many(requests: Iterable[Mapping[str, Any] | TaskSpec]) -> list[Task]:
    """Create many tasks in one transaction; unkeyed ones go in as multi-row INSERTs.

    Each returned task carries `enqueue_outcome`: "created", "existing" or "replaced".
    Raises InvalidTask (nothing written) or StaleVersion (the whole call is refused).
    """
    now = timezone.now()
    specs = [r if isinstance(r, TaskSpec) else _spec_from_mapping(r, now) for r in requests]
    if not specs:
        return []
    # Reads the dependencies (InvalidTask for unknown ones) and sets each spec's initial status.
    read = dependencies.plan(specs)
    cfgs = configs.get_many(s.task_type for s in specs)
    results: list[Task | None] = [None] * len(specs)
    keyed = [i for i, spec in enumerate(specs) if spec.key is not None]
    unkeyed = [(i, spec) for i, spec in enumerate(specs) if spec.key is None]
    traces, watched = _trace_ids(len(unkeyed)), _watched()
    fresh = [
        (i, _new_task(spec, cfgs[spec.task_type].priority_aging, now, next(traces), watched)) for i, spec in unkeyed
    ]

    # A StaleVersion undoes the whole call and nothing else: a call with keys gets a savepoint for
    # that inside the caller's transaction, except a lone keyed request, which is refused before it
    # writes anything (its identity's lock aside) and so simply joins the caller's transaction.
    # Unkeyed tasks cannot be refused: no savepoint; a lone INSERT is atomic by itself, so it needs
    # no transaction at all (one round trip, not four).
    batches = sql.insert_batches([t for _, t in fresh])
    if not keyed and len(batches) <= 1 and not read:
        block: Any = nullcontext()
    elif not connection.in_atomic_block:
        block = sql.transaction_of_statements()
    elif len(specs) == 1:
        block = nullcontext()
    else:
        block = transaction.atomic(savepoint=bool(keyed))
    # Where wake-ups travel through the database, a lone INSERT carries its own notice (one round trip).
    carried = wakeup.by_database() and sql.appends_statements()
    notified = _due_types((t for _, t in fresh), now) if carried and len(batches) == 1 else set()
    notice = wakeup.notification(notified) if notified else None
    # Minted before the transaction: leasing a node may write, and must not join it.
    new_ids = iter(ids.next_ids(len(specs)))
    with block:
        for (i, task), task_id in zip(fresh, new_ids, strict=False):
            task.id = task_id
            results[i] = task
        for batch in batches:
            sql.insert_batch(sql.task_table(), batch, then=notice)
        # Identity locks are taken in one global order so two bulk calls cannot deadlock.
        for i in sorted(keyed, key=lambda j: (specs[j].task_type, specs[j].key)):
            results[i] = task = _enqueue_keyed(
                specs[i], cfgs[specs[i].task_type].priority_aging, now, next(new_ids), carry_notice=carried
            )
            if getattr(task, "carried_notice", False):
                notified.add(task.task_type)
        written = [(t, specs[i]) for i, t in enumerate(results) if t is not None and t.enqueue_outcome != EXISTING]
        replaced = [t.pk for t, _ in written if t.enqueue_outcome == REPLACED]
        created = [(t, spec) for t, spec in written if spec.depends_on]
        if created or replaced:
            dependencies.record_edges(created, replaced, read)
        due = _due_types((t for t, _ in written), now)
        if due - notified and wakeup.by_database():
            wakeup.notify_now(due - notified)  # inside our transaction: delivered when it commits
    # Outside the block: on MySQL it may be a transaction Django does not see (no on_commit inside).
    dependencies.check_after_commit(created, read)
    superseding = [t for t, _ in written if getattr(t, "superseded_older", False)]
    if superseding:
        # After the commit, so the lookup holds no lock of the enqueue's.
        transaction.on_commit(lambda: _older_versions_stopped(superseding, now))
    # Redis and in-process listeners hear of it once committed (the database's notice went with it).
    wakeup.notify_on_commit(due, by_database=False)
    return results  # type: ignore[return-value]


def _due_types(tasks: Iterable[Task], now: datetime) -> set[str]:
    """The types among these new or replaced tasks that are ready to run now: workers to wake."""
    return {t.task_type for t in tasks if t.status == Status.PENDING and t.run_after <= now}


def _spec_from_mapping(request: Mapping[str, Any], now: datetime) -> TaskSpec:
    options = dict(request)
    if "task_type" not in options:
        raise InvalidTask("task_type is required")
    return TaskSpec.build(now, options.pop("task_type"), options.pop("payload", None), **options)


def _trace_ids(count: int) -> Iterator[str]:
    """`count` random trace ids (32 hex digits, as uuid4().hex), from one call for random bytes."""
    text = os.urandom(16 * count).hex()
    return (text[i : i + 32] for i in range(0, 32 * count, 32))


def _new_task(spec: TaskSpec, aging: float, now: datetime, trace_id: str = "", watched: bool | None = None) -> Task:
    run_after = spec.run_after or now
    values = {
        "task_type": spec.task_type,
        "key": spec.key,
        "version": spec.version,
        "priority": spec.priority,
        "payload": spec.payload,
        "context": spec.context,
        "stage": spec.stage,
        "max_retries": spec.max_retries,
        "timeout": spec.timeout,
        "run_after": run_after,
        "order_time": order_time(run_after, spec.priority, aging) if spec.priority else run_after,
        "trace_id": spec.trace_id or trace_id or uuid.uuid4().hex,
        "user_id": spec.user_id,
        "retry_same_host": spec.retry_same_host,
        "created_at": now,
        "updated_at": now,
        "status": spec.status,
        "status_msg": spec.status_msg,
        "finished_at": now if spec.status == Status.STOPPED else None,
    }
    # Defaults come from one template row, filled in as Model.__init__ would, without its per-field
    # work (which dominated bulk enqueueing) unless a pre_init/post_init receiver must see it.
    row = _template_row()
    row.update(values)
    row["enqueue_outcome"] = CREATED
    row["_payload_text"] = spec.payload_text
    if _watched() if watched is None else watched:
        task = Task(**{name: row.pop(name) for name in _TEMPLATE})
        task.__dict__.update(row)
        return task
    task = Task.__new__(Task)
    task._state = ModelState()
    task.__dict__.update(row)
    return task


def _watched() -> bool:
    """Whether a pre_init/post_init receiver must see tasks built (then Model.__init__ builds them)."""
    return signals.pre_init.has_listeners(Task) or signals.post_init.has_listeners(Task)


_TEMPLATE: dict[str, Any] = {}


def _template_row() -> dict[str, Any]:
    """A new task's attributes, each field at its default."""
    if not _TEMPLATE:
        for f in Task._meta.concrete_fields:
            _TEMPLATE[f.attname] = f.get_default()
        _TEMPLATE["id"] = None
    # A mutable default must not be shared between tasks (payload and context are always given).
    return {**_TEMPLATE, "schedule_log": []}


def _enqueue_keyed(spec: TaskSpec, aging: float, now: datetime, task_id: int, *, carry_notice: bool = False) -> Task:
    """Apply the identity rules to one keyed request, holding its TaskKey row lock; `task_id` if it creates one."""
    assert spec.key is not None
    table = sql.task_table()
    newest = sql.lock_task_key(spec.task_type, spec.key, spec.version, now)
    if newest is None:
        # A brand-new key: no task of it exists, so there is nothing to find or supersede.
        return _insert_new(table, spec, aging, now, task_id, carry_notice)
    if spec.version < newest:
        raise StaleVersion(spec.task_type, spec.key, spec.version, newest)

    existing, rolled = sql.find_task_noting_history(table, spec.task_type, spec.key, spec.version)
    if existing is None and rolled:
        # An identity spans the task table and the history tables it rolled into.
        existing = _from_history(spec, now)
    if existing is None:
        task = _insert_new(table, spec, aging, now, task_id, carry_notice)
    elif existing.status in (Status.FAILED, Status.STOPPED):
        dependencies.refuse_cycle(existing.pk, spec)
        task = _replace(existing, spec, aging, now)
    else:
        existing.enqueue_outcome = EXISTING  # type: ignore[attr-defined]
        return existing
    # Waiting older versions stop; running ones finish their attempt and then stop.
    if sql.supersede_older_versions(table, spec.task_type, spec.key, spec.version, now):
        task.superseded_older = True  # type: ignore[attr-defined]  (their dependents are released after commit)
    return task


def _from_history(spec: TaskSpec, now: datetime) -> Task | None:
    """The task of this identity if it was rolled into history; a failed or stopped one is brought back to replace."""
    assert spec.key is not None
    found = rolling.find_identity(spec.task_type, spec.key, spec.version)
    if found is None or found.status not in (Status.FAILED, Status.STOPPED):
        return found  # a success stays where it is: it is only returned
    rolling.restore([found.id], now)
    return sql.find_task(sql.task_table(), spec.task_type, spec.key, spec.version)


def _insert_new(table: str, spec: TaskSpec, aging: float, now: datetime, task_id: int, carry_notice: bool) -> Task:
    """INSERT a new task of a keyed request; `carry_notice`: the wake-up notice rides along (see enqueue_many)."""
    task = _new_task(spec, aging, now)
    task.id = task_id
    notice = wakeup.notification({task.task_type}) if carry_notice and _due_types([task], now) else None
    sql.insert_batch(table, [task], then=notice)
    task.carried_notice = notice is not None  # type: ignore[attr-defined]
    return task


def _replace(existing: Task, spec: TaskSpec, aging: float, now: datetime) -> Task:
    """Turn a failed or stopped task back into a fresh pending one, keeping its id and history."""
    fresh = _new_task(spec, aging, now)
    handler_until = limiter.lingering_deadline(existing.pk) if existing.status == Status.STOPPED else None
    if handler_until is not None and handler_until > fresh.run_after:
        # Stopped while it ran, and its handler runs on: the new run waits for that handler's
        # deadline, or the task would run twice at once (limiter.py: lingering attempts).
        fresh.run_after = handler_until
        fresh.order_time = order_time(handler_until, fresh.priority, aging)
    changes = {
        "status": spec.status,
        "status_msg": spec.status_msg or f"re-enqueued (was {existing.status})",
        "payload": fresh.payload,
        "context": fresh.context,
        "stage": fresh.stage,
        "priority": fresh.priority,
        "result": None,
        "checkpoint": None,
        "attempts": 0,
        "max_retries": fresh.max_retries,
        "timeout": fresh.timeout,
        "run_after": fresh.run_after,
        "order_time": fresh.order_time,
        "trace_id": fresh.trace_id,
        "user_id": fresh.user_id,
        "retry_same_host": fresh.retry_same_host,
        "prefer_host": "",
        "prefer_host_until": None,
        "worker_id": "",
        "lease_expires_at": None,
        "started_at": None,
        "finished_at": fresh.finished_at,
        "updated_at": now,
    }
    # Guarded: only a task still failed/stopped is replaced.
    updated = Task.objects.filter(pk=existing.pk, status__in=[Status.FAILED, Status.STOPPED]).update(**changes)
    task = Task.objects.filter(pk=existing.pk).first()
    if task is None:
        # A roll moved it into history after we read it (the identity lock does not stop rolls):
        # bring it back and replace it there.
        rolling.restore([existing.pk], now)
        updated = Task.objects.filter(pk=existing.pk, status__in=[Status.FAILED, Status.STOPPED]).update(**changes)
        task = Task.objects.get(pk=existing.pk)
    task.enqueue_outcome = REPLACED if updated else EXISTING  # type: ignore[attr-defined]
    return task


def _older_versions_stopped(tasks: list[Task], now: datetime) -> None:
    """The older versions these tasks' enqueues stopped (at `now`): release their dependents, announce their end.

    Older versions that were running stop when their attempt ends, and are announced then.
    """
    stopped: list[tuple[int, str]] = []
    for task in tasks:
        stopped += [
            (task_id, task.task_type)
            for task_id in Task.objects.filter(
                task_type=task.task_type,
                key=task.key,
                version__lt=task.version,
                superseded_by=task.version,
                status=Status.STOPPED,
                finished_at=now,  # by this enqueue, not by a running one's report since
            ).values_list("id", flat=True)
        ]
    dependencies.release_on_commit(task_id for task_id, _ in stopped)
    endings.announce_finished(stopped)

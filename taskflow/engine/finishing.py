"""Finishing attempts: the one function that ends attempts for everyone.

The worker's reports, taskwatch's rescues, operator actions and the HTTP API all end attempts
through `finish_attempts`: it decides each row's changes with the state machine, writes them with
guarded UPDATEs, gives each accepted attempt's limiter slot back exactly once, wakes workers
for work it made due, releases the tasks waiting for the tasks it finished (dependencies.py) and
announces the endings (endings.py; the backend sends task_finished). A limit holds at every moment:
an attempt stopped by an operator while its handler runs keeps its slot until that handler's
report comes back (refused) or its deadline passes (limiter.py: lingering attempts).

One report must never hold back the others. Statements are bounded by rows and by bytes (MySQL
refuses a packet over max_allowed_packet, 16 MiB by default). A write that fails while the
database still answers is tried again in halves until the report it choked on is alone; that
report's task is then failed with the database's message and the others land. A write that fails
because the database is gone, or because another transaction held its locks too long (a lock
timeout, a deadlock), is not a refusal: nothing is failed, the error is raised, and the caller keeps
the reports to try again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from datetime import datetime
from typing import Any

from django.db import DatabaseError, DataError, IntegrityError, connection, transaction
from django.utils import timezone

from ..models import ScheduleCfg, Status
from . import dependencies, endings, sql, tasklog, wakeup
from . import limiter as limiter_module
from .attempts import Outcome, Report
from .configs import configs
from .limiter import Limiter
from .transitions import row_changes

log = logging.getLogger("taskflow.finishing")

MAX_STATEMENT_ROWS = 500
# Values per UPDATE: a quarter of MySQL's default max_allowed_packet, since quoting can double text.
MAX_STATEMENT_BYTES = 4 * 1024 * 1024
ROW_BYTES = 2048  # what a row's bounded columns (schedule log, timestamps, ids) add up to at most
# A lone report whose write keeps failing on a database that answers, with an error that is not
# about its values (a lost connection, say): tries before it counts as refused. An oversized row
# fails every time; a passing failure does not.
REFUSAL_TRIES = 3

Row = tuple[Report, dict[str, Any]]  # a report and the columns it writes
# Ends of attempts decided by others than the worker running them (operators, taskwatch).
_NOT_FROM_HANDLERS = frozenset({Outcome.TERMINATED, Outcome.RESCUED})
# Ends that put the task back in the queue or may fail it: decided with the task's priority, retry
# budget and superseded mark as they are when written (an operator may change them while the attempt
# runs; a newer version may supersede it), read again under the row lock. Successes, failures and
# stops need none of these, and are written without the extra query.
_DECIDED_WITH_CURRENT_SETTINGS = frozenset(
    {Outcome.ERROR, Outcome.RESCUED, Outcome.SNOOZE, Outcome.NEXT_STAGE, Outcome.HANDBACK}
)


def finish_attempts(
    reports: list[Report],
    *,
    cfgs: dict[str, ScheduleCfg] | None = None,
    limiter: Limiter | None = None,
    guard: sql.Guard = sql.NO_GUARD,
    now: datetime | None = None,
) -> list[Report]:
    """Write the end of these attempts; returns the reports accepted (the others' attempts were taken away).

    Reports of lost attempts (Outcome.LOST) write nothing; a report repeated for the same attempt
    is written once. A report the database refuses fails its task instead (`written` holds what was
    written). If the database cannot be reached this raises; the reports written before that have
    `written` set (and their slots given back), and the others may be finished again later.
    """
    now = now or timezone.now()
    unique: dict[tuple[int, int], Report] = {}
    for report in reports:
        if report.outcome != Outcome.LOST:
            unique.setdefault((report.task.id, report.task.lease_token), report)
    live = list(unique.values())
    accepted = _finish(live, cfgs, limiter, guard, now) if live else []
    # The others' attempts were taken away. One an operator stopped while it ran kept its slot
    # until now, when its handler has returned (limiter.py: lingering attempts). Not when the
    # report was someone else's (a second stop, a rescue, racing the first): the handler runs on.
    returned = [r.task for r in reports if r.written is None and r.outcome not in _NOT_FROM_HANDLERS]
    handlers_returned([(task.id, task.lease_token) for task in returned], limiter)
    return accepted


def handlers_returned(attempts: list[tuple[int, int]], limiter: Limiter | None = None) -> None:
    """The handlers of these attempts ((task id, lease token)) returned with their task already ended elsewhere.

    Gives back the slot of each that was lingering (stopped while it ran), exactly once; the others'
    slots were given back by whoever ended their task.
    """
    if not attempts:
        return
    ended = limiter_module.end_lingering(attempts)
    if ended:
        limiter = limiter or Limiter()
        transaction.on_commit(lambda: limiter.release(ended))


def _finish(
    live: list[Report], cfgs: dict[str, ScheduleCfg] | None, limiter: Limiter | None, guard: sql.Guard, now: datetime
) -> list[Report]:
    cfgs = cfgs if cfgs is not None else configs.get_many({r.task.task_type for r in live})
    rows = [(report, _changes(report, cfgs[report.task.task_type], now)) for report in live]
    accepted: list[Report] = []
    try:
        _write_isolating(sql.task_table(), rows, cfgs, guard, now, accepted)
    finally:
        # Also when an outage stopped the rest: what was written keeps its slots and wake-ups right.
        _give_slots_back(accepted, cfgs, limiter, now)
        # Tasks that reached their final status release the tasks waiting for them, once committed;
        # django.tasks ones are announced (task_finished), once, whoever ended them.
        ended = [r for r in accepted if r.written and r.written.get("status") in dependencies.FINISHED]
        # Only those the write found others waiting for (or did not look): the rest cost nothing here.
        dependencies.release_on_commit(r.task.id for r in ended if r.waited_for)
        endings.announce_finished((r.task.id, r.task.task_type) for r in ended)
        # Requeued work that is due now (retries without delay, next stages, hand-backs): look at once.
        due = {r.task.task_type for r in accepted if _due_now(r.written, now)}
        if due:
            wakeup.publish(due)
    return accepted


def _changes(report: Report, cfg: ScheduleCfg, now: datetime) -> dict[str, Any]:
    try:
        return row_changes(report, cfg, now)
    except Exception as exc:  # a report carrying something the state machine cannot use
        reason = f"its end could not be recorded: {type(exc).__name__}: {exc}"
        log.warning("task %s: %s; the task is failed", report.task.id, reason, extra=tasklog.about(report.task))
        return row_changes(_failure(report, reason), cfg, now)


def _failure(report: Report, reason: str) -> Report:
    return Report(report.task, Outcome.FAIL, error=reason, cost_ms=report.cost_ms)


def _write_isolating(
    table: str,
    rows: list[Row],
    cfgs: dict[str, ScheduleCfg],
    guard: sql.Guard,
    now: datetime,
    accepted: list[Report],
    *,
    leave_waited_for: bool = True,
) -> None:
    """Write `rows`, failing instead the task of any report the database refuses (see the module doc)."""
    tries = 0
    while True:
        try:
            written, waited_for = _write(table, rows, cfgs, guard, now, leave_waited_for=leave_waited_for)
        except Exception as exc:
            if sql.is_lock_conflict(exc) or not _database_answers():
                # Another transaction's locks, or an outage: nothing of this part was written and
                # nothing is wrong with it; the caller tries again later.
                raise
            if len(rows) > 1:
                break
            tries += 1
            if _refusal(exc) or tries >= REFUSAL_TRIES:
                _fail_refused(table, rows[0][0], cfgs, exc, guard, now, accepted)
                return
            time.sleep(0.05 * tries)  # e.g. the connection was lost and the server is back already
            continue
        for report, changes in written:
            report.written = changes
            accepted.append(report)
        if waited_for:
            # Committed already (no transaction): what was written counts even if this fails.
            _write_isolating(table, waited_for, cfgs, guard, now, accepted, leave_waited_for=False)
        return
    half = len(rows) // 2
    _write_isolating(table, rows[:half], cfgs, guard, now, accepted, leave_waited_for=leave_waited_for)
    _write_isolating(table, rows[half:], cfgs, guard, now, accepted, leave_waited_for=leave_waited_for)


def _refusal(exc: Exception) -> bool:
    # Errors about the values sent; anything that is not a database error (a value the driver could
    # not convert) too. Other database errors may be passing (locks) and are tried again first.
    return isinstance(exc, (IntegrityError, DataError)) or not isinstance(exc, DatabaseError)


def _fail_refused(
    table: str,
    report: Report,
    cfgs: dict[str, ScheduleCfg],
    exc: Exception,
    guard: sql.Guard,
    now: datetime,
    accepted: list[Report],
) -> None:
    """Fail the task of a refused report with the database's message: the smallest write there is."""
    refused_by = "the database refused" if isinstance(exc, DatabaseError) else "could not write"
    reason = f"{refused_by} this attempt's report: {type(exc).__name__}: {exc}"
    log.warning("task %s: %s; the task is failed", report.task.id, reason, extra=tasklog.about(report.task))
    failure = _failure(report, reason)
    changes = row_changes(failure, cfgs[report.task.task_type], now)
    try:
        written, _ = _write(table, [(failure, changes)], cfgs, guard, now, leave_waited_for=False)
    except Exception as again:
        if sql.is_lock_conflict(again) or not _database_answers():
            raise
        log.error(
            "task %s: its failure could not be written either (%s: %s); it stays processing until taskwatch "
            "takes it away",
            report.task.id,
            type(again).__name__,
            again,
            extra=tasklog.about(report.task),
        )
        return
    if written:
        report.written, report.waited_for = changes, failure.waited_for
        accepted.append(report)


def _write(
    table: str,
    rows: list[Row],
    cfgs: dict[str, ScheduleCfg],
    guard: sql.Guard,
    now: datetime,
    *,
    leave_waited_for: bool,
) -> tuple[list[Row], list[Row]]:
    """Write `rows` in one transaction; returns those whose attempt was still theirs to end (as written).

    With `leave_waited_for`, a task that ends while other tasks wait for it is written by a second
    UPDATE (in the same transaction, or, when there is none, returned as the second list for the
    caller to write), so only those pay for their release. Each row is changed by one statement.
    """
    accepted: list[Row] = []
    left: list[Row] = []
    rereads = any(report.outcome in _DECIDED_WITH_CURRENT_SETTINGS for report, _ in rows)
    statements = _statements(rows)
    # All statements or none, so a retried flush never mistakes its own earlier writes for stale
    # reports; a single UPDATE is atomic by itself and skips the transaction's round trips. Inside
    # the caller's transaction a savepoint keeps a refused statement from spoiling it. A stop of a
    # running attempt records, with it, that the attempt keeps its slot while its handler runs on.
    stops = any(report.outcome == Outcome.TERMINATED for report, _ in rows)
    # Settings read again stay locked until this transaction's UPDATEs land.
    atomic = rereads or len(statements) > 1 or connection.in_atomic_block or stops
    with transaction.atomic() if atomic else nullcontext():
        if rereads:
            statements = _statements(_decided_with_current_settings(table, rows, cfgs, now))
        for chunk in statements:
            check = leave_waited_for and any(c.get("status") in dependencies.FINISHED for _, c in chunk)
            written, waited_for = _update(table, chunk, guard, now, unless_waited_for=check)
            accepted += written
            if waited_for and atomic:
                accepted += _update(table, waited_for, guard, now, unless_waited_for=False)[0]
            elif waited_for:
                left += waited_for
        if stops:
            limiter_module.keep_lingering([r.task for r, _ in accepted if r.outcome == Outcome.TERMINATED], now)
    return accepted, left


def _update(
    table: str, chunk: list[Row], guard: sql.Guard, now: datetime, *, unless_waited_for: bool
) -> tuple[list[Row], list[Row]]:
    """One guarded UPDATE of `chunk`; returns the rows it wrote and, `unless_waited_for`, those it left out.

    Those left out are stale or waited for by other tasks: the caller writes them again without
    the condition, and only the stale ones stay unwritten.
    """
    token = chunk[0][0].task.lease_token
    by_id = {report.task.id: (report, changes) for report, changes in chunk}
    count = sql.update_attempts(
        table, {tid: changes for tid, (_, changes) in by_id.items()}, token, guard, unless_waited_for=unless_waited_for
    )
    if count == len(by_id):
        mine = set(by_id)
    elif count:
        # Some were left out: ours are exactly those now carrying this write's timestamp.
        mine = sql.ids_written_at(table, by_id, chunk[0][1].get("lease_token", token), now)
    else:
        mine = set()
    written = [row for tid, row in by_id.items() if tid in mine]
    for report, _ in written:
        report.waited_for = not unless_waited_for
    left = [row for tid, row in by_id.items() if tid not in mine] if unless_waited_for else []
    return written, left


def _statements(rows: list[Row]) -> list[list[Row]]:
    """One UPDATE per group of rows sharing a token and the set of columns written, cut to size."""
    groups: dict[tuple[int, frozenset[str]], list[Row]] = defaultdict(list)
    for report, changes in rows:
        groups[(report.task.lease_token, frozenset(changes))].append((report, changes))
    return [chunk for group in groups.values() for chunk in _chunks(group)]


def _decided_with_current_settings(
    table: str, rows: list[Row], cfgs: dict[str, ScheduleCfg], now: datetime
) -> list[Row]:
    """`rows`, those that requeue or may fail decided again if their task's settings changed while it ran.

    An operator's set_priority or set_max_retries applies to the attempt in flight and is never
    overwritten by its end; a task superseded meanwhile is stopped here rather than in the UPDATE,
    so its release, task_finished and wake-ups follow what was written.
    """
    current = sql.lock_attempt_settings(
        table, {report.task.id for report, _ in rows if report.outcome in _DECIDED_WITH_CURRENT_SETTINGS}
    )
    decided: list[Row] = []
    for report, changes in rows:
        if report.task.id in current and report.outcome in _DECIDED_WITH_CURRENT_SETTINGS:
            task, cfg = report.task, cfgs[report.task.task_type]
            priority, max_retries, superseded_by = current[task.id]
            max_retries = cfg.max_retry_num if max_retries is None else max_retries
            if (task.priority, task.max_retries, task.superseded_by) != (priority, max_retries, superseded_by):
                task.priority, task.max_retries, task.superseded_by = priority, max_retries, superseded_by
                changes = _changes(report, cfg, now)
        decided.append((report, changes))
    return decided


def _chunks(rows: list[Row]) -> Iterator[list[Row]]:
    chunk: list[Row] = []
    size = 0
    for row in rows:
        row_size = _estimated_bytes(row)
        if chunk and (len(chunk) >= MAX_STATEMENT_ROWS or size + row_size > MAX_STATEMENT_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(row)
        size += row_size
    if chunk:
        yield chunk


def _estimated_bytes(row: Row) -> int:
    report, changes = row
    size = ROW_BYTES + len(changes.get("status_msg", ""))
    size += sum(len(entry.get("traceback", "")) for entry in changes.get("schedule_log", ()))
    if changes.get("result") is not None:
        # The worker measured its result when it checked it; others (rare) are measured here.
        size += report.result_size if report.result_size is not None else len(json.dumps(changes["result"]))
    if changes.get("context") is not None:
        size += len(json.dumps(changes["context"]))
    return size


def _database_answers() -> bool:
    """Whether the database answers now, on a new connection if this one broke.

    Asked after a failed write: if it answers, the write failed because of what it carried.
    """
    if connection.in_atomic_block:
        # The caller's transaction cannot move to a new connection; the savepoint kept this one usable.
        return connection.connection is not None and connection.is_usable()
    if connection.connection is not None and connection.is_usable():
        return True
    with contextlib.suppress(DatabaseError):
        connection.close()
    try:
        connection.ensure_connection()
    except DatabaseError:
        return False
    return connection.is_usable()


def _give_slots_back(
    accepted: list[Report], cfgs: dict[str, ScheduleCfg], limiter: Limiter | None, now: datetime
) -> None:
    # Only for attempts whose final update we made: a refused report's slot was given back by
    # whoever took the attempt away (or, for a stopped attempt, by handlers_returned). Slots are
    # named by attempt, so giving one back twice is harmless; and only once the update is
    # committed, or a claim could start before it lands. A stopped attempt whose handler still
    # runs keeps its slot (it lingers) until that handler returns or its deadline passes.
    attempts = [r.task for r in accepted if not (r.outcome == Outcome.TERMINATED and r.task.lease_expires_at > now)]
    if not attempts:
        return
    limiter = limiter or Limiter()
    limits = {task_type: cfg.concurrency_limit for task_type, cfg in cfgs.items()}
    transaction.on_commit(lambda: limiter.release(attempts, limits))


def _due_now(changes: dict[str, Any] | None, now: datetime) -> bool:
    return changes is not None and changes.get("status") == Status.PENDING and changes.get("run_after", now) <= now

"""Finishing attempts: the one function that ends attempts for everyone.

The worker's reports, taskwatch's rescues, operator actions and the HTTP API all end attempts
through `finish_attempts`: it decides each row's changes with the state machine, writes them with
guarded UPDATEs, gives each accepted attempt's limiter slot back exactly once, and wakes workers
for work it made due.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from ..models import ScheduleCfg, Status
from . import sql, wakeup
from .attempts import Outcome, Report
from .configs import configs
from .limiter import Limiter
from .transitions import row_changes


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
    is written once.
    """
    now = now or timezone.now()
    unique: dict[tuple[int, int], Report] = {}
    for report in reports:
        if report.outcome != Outcome.LOST:
            unique.setdefault((report.task.id, report.task.lease_token), report)
    if not unique:
        return []
    live = list(unique.values())
    cfgs = cfgs if cfgs is not None else configs.get_many({r.task.task_type for r in live})
    accepted, changes = _write(sql.task_table(), live, cfgs, guard, now)
    for report in accepted:
        report.written = changes[report.task.id]
    _give_slots_back(accepted, cfgs, limiter)
    # Requeued work that is due now (retries without delay, next stages, hand-backs): look at once.
    due = {r.task.task_type for r in accepted if _due_now(changes[r.task.id], now)}
    if due:
        wakeup.publish(due)
    return accepted


def _write(
    table: str, reports: list[Report], cfgs: dict[str, ScheduleCfg], guard: sql.Guard, now: datetime
) -> tuple[list[Report], dict[int, dict[str, Any]]]:
    # One UPDATE per group of rows sharing a token and the set of columns written.
    groups: dict[tuple[int, frozenset[str]], dict[int, Report]] = defaultdict(dict)
    changes: dict[int, dict[str, Any]] = {}
    for report in reports:
        row = row_changes(report, cfgs[report.task.task_type], now)
        changes[report.task.id] = row
        groups[(report.task.lease_token, frozenset(row))][report.task.id] = report
    accepted: list[Report] = []
    # All groups or none, so a retried flush never mistakes its own earlier writes for stale
    # reports; a single UPDATE is atomic by itself and skips the transaction's round trips.
    with transaction.atomic() if len(groups) > 1 else nullcontext():
        for (token, _), group in groups.items():
            count = sql.update_attempts(table, {tid: changes[tid] for tid in group}, token, guard)
            if count == len(group):
                accepted.extend(group.values())
            elif count:
                # Some were stale: ours are exactly those now carrying this write's timestamp.
                written_token = changes[next(iter(group))].get("lease_token", token)
                mine = sql.ids_written_at(table, group, written_token, now)
                accepted.extend(r for tid, r in group.items() if tid in mine)
    return accepted, changes


def _give_slots_back(accepted: list[Report], cfgs: dict[str, ScheduleCfg], limiter: Limiter | None) -> None:
    # Only for attempts whose final update we made: a refused report's slot was given back by
    # whoever took the attempt away. Slots are named by attempt, so giving one back twice is
    # harmless; and only once the update is committed, or a claim could start before it lands.
    if not accepted:
        return
    limiter = limiter or Limiter()
    attempts = [report.task for report in accepted]
    limits = {task_type: cfg.concurrency_limit for task_type, cfg in cfgs.items()}
    transaction.on_commit(lambda: limiter.release(attempts, limits))


def _due_now(changes: dict[str, Any], now: datetime) -> bool:
    return changes.get("status") == Status.PENDING and changes.get("run_after", now) <= now

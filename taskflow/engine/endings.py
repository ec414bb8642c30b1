"""Telling listeners that tasks ended, whoever ended them, once each ending commits.

Every place that writes a task's final status (a worker's or remote worker's report, taskwatch's
rescue or pending timeout, an operator, a failed dependency, a newer version) calls
`announce_finished` for the rows its write changed, so each ending is announced exactly once.
The django.tasks backend listens to send Django's `task_finished`. This module imports nothing
else of the engine, so any of those places can call it without an import cycle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from django.db import transaction

from ..models import Status, Task

log = logging.getLogger("taskflow.endings")

FINISHED = (Status.SUCCESS, Status.FAILED, Status.STOPPED)

Listener = Callable[[list[Task]], None]
# Each listener with the test of the task types it wants told of (a cheap check before any read).
_listeners: list[tuple[Listener, Callable[[str], bool]]] = []


def on_finished(listener: Listener, wants: Callable[[str], bool]) -> None:
    """Have `listener` told of ended tasks whose type `wants`, with their rows, after each ending commits."""
    if all(known is not listener for known, _ in _listeners):
        _listeners.append((listener, wants))


def wanted(task_type: str) -> bool:
    """Whether any listener wants to be told when a task of this type ends (else: skip reading which did)."""
    return any(wants(task_type) for _, wants in _listeners)


def announce_finished(tasks: Iterable[tuple[int, str]]) -> None:
    """These tasks ((id, task type)) were just ended by the caller: tell the listeners once it commits.

    Call it exactly where a final status is written, for the rows that write changed.
    """
    if not _listeners:
        return
    tasks = list(tasks)
    for listener, wants in _listeners:
        ids = [task_id for task_id, task_type in tasks if wants(task_type)]
        if ids:
            transaction.on_commit(lambda listener=listener, ids=ids: _announce(listener, ids))


def _announce(listener: Listener, ids: list[int]) -> None:
    try:
        rows = list(Task.objects.filter(id__in=ids, status__in=FINISHED))  # just ended: still in the hot table
        listener(rows)
    except Exception:
        # After the commit: the ending stands, whatever a listener does.
        log.exception("could not announce the end of task(s) %s", ids[:10])

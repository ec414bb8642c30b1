"""Which tasks a subcommand is about: task ids and the console's filters, as command-line options.

argparse `type=` functions reject malformed values (a bad id, date or status) before anything is
read; `TaskFilter.queryset` checks the rest against the database (an unknown task type) and builds
the queryset from the engine's filter rules (engine/filtering.py), the console's own.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from ..engine import filtering, payload_search
from ..engine.validation import MAX_BIGINT
from ..exceptions import InvalidTask
from ..models import Status, Task

STATUSES = [s.value for s in Status]
KNOWN_TYPES_NAMED = 10  # an unknown type's error names at most this many known ones
_AGO = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
_UNIT = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


# -- argparse types: each turns one option's text into a value, or says why it cannot ---------------


def task_id(text: str) -> int:
    value = text.strip().lstrip("#")
    if not value.isdigit() or not 0 < int(value) <= MAX_BIGINT:
        raise argparse.ArgumentTypeError(f"not a task id: {text!r}")
    return int(value)


def statuses(text: str) -> list[str]:
    """One status or several, comma-separated."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    for name in names or [text]:
        if name not in STATUSES:
            raise argparse.ArgumentTypeError(f"unknown status {name!r} (one of: {', '.join(STATUSES)})")
    return names


def names(text: str) -> list[str]:
    """Comma-separated names (task types)."""
    values = [name.strip() for name in text.split(",") if name.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no name in {text!r}")
    return values


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def moment(text: str) -> datetime:
    """A date and time ("2026-05-01T12:30", "2026-05-01"; local unless it has an offset), or a span ago ("90m")."""
    ago = _AGO.fullmatch(text.strip().lower())
    if ago:
        return timezone.now() - timedelta(**{_UNIT[ago[2]]: float(ago[1])})
    try:
        return filtering.parse_time("date", text)
    except InvalidTask:
        raise argparse.ArgumentTypeError(
            f"not a date and time: {text!r} (e.g. 2026-05-01T12:30, 2026-05-01, or 15m / 2h / 3d ago)"
        ) from None


# -- the options -----------------------------------------------------------------------------------


def add_filter_arguments(parser: argparse.ArgumentParser) -> None:
    """The console's task-list filters, plus task ids as positional arguments (every one must match)."""
    parser.add_argument("ids", nargs="*", type=task_id, metavar="ID", help="task ids")
    group = parser.add_argument_group("filters (as the console's task list; all given must match)")
    group.add_argument("--type", dest="types", type=names, action="extend", metavar="TYPE[,TYPE]", help="task type")
    group.add_argument("--status", type=statuses, action="extend", metavar="STATUS[,STATUS]", help="status")
    group.add_argument("--key", help="the task key (any version)")
    group.add_argument("--stage")
    group.add_argument("--priority-min", type=integer, metavar="N")
    group.add_argument("--priority-max", type=integer, metavar="N")
    when = "a date and time, or a span ago: 15m, 2h, 3d"
    group.add_argument("--created-from", type=moment, metavar="WHEN", help=when)
    group.add_argument("--created-to", type=moment, metavar="WHEN")
    group.add_argument("--finished-from", type=moment, metavar="WHEN", help="(finished tasks only)")
    group.add_argument("--finished-to", type=moment, metavar="WHEN")
    group.add_argument("--worker", metavar="WORKER_ID", help="tasks this worker runs now")
    group.add_argument(
        "--search",
        metavar="TERM",
        help="as the console's search: exact id, key, trace id or user id, or payload.PATH = VALUE "
        f"(among the newest {payload_search.SCAN_LIMIT:,} tasks matching the other filters)",
    )


@dataclass
class TaskFilter:
    """The selection options of one command line."""

    ids: list[int] = field(default_factory=list)
    types: list[str] = field(default_factory=list)
    status: list[str] = field(default_factory=list)
    key: str | None = None
    stage: str | None = None
    priority_min: int | None = None
    priority_max: int | None = None
    created_from: datetime | None = None
    created_to: datetime | None = None
    finished_from: datetime | None = None
    finished_to: datetime | None = None
    worker: str | None = None
    search: str | None = None
    # Set by queryset(): the id that bounded a payload search's scan (None: it read every match).
    scan_bound: int | None = field(default=None, init=False)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> TaskFilter:
        names = [f.name for f in fields(cls) if f.init]
        given = {name: options.get(name) for name in names if options.get(name) is not None}
        return cls(**given)

    def filters_given(self) -> bool:
        """Whether anything narrows the selection besides ids."""
        return any(getattr(self, f.name) not in (None, []) for f in fields(self) if f.init and f.name != "ids")

    def queryset(self) -> QuerySet[Task]:
        """The tasks matching every option given (of the task table; rolled tasks are reached by id)."""
        qs = Task.objects.all()
        types = list(dict.fromkeys(self.types))
        if types:
            known = filtering.known_types()
            unknown = [t for t in types if t not in known]
            if unknown:
                named = ", ".join(known[:KNOWN_TYPES_NAMED]) + (", ..." if len(known) > KNOWN_TYPES_NAMED else "")
                raise InvalidTask(f"unknown task type {unknown[0]!r} (known: {named or 'none yet'})")
            qs = qs.filter(task_type__in=types)
        if self.ids:
            qs = qs.filter(pk__in=self.ids)
        if self.status:
            qs = qs.filter(status__in=self.status)
        if self.key is not None:
            qs = filtering.with_key(qs, self.key, types)
        if self.stage is not None:
            qs = filtering.at_stage(qs, self.stage, types)
        qs = filtering.priority_between(qs, self.priority_min, self.priority_max, types)
        qs = filtering.created_between(qs, self.created_from, self.created_to, types)
        qs = filtering.finished_between(qs, self.finished_from, self.finished_to)
        if self.worker:
            qs = filtering.running_on(qs, self.worker)
        if self.search:
            try:
                by_payload = payload_search.parse(self.search.strip())
            except payload_search.BadPayloadSearch as exc:
                raise InvalidTask(f"--search: {exc}") from None
            if by_payload is None:
                qs = filtering.search(qs, self.search)
            else:
                qs, self.scan_bound = by_payload.apply(qs)
        return qs

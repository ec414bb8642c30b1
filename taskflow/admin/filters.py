"""The task list's filters, each one answered by an index (see docs/console.md, "Indexes").

Choices come from small tables (ScheduleCfg for types, WorkerProcess for workers), never from a
DISTINCT over the task table. A filter on a column that leads no index of its own (stage,
priority, created time) also names every known task type (`task_type IN (...)`, from the tiny
config table): the database then reads one short range per type of a `(task_type, column)` index
instead of the whole table.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from ..engine.validation import MAX_PRIORITY, MIN_PRIORITY
from ..models import ScheduleCfg, Status, WorkerProcess

TYPE_PARAM = "task_type"
FINISHED = (Status.SUCCESS, Status.FAILED, Status.STOPPED)


def known_types() -> list[str]:
    """Every task type ever enqueued: enqueue creates its ScheduleCfg row (the console keeps it)."""
    return list(ScheduleCfg.objects.order_by("task_type").values_list("task_type", flat=True))


def by_type(queryset: QuerySet, request: HttpRequest) -> QuerySet:
    """`queryset` limited to the known types, unless the type filter already picked one."""
    if request.GET.get(TYPE_PARAM):
        return queryset
    return queryset.filter(task_type__in=known_types())


class TaskTypeFilter(admin.SimpleListFilter):
    """Task types as listed in ScheduleCfg, which has a row for every type ever enqueued."""

    title = "task type"
    parameter_name = TYPE_PARAM

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(t, t) for t in known_types()]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(task_type=self.value()) if self.value() else queryset


class WorkerFilter(admin.SimpleListFilter):
    """What one worker runs now: its processing tasks, a prefix of the claim index."""

    # Finished tasks keep their last worker too, but finding those would need an index on
    # worker_id, which every claim would rewrite; "which machine runs what" needs only this.
    title = "running on worker"
    parameter_name = "worker"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        workers = list(WorkerProcess.objects.order_by("host", "worker_id").values_list("worker_id", flat=True))
        if self.value() and self.value() not in workers:
            workers.append(self.value())  # a worker gone since the link was made
        return [(w, w) for w in workers]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if not self.value():
            return queryset
        return queryset.filter(status=Status.PROCESSING, worker_id=self.value())


class InputFilter(admin.ListFilter):
    """A filter typed in rather than picked: a small GET form in the sidebar, plus quick links."""

    template = "admin/taskflow/input_filter.html"
    # (parameter, label, HTML input type) for each input of the form
    inputs: tuple[tuple[str, str, str], ...] = ()

    def __init__(self, request: HttpRequest, params: dict[str, list[str]], model: Any, model_admin: Any) -> None:
        super().__init__(request, params, model, model_admin)
        for name in self.expected_parameters():
            if name in params:
                value = params.pop(name)[-1].strip()
                if value:
                    self.used_parameters[name] = value

    def expected_parameters(self) -> list[str]:
        return [name for name, _, _ in self.inputs]

    def has_output(self) -> bool:
        return True

    def quick_links(self) -> list[tuple[str, dict[str, str]]]:
        """(label, parameters) for one-click values."""
        return []

    def choices(self, changelist: ChangeList) -> Iterator[dict[str, Any]]:
        mine = set(self.expected_parameters())
        hidden = [
            (name, value) for name, values in changelist.filter_params.items() if name not in mine for value in values
        ]
        links = [
            {
                "display": label,
                "query_string": changelist.get_query_string(values, remove=list(mine)),
                "selected": values == self.used_parameters,
            }
            for label, values in self.quick_links()
        ]
        if self.used_parameters:
            links.insert(0, {"display": "All", "query_string": changelist.get_query_string(remove=list(mine))})
        yield {
            "inputs": [
                {"name": name, "label": label, "type": kind, "value": self.used_parameters.get(name, "")}
                for name, label, kind in self.inputs
            ],
            "hidden": hidden,
            "links": links,
        }


class StageFilter(InputFilter):
    title = "stage"
    inputs = (("stage", "stage", "text"),)

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if "stage" not in self.used_parameters:
            return queryset
        return by_type(queryset, request).filter(stage=self.used_parameters["stage"])


class PriorityRangeFilter(InputFilter):
    title = "priority"
    inputs = (("priority_min", "from", "number"), ("priority_max", "to", "number"))

    def quick_links(self) -> list[tuple[str, dict[str, str]]]:
        return [("raised (> 0)", {"priority_min": "1"}), ("lowered (< 0)", {"priority_max": "-1"})]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        bounds = {}
        for name, lookup in (("priority_min", "priority__gte"), ("priority_max", "priority__lte")):
            if name in self.used_parameters:
                try:
                    value = int(self.used_parameters[name])
                except ValueError:
                    raise IncorrectLookupParameters(f"{name} must be an integer") from None
                bounds[lookup] = max(MIN_PRIORITY - 1, min(MAX_PRIORITY + 1, value))
        return by_type(queryset, request).filter(**bounds) if bounds else queryset


class TimeRangeFilter(InputFilter):
    """Tasks whose `field` lies in [from, to]; both ends optional, typed as local date and time."""

    field = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        prefix = cls.field.removesuffix("_at")
        cls.inputs = (
            (f"{prefix}_from", "from", "datetime-local"),
            (f"{prefix}_to", "to", "datetime-local"),
        )

    def quick_links(self) -> list[tuple[str, dict[str, str]]]:
        now = timezone.localtime()
        start = self.inputs[0][0]
        return [
            (label, {start: (now - timedelta(**span)).strftime("%Y-%m-%dT%H:%M")})
            for label, span in (
                ("last hour", {"hours": 1}),
                ("last 24 hours", {"days": 1}),
                ("last 7 days", {"days": 7}),
            )
        ]

    def bounds(self) -> dict[str, datetime]:
        (start, _, _), (end, _, _) = self.inputs
        out = {}
        for name, lookup in ((start, "gte"), (end, "lte")):
            if name in self.used_parameters:
                out[f"{self.field}__{lookup}"] = parse_time(name, self.used_parameters[name])
        return out

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        bounds = self.bounds()
        return self.indexed(queryset, request).filter(**bounds) if bounds else queryset

    def indexed(self, queryset: QuerySet, request: HttpRequest) -> QuerySet:
        raise NotImplementedError


class CreatedRangeFilter(TimeRangeFilter):
    title = "created"
    field = "created_at"

    def indexed(self, queryset: QuerySet, request: HttpRequest) -> QuerySet:
        return by_type(queryset, request)  # (task_type, created_at)


class FinishedRangeFilter(TimeRangeFilter):
    title = "finished"
    field = "finished_at"

    def indexed(self, queryset: QuerySet, request: HttpRequest) -> QuerySet:
        # (status, finished_at): only finished tasks have a finish time.
        return queryset.filter(status__in=FINISHED)


def parse_time(name: str, text: str) -> datetime:
    """A typed date and time ("2026-05-01T12:30", seconds optional), in the current time zone."""
    try:
        value = parse_datetime(text)
    except ValueError:
        value = None
    if value is None:
        raise IncorrectLookupParameters(f"{name}: not a date and time: {text!r}")
    return timezone.make_aware(value) if timezone.is_naive(value) else value

"""The task list's filters: the sidebar's inputs over the engine's filter rules (engine/filtering.py).

Choices come from small tables (ScheduleCfg for types, WorkerProcess for workers), never from a
DISTINCT over the task table; every filter is answered by an index (see docs/console.md).
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

from ..engine import filtering
from ..engine.filtering import known_types
from ..exceptions import InvalidTask
from ..models import WorkerProcess

TYPE_PARAM = "task_type"


def chosen_types(request: HttpRequest) -> list[str]:
    """The type the type filter picked, if any (the engine's rules then need not name every known type)."""
    return [request.GET[TYPE_PARAM]] if request.GET.get(TYPE_PARAM) else []


class TaskTypeFilter(admin.SimpleListFilter):
    """Task types as listed in ScheduleCfg, which has a row for every type ever enqueued."""

    title = "task type"
    parameter_name = TYPE_PARAM

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(t, t) for t in known_types()]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(task_type=self.value()) if self.value() else queryset


class WorkerFilter(admin.SimpleListFilter):
    """What one worker runs now (engine/filtering.py: running_on)."""

    title = "running on worker"
    parameter_name = "worker"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        workers = list(WorkerProcess.objects.order_by("host", "worker_id").values_list("worker_id", flat=True))
        if self.value() and self.value() not in workers:
            workers.append(self.value())  # a worker gone since the link was made
        return [(w, w) for w in workers]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return filtering.running_on(queryset, self.value()) if self.value() else queryset


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
        return filtering.at_stage(queryset, self.used_parameters["stage"], chosen_types(request))


class PriorityRangeFilter(InputFilter):
    title = "priority"
    inputs = (("priority_min", "from", "number"), ("priority_max", "to", "number"))

    def quick_links(self) -> list[tuple[str, dict[str, str]]]:
        return [("raised (> 0)", {"priority_min": "1"}), ("lowered (< 0)", {"priority_max": "-1"})]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        bounds: dict[str, int | None] = {}
        for name in ("priority_min", "priority_max"):
            bounds[name] = None
            if name in self.used_parameters:
                try:
                    bounds[name] = int(self.used_parameters[name])
                except ValueError:
                    raise IncorrectLookupParameters(f"{name} must be an integer") from None
        return filtering.priority_between(
            queryset, bounds["priority_min"], bounds["priority_max"], chosen_types(request)
        )


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

    def bounds(self) -> tuple[datetime | None, datetime | None]:
        """(from, to) as typed; either may be None."""
        return tuple(  # type: ignore[return-value]
            parse_time(name, self.used_parameters[name]) if name in self.used_parameters else None
            for name, _, _ in self.inputs
        )

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        start, end = self.bounds()
        return self.between(queryset, request, start, end) if (start or end) else queryset

    def between(
        self, queryset: QuerySet, request: HttpRequest, start: datetime | None, end: datetime | None
    ) -> QuerySet:
        raise NotImplementedError


class CreatedRangeFilter(TimeRangeFilter):
    title = "created"
    field = "created_at"

    def between(
        self, queryset: QuerySet, request: HttpRequest, start: datetime | None, end: datetime | None
    ) -> QuerySet:
        return filtering.created_between(queryset, start, end, chosen_types(request))


class FinishedRangeFilter(TimeRangeFilter):
    title = "finished"
    field = "finished_at"

    def between(
        self, queryset: QuerySet, request: HttpRequest, start: datetime | None, end: datetime | None
    ) -> QuerySet:
        return filtering.finished_between(queryset, start, end)


def parse_time(name: str, text: str) -> datetime:
    """A typed date and time, in the current time zone (engine/filtering.py); a bad one is the list's error."""
    try:
        return filtering.parse_time(name, text)
    except InvalidTask as exc:
        raise IncorrectLookupParameters(str(exc)) from None

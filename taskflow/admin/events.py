"""The audit trail: who changed which task, when and why (TaskEvent rows, read-only)."""

from __future__ import annotations

import json

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from ..engine.validation import MAX_BIGINT
from ..models import TaskEvent
from . import display
from .actions import OPERATIONS
from .filters import InputFilter
from .listing import ReadOnlyAdmin


class ActionFilter(admin.SimpleListFilter):
    """The operations' names, not a DISTINCT over the events (one row per task changed)."""

    title = "action"
    parameter_name = "action"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(name, op.label) for name, op in OPERATIONS.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[TaskEvent]) -> QuerySet[TaskEvent]:
        return queryset.filter(action=self.value()) if self.value() else queryset


class ActorFilter(InputFilter):
    title = "actor"
    inputs = (("actor", "user or process", "text"),)

    def queryset(self, request: HttpRequest, queryset: QuerySet[TaskEvent]) -> QuerySet[TaskEvent]:
        actor = self.used_parameters.get("actor")
        return queryset.filter(actor=actor) if actor else queryset


@admin.register(TaskEvent)
class TaskEventAdmin(ReadOnlyAdmin):
    list_display = ["at", "task", "action", "actor", "reason", "change_summary"]
    list_display_links = ["at"]
    list_filter = [ActionFilter, ActorFilter]
    search_fields = ["task_id"]  # shows the search box; get_search_results matches the exact id
    search_help_text = "Exact task id."
    ordering = ["-at", "-id"]
    sortable_by: list[str] = []

    class Media:
        css = {"all": ["taskflow/console.css"]}

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[TaskEvent], search_term: str
    ) -> tuple[QuerySet[TaskEvent], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        if not term.isdigit() or int(term) > MAX_BIGINT:
            return queryset.none(), False
        return queryset.filter(task_id=int(term)), False

    @admin.display(description="task")
    def task(self, event: TaskEvent) -> str:
        return display.task_link(event.task_id) if event.task_id is not None else display.EMPTY

    @admin.display(description="changes")
    def change_summary(self, event: TaskEvent) -> str:
        if not event.changes:
            return display.EMPTY
        return format_html('<code class="tf-changes">{}</code>', json.dumps(event.changes, ensure_ascii=False))

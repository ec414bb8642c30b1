"""Task types: their live schedule configs, paused and resumed from the console.

Workers re-read a config within CONFIG_REFRESH seconds, so an edit or a pause applies without a
restart. Editing needs `taskflow.change_schedulecfg`; the model validates every value.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ..engine import pausing
from ..models import ScheduleCfg, Status, Task
from . import display
from .listing import CappedChangeList, ConsoleAdmin


class TypeChangeList(CappedChangeList):
    """Also counts, in one query, the tasks each listed type runs now (the small processing set)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        types = [cfg.task_type for cfg in self.result_list]
        running = dict(
            Task.objects.filter(status=Status.PROCESSING, task_type__in=types)
            .values_list("task_type")
            .annotate(n=Count("id"))
            .order_by()
        )
        for cfg in self.result_list:
            cfg.running_now = running.get(cfg.task_type, 0)


@admin.register(ScheduleCfg)
class ScheduleCfgAdmin(ConsoleAdmin):
    """The live per-type configuration, with links to each type's tasks."""

    list_display = [
        "task_type",
        "paused",
        "running",
        "concurrency_limit",
        "tasks",
        "schedule_limit",
        "schedule_interval",
        "max_processing_time",
        "max_retry_num",
        "retry_strategy",
        "priority_aging",
        "updated_at",
    ]
    list_editable = ["paused", "concurrency_limit"]
    list_filter = ["paused", "retry_strategy"]
    search_fields = ["task_type"]
    ordering = ["task_type"]
    readonly_fields = ["updated_at"]
    actions = ["pause", "resume"]
    fieldsets = [
        (None, {"fields": ["task_type", "paused", "updated_at"]}),
        ("Claiming", {"fields": ["schedule_limit", "schedule_interval", "concurrency_limit", "priority_aging"]}),
        (
            "Attempts and retries",
            {
                "fields": [
                    "max_processing_time",
                    "max_retry_num",
                    "retry_strategy",
                    "retry_interval",
                    "max_retry_interval",
                    "retry_jitter",
                ]
            },
        ),
        ("Expiry", {"fields": ["pending_timeout", "success_retention", "purge_after_days"]}),
    ]

    class Media:
        css = {"all": ["taskflow/console.css"]}

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[CappedChangeList]:
        return TypeChangeList

    def get_readonly_fields(self, request: HttpRequest, obj: ScheduleCfg | None = None) -> list[str]:
        # The task type is the primary key: renaming it would detach the config from its tasks.
        return [*self.readonly_fields, "task_type"] if obj is not None else list(self.readonly_fields)

    def has_delete_permission(self, request: HttpRequest, obj: ScheduleCfg | None = None) -> bool:
        # The console lists a type's tasks through its config row (filters.known_types), so a type
        # keeps its row while it has tasks; an unused type's row may go.
        if obj is not None and Task.objects.filter(task_type=obj.task_type).exists():
            return False
        return super().has_delete_permission(request, obj)

    @admin.action(permissions=["change"], description="Pause the selected types (workers stop claiming them)")
    def pause(self, request: HttpRequest, queryset: QuerySet[ScheduleCfg]) -> None:
        self._set_paused(request, queryset, True)

    @admin.action(permissions=["change"], description="Resume the selected types")
    def resume(self, request: HttpRequest, queryset: QuerySet[ScheduleCfg]) -> None:
        self._set_paused(request, queryset, False)

    def _set_paused(self, request: HttpRequest, queryset: QuerySet[ScheduleCfg], paused: bool) -> None:
        changing = list(queryset.exclude(paused=paused))
        set_paused = pausing.pause if paused else pausing.resume
        set_paused([c.task_type for c in changing], by=request.user)
        verb = "paused" if paused else "resumed"
        for cfg in changing:
            self.log_change(request, cfg, [{"changed": {"fields": ["paused"]}}])
        names = ", ".join(c.task_type for c in changing) or "none (already " + verb + ")"
        messages.success(request, f"{verb.capitalize()} {len(changing)} task type(s): {names}.")

    @admin.display(description="running")
    def running(self, cfg: ScheduleCfg) -> SafeString | str:
        n = getattr(cfg, "running_now", None)
        if n is None:
            return display.EMPTY
        return format_html(
            '<a href="{}">{}</a>', display.tasks_url(task_type=cfg.task_type, status__exact="processing"), n
        )

    @admin.display(description="tasks")
    def tasks(self, cfg: ScheduleCfg) -> SafeString:
        links = [("all", {})] + [(s.value, {"status__exact": s.value}) for s in Status]
        return format_html_join(
            " · ",
            '<a href="{}">{}</a>',
            ((display.tasks_url(task_type=cfg.task_type, **query), label) for label, query in links),
        )

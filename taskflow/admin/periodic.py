"""Periodic tasks: their schedules, enabled and disabled, edited and run now from the console.

Every change goes through the engine (`taskflow.engine.periodic`): an edit writes only the fields
the form changed, under the row's lock, so it never undoes the leader's record of fired ticks.
Editing needs `taskflow.change_periodictask`; "run now" enqueues a task and so needs
`taskflow.operate_task`, like every other action on tasks. Adding a schedule, or changing what
its tasks are (`periodic.TASK_FIELDS`: type and payload), decides which tasks get made and so
also needs `taskflow.add_task`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..engine import periodic
from ..exceptions import StaleVersion
from ..models import PeriodicTask, Task
from . import display
from .actions import OPERATE_PERMISSION
from .listing import ConsoleAdmin


@admin.register(PeriodicTask)
class PeriodicTaskAdmin(ConsoleAdmin):
    list_display = ["name", "enabled", "task_type", "schedule", "next_run", "last_run", "tasks", "source"]
    list_filter = ["enabled", "source", "task_type"]
    search_fields = ["name", "task_type"]
    ordering = ["name"]
    actions = ["enable", "disable", "run_now_selected"]
    change_form_template = "admin/taskflow/periodictask/change_form.html"
    fieldsets = [
        (None, {"fields": ["name", "enabled", "source_note"]}),
        ("What runs", {"fields": ["task_type", "payload", "priority"]}),
        ("When", {"fields": ["cron", "every", "timezone", "catch_up"]}),
        ("Runs", {"fields": ["next_run", "last_run", "tasks", "settled"]}),
    ]
    readonly_fields = ["source_note", "next_run", "last_run", "tasks", "settled"]

    class Media:
        css = {"all": ["taskflow/console.css"]}

    def get_readonly_fields(self, request: HttpRequest, obj: PeriodicTask | None = None) -> list[str]:
        # The name is the tasks' key: renaming would detach the schedule from the tasks it fired.
        return [*self.readonly_fields, "name"] if obj is not None else list(self.readonly_fields)

    def has_delete_permission(self, request: HttpRequest, obj: PeriodicTask | None = None) -> bool:
        # A declared schedule would come back at the next sync: it is removed from its declaration.
        if obj is not None and obj.source != "console":
            return False
        return super().has_delete_permission(request, obj)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return super().has_add_permission(request) and self.has_make_tasks_permission(request)

    def has_make_tasks_permission(self, request: HttpRequest) -> bool:
        """taskflow.add_task: a schedule makes tasks, so setting what they are is creating tasks."""
        return request.user.has_perm(f"{Task._meta.app_label}.{get_permission_codename('add', Task._meta)}")

    def get_form(
        self, request: HttpRequest, obj: PeriodicTask | None = None, change: bool = False, **kwargs: Any
    ) -> type[ModelForm]:
        form = super().get_form(request, obj, change, **kwargs)
        if self.has_make_tasks_permission(request):
            return form

        class WithoutMakingTasks(form):  # type: ignore[misc,valid-type]
            def clean(self) -> dict[str, Any]:
                cleaned = super().clean()
                for name in periodic.TASK_FIELDS:
                    # Against the stored row (clean() runs before the form writes to it), not
                    # changed_data, which trusts the posted hidden initial of a JSON field.
                    if name in cleaned and cleaned[name] != getattr(self.instance, name):
                        self.add_error(name, "Changing what the schedule runs needs the taskflow.add_task permission.")
                return cleaned

        return WithoutMakingTasks

    def has_operate_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.{OPERATE_PERMISSION}")

    def save_model(self, request: HttpRequest, obj: PeriodicTask, form: ModelForm, change: bool) -> None:
        if not change:
            periodic.create_schedule(obj)
            return
        changes = {name: getattr(obj, name) for name in form.changed_data if name in periodic.DECLARED_FIELDS}
        if changes:
            periodic.edit_schedule(obj.pk, changes)
        obj.refresh_from_db()

    def get_urls(self) -> list[URLPattern]:
        run_now = path(
            "<path:object_id>/run-now/",
            self.admin_site.admin_view(self.run_now_view),
            name=f"{self.opts.app_label}_{self.opts.model_name}_run_now",
        )
        return [run_now, *super().get_urls()]

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {"can_run_now": self.has_operate_permission(request)}
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})

    def run_now_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST only: enqueue one extra run of the schedule, then back to its page."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_operate_permission(request):
            raise PermissionDenied
        schedule = get_object_or_404(PeriodicTask, pk=object_id)
        self._run_now(request, [schedule.pk])
        page = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[schedule.pk])
        return HttpResponseRedirect(page)

    @admin.action(permissions=["change"], description="Enable the selected schedules")
    def enable(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._set_enabled(request, queryset, True)

    @admin.action(permissions=["change"], description="Disable the selected schedules")
    def disable(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._set_enabled(request, queryset, False)

    @admin.action(permissions=["operate"], description="Run the selected schedules now (one extra task each)")
    def run_now_selected(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._run_now(request, list(queryset.values_list("pk", flat=True)))

    def _set_enabled(self, request: HttpRequest, queryset: QuerySet[PeriodicTask], enabled: bool) -> None:
        changed = periodic.set_enabled(queryset.values_list("pk", flat=True), enabled)
        for schedule in PeriodicTask.objects.filter(pk__in=changed):
            self.log_change(request, schedule, [{"changed": {"fields": ["enabled"]}}])
        verb = "enabled" if enabled else "disabled"
        names = ", ".join(changed) or f"none (already {verb})"
        messages.success(request, f"{verb.capitalize()} {len(changed)} schedule(s): {names}.")

    def _run_now(self, request: HttpRequest, names: list[str]) -> None:
        for name in names:
            try:
                task = periodic.run_now(name)
            except StaleVersion as exc:  # the clock went back past an earlier "run now"
                messages.error(request, f"Schedule {name}: not run ({exc}).")
                continue
            done = "already ran this second as" if task.enqueue_outcome == "existing" else "enqueued"
            messages.success(request, format_html("Schedule {}: {} task {}.", name, done, display.task_link(task.pk)))

    @admin.display(description="schedule")
    def schedule(self, schedule: PeriodicTask) -> str:
        return periodic.describe(schedule)

    @admin.display(description="next run", ordering="next_run_at")
    def next_run(self, schedule: PeriodicTask) -> str:
        if schedule.next_run_at is None:
            return "disabled" if not schedule.enabled else display.EMPTY
        return f"{_local(schedule.next_run_at)} ({display.relative(schedule.next_run_at)})"

    @admin.display(description="last run", ordering="last_run_at")
    def last_run(self, schedule: PeriodicTask) -> SafeString | str:
        if schedule.last_run_at is None or schedule.last_task_id is None:
            return display.EMPTY
        return format_html(
            "{} ({}) · task {}",
            _local(schedule.last_run_at),
            display.relative(schedule.last_run_at),
            display.task_link(schedule.last_task_id),
        )

    @admin.display(description="tasks")
    def tasks(self, schedule: PeriodicTask) -> SafeString:
        ticks = display.tasks_url(task_type=schedule.task_type, q=periodic.schedule_key(schedule.name))
        manual = display.tasks_url(task_type=schedule.task_type, q=periodic.manual_key(schedule.name))
        return format_html('<a href="{}">ticks</a> · <a href="{}">run now</a>', ticks, manual)

    @admin.display(description="ticks settled until")
    def settled(self, schedule: PeriodicTask) -> str:
        return str(schedule.settled_until)

    @admin.display(description="source")
    def source_note(self, schedule: PeriodicTask) -> str:
        if schedule.source == "console":
            return "made in the console"
        where = "TASKFLOW['PERIODIC']" if schedule.source == "settings" else "code (taskflow.periodic)"
        return (
            f"declared in {where}: edits here stand until the declaration changes, which then applies "
            "again (every declared field, enabled included)"
        )


def _local(moment: datetime) -> str:
    """A time in the site's time zone, to the second, with the zone's name."""
    return f"{timezone.localtime(moment):%Y-%m-%d %H:%M:%S %Z}"

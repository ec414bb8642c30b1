"""The history browser: read-only pages of the history tables that rolling fills (docs/rolling.md).

Rows link to the task page, which finds a task wherever it lives (taskflow.get_task); the only
action offered there for a task in history is retry_now, which brings it back to the task table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.http import urlencode

from ..engine import rolling
from ..engine.validation import MAX_BIGINT
from ..models import Status

if TYPE_CHECKING:
    from .tasks import TaskAdmin

PAGE = 50


class HistoryFilter(forms.Form):
    table = forms.TypedChoiceField(coerce=int, required=False, label="History table")
    task_type = forms.CharField(max_length=100, required=False, label="Task type")
    status = forms.ChoiceField(choices=[("", "any"), *Status.choices], required=False)
    before = forms.IntegerField(min_value=1, max_value=MAX_BIGINT, required=False, widget=forms.HiddenInput)

    def __init__(self, *args: Any, positions: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["table"].choices = [(p, rolling.history_table(p)) for p in positions]


def history_view(model_admin: TaskAdmin, request: HttpRequest) -> HttpResponse:
    """One page of one history table (the newest by default), newest task first."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    tables = list(rolling.kept().reverse())
    form = HistoryFilter(request.GET or None, positions=[p.position for p in tables])
    tasks, older_url = [], ""
    if tables and (not request.GET or form.is_valid()):
        values = form.cleaned_data if form.is_bound else {}
        position = values.get("table") or tables[0].position
        tasks = rolling.browse(
            position,
            task_type=values.get("task_type", ""),
            status=values.get("status", ""),
            before_id=values.get("before"),
            limit=PAGE + 1,
        )
        if len(tasks) > PAGE:
            tasks = tasks[:PAGE]
            query = {k: v for k, v in request.GET.items() if k != "before"} | {"table": position}
            older_url = "?" + urlencode({**query, "before": tasks[-1].id})
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Task history (read-only)",
        "opts": model_admin.opts,
        "form": form,
        "tables": tables,
        "tasks": tasks,
        "older_url": older_url,
        "task_list_url": reverse("admin:taskflow_task_changelist"),
        "media": model_admin.media,
    }
    return TemplateResponse(request, "admin/taskflow/task/history.html", context)

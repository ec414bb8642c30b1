"""Operator actions on tasks: terminate, retry now, reschedule, set priority, set max retries.

The console only collects input and calls the engine (`taskflow.engine.operations`): every
action, from a task's page or on the list (the selected rows, or every row matching the list's
filter), goes through one confirmation page that shows the engine's dry run, asks for a reason
and the new value, and reports what the engine changed and skipped. Acting needs
`taskflow.operate_task`; anything else gets 403.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import NON_FIELD_ERRORS, BadRequest, PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, QueryDict
from django.http.response import Http404
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.translation import ngettext

from ..engine import operations
from ..engine.operations import OperationResult
from ..exceptions import InvalidTask
from .listing import CAP, count_label

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from .tasks import TaskAdmin

OPERATE_PERMISSION = "operate_task"
MAX_REASON = 1000


class OperateForm(forms.Form):
    """What every action asks for: why. Subclasses add the new value."""

    reason = forms.CharField(
        max_length=MAX_REASON,
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text="Recorded in each task's history (required).",
    )
    value_fields: tuple[str, ...] = ()

    def value(self) -> dict[str, Any]:
        """The engine's keyword arguments for the new value, from cleaned data."""
        return {}


class RescheduleForm(OperateForm):
    run_at = forms.DateTimeField(
        required=False,
        label="run at",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local", "step": "1"}, format="%Y-%m-%dT%H:%M:%S"),
        help_text="Local date and time (the site's time zone).",
    )
    delay = forms.FloatField(required=False, min_value=0, label="or in (seconds)", help_text="Seconds from now.")
    value_fields = ("run_at", "delay")

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        given = [name for name in self.value_fields if data.get(name) is not None]
        if len(given) != 1 and not (self.errors.keys() & set(self.value_fields)):
            raise forms.ValidationError("Give either a date and time or a number of seconds from now.")
        return data

    def value(self) -> dict[str, Any]:
        run_at: datetime | None = self.cleaned_data.get("run_at")
        return {"run_after": run_at if run_at is not None else self.cleaned_data["delay"]}


class PriorityForm(OperateForm):
    priority = forms.IntegerField(help_text="-100 to 100; higher runs first.")
    value_fields = ("priority",)

    def value(self) -> dict[str, Any]:
        return {"priority": self.cleaned_data["priority"]}


class MaxRetriesForm(OperateForm):
    max_retries = forms.IntegerField(label="max retries", help_text="Retries after the first attempt (0 or more).")
    value_fields = ("max_retries",)

    def value(self) -> dict[str, Any]:
        return {"max_retries": self.cleaned_data["max_retries"]}


@dataclass(frozen=True)
class Operation:
    """One engine operation as the console offers it."""

    name: str  # the engine function's name, the admin action's name and the URL part
    label: str
    form: type[OperateForm]
    help: str

    def run(self, selection: Any, **kwargs: Any) -> OperationResult:
        engine_function: Callable[..., OperationResult] = getattr(operations, self.name)
        return engine_function(selection, **kwargs)


OPERATIONS = {
    op.name: op
    for op in (
        Operation(
            "terminate",
            "Terminate",
            OperateForm,
            "Pending tasks are stopped; running ones are stopped at once (their attempt is fenced and told).",
        ),
        Operation(
            "retry_now",
            "Retry now",
            OperateForm,
            "Failed and stopped tasks run again now with a fresh retry budget; delayed pending ones run now.",
        ),
        Operation(
            "reschedule",
            "Reschedule",
            RescheduleForm,
            "Pending tasks move to the new time; failed and stopped ones become pending at it.",
        ),
        Operation(
            "set_priority",
            "Set priority",
            PriorityForm,
            "Pending tasks move in the queue at once; others keep the priority for later attempts.",
        ),
        Operation(
            "set_max_retries",
            "Set max retries",
            MaxRetriesForm,
            "The retry budget; a running attempt's own failure is judged by the new value.",
        ),
    )
}


@dataclass
class Selection:
    """Which tasks an action is about: chosen ids, or every task matching the list's filter."""

    ids: list[str] = field(default_factory=list)
    across: bool = False
    filters: str = ""  # the list's query string (filters and search), without the page number
    from_task: bool = False  # started from a task's page: go back there afterwards

    @classmethod
    def from_data(cls, data: QueryDict) -> Selection:
        return cls(
            ids=data.getlist(helpers.ACTION_CHECKBOX_NAME),
            across=data.get("select_across") == "1",
            filters=data.get("_changelist_filters", ""),
            from_task=data.get("_from_task") == "1",
        )

    @classmethod
    def from_changelist(cls, request: HttpRequest) -> Selection:
        """What the list's action form posted: the checked rows, or "select all" (select_across)."""
        query = request.GET.copy()
        query.pop("p", None)
        return cls(
            ids=request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            across=request.POST.get("select_across") == "1",
            filters=query.urlencode(),
        )

    def hidden_fields(self) -> list[tuple[str, str]]:
        fields = [("select_across", "1" if self.across else "0"), ("_changelist_filters", self.filters)]
        if not self.across:
            fields += [(helpers.ACTION_CHECKBOX_NAME, task_id) for task_id in self.ids]
        if self.from_task:
            fields.append(("_from_task", "1"))
        return fields


def list_actions() -> list[Callable[..., Any]]:
    """The list's admin actions: each opens the confirmation page for the selection."""

    def make(op: Operation) -> Callable[..., Any]:
        def action(model_admin: TaskAdmin, request: HttpRequest, queryset: QuerySet) -> HttpResponse:
            return confirmation_page(model_admin, request, op, Selection.from_changelist(request))

        action.__name__ = op.name
        return admin.action(permissions=["operate"], description=f"{op.label}…")(action)

    return [make(op) for op in OPERATIONS.values()]


def check_operator(model_admin: TaskAdmin, request: HttpRequest) -> None:
    """403 unless the user may see tasks and act on them (a forged POST gets no redirect)."""
    if not (model_admin.has_view_permission(request) and model_admin.has_operate_permission(request)):
        raise PermissionDenied


def operate_view(model_admin: TaskAdmin, request: HttpRequest, action: str) -> HttpResponse:
    """The confirmation page of `action` (GET, or POST to preview) and, confirmed, the action itself."""
    check_operator(model_admin, request)
    op = OPERATIONS.get(action)
    if op is None:
        raise Http404(f"no action {action!r}")
    data = request.POST if request.method == "POST" else request.GET
    return confirmation_page(model_admin, request, op, Selection.from_data(data), bound=request.method == "POST")


def confirmation_page(
    model_admin: TaskAdmin, request: HttpRequest, op: Operation, selection: Selection, *, bound: bool = False
) -> HttpResponse:
    """The page itself: the dry run for the value typed so far, and, when confirmed, the action."""
    check_operator(model_admin, request)
    target = selected(model_admin, request, selection)
    form = op.form(request.POST if bound else None)
    if bound and form.is_valid() and "_confirm" in request.POST:
        try:
            result = op.run(target, by=request.user, reason=form.cleaned_data["reason"], **form.value())
        except InvalidTask as exc:
            form.add_error(None, str(exc))
        else:
            report(request, op, result)
            return HttpResponseRedirect(return_url(model_admin, selection))
    # A preview needs a valid new value (a missing reason does not stop it).
    value_given = not op.form.value_fields or (
        bound and not form.errors.keys() & {*op.form.value_fields, NON_FIELD_ERRORS}
    )
    preview = dry_run(op, target, request, form) if value_given else None
    opts = model_admin.opts
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"{op.label}: confirm",
        "opts": opts,
        "op": op,
        "form": form,
        "preview": preview,
        "selection": selection,
        "selected_label": selected_label(target, selection),
        "hidden_fields": selection.hidden_fields(),
        "form_url": reverse(f"admin:{opts.app_label}_{opts.model_name}_operate", args=[op.name]),
        "cancel_url": return_url(model_admin, selection),
        "media": model_admin.media + form.media,
    }
    return TemplateResponse(request, "admin/taskflow/task/operate.html", context)


def selected_label(target: Any, selection: Selection) -> str:
    """How many tasks are selected: the ids chosen, or the tasks matching now (capped count)."""
    if not selection.across:
        n = len(selection.ids)
        return ngettext("%(n)d selected task", "%(n)d selected tasks", n) % {"n": n}
    count = target.order_by().values("pk")[: CAP + 1].count()
    return f"all {count_label(count, count > CAP)} tasks matching the filter"


def selected(model_admin: TaskAdmin, request: HttpRequest, selection: Selection) -> Any:
    """The engine's selection: the chosen ids, or the list's filtered queryset (select all)."""
    if not selection.across:
        if not selection.ids:
            raise BadRequest("no tasks selected")
        return selection.ids
    listing = copy.copy(request)
    listing.GET = QueryDict(selection.filters)
    try:
        return model_admin.get_changelist_instance(listing).get_queryset(listing)
    except IncorrectLookupParameters as exc:
        raise BadRequest(f"the list's filter is not valid: {exc}") from None


def dry_run(op: Operation, target: Any, request: HttpRequest, form: OperateForm) -> OperationResult | None:
    """What the action would do now, or None with the engine's refusal added to the form."""
    value = form.value() if form.is_bound and op.form.value_fields else {}
    try:
        return op.run(target, by=request.user, reason="", dry_run=True, **value)
    except InvalidTask as exc:
        if not form.is_bound:  # the selection itself is wrong (ids in a forged link)
            raise BadRequest(str(exc)) from None
        form.add_error(None, str(exc))
        return None


def report(request: HttpRequest, op: Operation, result: OperationResult) -> None:
    """The result as admin messages: how many changed, and how many were skipped and why."""
    changed = ngettext("%(n)d task changed", "%(n)d tasks changed", result.changed) % {"n": result.changed}
    messages.success(request, f"{op.label}: {changed}.")
    if result.skipped:
        skipped = sum(result.skipped.values())
        reasons = ", ".join(f"{why}: {n}" for why, n in sorted(result.skipped.items()))
        messages.warning(
            request, ngettext("%(n)d task skipped", "%(n)d tasks skipped", skipped) % {"n": skipped} + f" ({reasons})."
        )


def return_url(model_admin: TaskAdmin, selection: Selection) -> str:
    opts = model_admin.opts
    if selection.from_task and len(selection.ids) == 1:
        return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[selection.ids[0]])
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
    return f"{url}?{selection.filters}" if selection.filters else url

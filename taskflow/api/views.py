"""The API's views: each validates its input with a serializer and calls one engine function."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers as drf
from rest_framework import status
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import NotFound
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

import taskflow

from ..engine import operations, remote, validation
from ..engine.attempts import Outcome
from ..engine.enqueueing import EXISTING
from ..exceptions import NextStage
from ..models import ScheduleCfg, Status, Task
from . import permissions as perms
from . import serializers as s
from .authentication import TokenOrBearerAuthentication
from .errors import LeaseLost, NotApplicable, exception_handler, flatten
from .lookup import load_task
from .pagination import ByTaskType, Pages
from .parsers import BoundedJSONParser


def errors(*codes: int) -> dict[int, type[s.ErrorSerializer]]:
    """The documented error answers of an endpoint (every endpoint may also answer 401, 403 and 503)."""
    return {code: s.ErrorSerializer for code in (*codes, 401, 403, 503)}


class ApiView(perms.PermissionsBeforeNegotiation, APIView):
    """Token or session (with CSRF) authentication, strict bounded JSON, and the API's JSON errors."""

    authentication_classes = [TokenOrBearerAuthentication, SessionAuthentication]
    permission_classes = [perms.LoggedIn]
    parser_classes = [BoundedJSONParser]
    renderer_classes = [JSONRenderer]
    schema = AutoSchema()

    def get_exception_handler(self) -> Callable[..., Response | None]:
        return exception_handler


def valid(serializer_class: type[drf.Serializer], data: Any, **kwargs: Any) -> dict[str, Any]:
    serializer = serializer_class(data=data, **kwargs)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


# -- tasks -------------------------------------------------------------------------------------------

LIST_FILTERS = ("task_type", "status", "key", "user_id", "stage")


class ListFilterSerializer(s.StrictSerializer):
    task_type = s.TaskTypeField(required=False)
    status = drf.ChoiceField(choices=Status.values, required=False)
    key = s.StrictText(required=False, max_length=255)
    user_id = s.StrictText(required=False, max_length=64)
    stage = s.StrictText(required=False, max_length=100)
    cursor = s.StrictText(required=False, max_length=1000)
    page_size = s.StrictText(required=False, max_length=10)


class TasksView(ApiView):
    permission_classes = [perms.Needs.on(GET=perms.VIEW, POST=perms.ADD)]

    @extend_schema(
        operation_id="tasks_list",
        parameters=[
            OpenApiParameter("task_type", str),
            OpenApiParameter("status", str, enum=Status.values),
            OpenApiParameter("key", str),
            OpenApiParameter("user_id", str),
            OpenApiParameter("stage", str),
            OpenApiParameter("cursor", str, description="the `next` or `previous` link's cursor"),
            OpenApiParameter("page_size", int, description="1 to 500 (default 50)"),
        ],
        responses={200: s.TaskPageSerializer, **errors(400)},
    )
    def get(self, request: Request) -> Response:
        """Tasks, newest first, filtered; cursor-paginated (no COUNT)."""
        query = valid(ListFilterSerializer, request.query_params.dict())
        filters = {name: query[name] for name in LIST_FILTERS if name in query}
        if ("key" in filters or "stage" in filters) and "task_type" not in filters:
            # Keys and stages are indexed after the type ((task_type, key, version), (task_type, stage)):
            # naming every known type (each has its ScheduleCfg row) lets the database use those indexes.
            filters["task_type__in"] = list(ScheduleCfg.objects.values_list("task_type", flat=True))
        paginator = Pages()
        page = paginator.paginate_queryset(Task.objects.filter(**filters), request, view=self)
        return paginator.get_paginated_response(s.TaskSerializer(page, many=True).data)

    @extend_schema(
        operation_id="tasks_create",
        request=s.CreateTaskSerializer,
        responses={200: s.TaskSerializer, 201: s.TaskSerializer, **errors(400, 409, 413)},
    )
    def post(self, request: Request) -> Response:
        """Create a task (201), or answer the live one with the same key and version (200); 409 if older."""
        task = taskflow.enqueue(**valid(s.CreateTaskSerializer, request.data))
        code = status.HTTP_200_OK if task.enqueue_outcome == EXISTING else status.HTTP_201_CREATED
        return Response(s.TaskSerializer(task).data, status=code)


class BulkCreateView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.ADD)]

    @extend_schema(
        operation_id="tasks_bulk_create",
        request=s.BulkCreateSerializer,
        responses={200: s.BulkResponseSerializer, **errors(400, 409, 413)},
    )
    def post(self, request: Request) -> Response:
        """Create up to 1,000 tasks in one transaction: all of them or, on any error, none."""
        tasks = taskflow.enqueue_many(valid(s.BulkCreateSerializer, request.data)["tasks"])
        shown = s.TaskSerializer(tasks, many=True).data  # one serializer: its fields are built once
        results = [{"outcome": t.enqueue_outcome, "task": data} for t, data in zip(tasks, shown, strict=True)]
        return Response({"results": results})


class TaskView(ApiView):
    permission_classes = [perms.Needs.on(GET=perms.VIEW)]

    @extend_schema(operation_id="tasks_retrieve", responses={200: s.TaskSerializer, **errors(404)})
    def get(self, request: Request, task_id: str) -> Response:
        return Response(s.TaskSerializer(load_task(task_id)).data)


class HoldView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.HOLD)]

    @extend_schema(
        operation_id="tasks_hold",
        request=s.HoldSerializer,
        responses={200: s.HoldResponseSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Claim up to `limit` due tasks for a remote worker; each comes with its lease."""
        data = valid(s.HoldSerializer, request.data)
        claimed = remote.hold(data["task_types"], data["limit"], data["worker_id"])
        rows = Task.objects.in_bulk([c.id for c in claimed])
        tasks = [rows[c.id] for c in claimed if c.id in rows]
        return Response({"tasks": s.HeldTaskSerializer(tasks, many=True).data})


# -- set: one task's report or operator change -----------------------------------------------------------

OPERATIONS: dict[str, Callable[..., operations.OperationResult]] = {
    "stopped": operations.terminate,
    "pending": operations.retry_now,
    "run_after": operations.reschedule,
    "priority": operations.set_priority,
    "max_retries": operations.set_max_retries,
}


def remote_report(held: remote.Held, data: dict[str, Any]) -> remote.RemoteReport:
    """A validated worker report (not a checkpoint) as the engine takes it."""
    kind, cost = data["kind"], data.get("cost_ms", 0)
    if kind == "success":
        return remote.RemoteReport(held, Outcome.SUCCESS, result=data["result"], cost_ms=cost)
    if kind == "failed":
        outcome = Outcome.ERROR if data.get("retry", True) else Outcome.FAIL
        return remote.RemoteReport(
            held, outcome, error=data.get("error", ""), detail=data.get("detail", ""), cost_ms=cost
        )
    if kind == "pending":
        return remote.RemoteReport(
            held, Outcome.SNOOZE, delay=data.get("delay", 0.0), error=data.get("error", ""), cost_ms=cost
        )
    step = NextStage(
        data["stage"], context=data.get("context"), delay=data.get("delay", 0.0), priority=data.get("priority")
    )
    return remote.RemoteReport(held, Outcome.NEXT_STAGE, next_stage=step, cost_ms=cost)


class TaskSetView(ApiView):
    @extend_schema(
        operation_id="tasks_set",
        request=s.SetSerializer,
        responses={200: s.SetAnswerSerializer, **errors(400, 404, 409, 413)},
    )
    def post(self, request: Request, task_id: str) -> Response:
        """A worker's report on its attempt (with `lease`), or one operator change (without).

        An operator's change answers the task as GET does, or only its state and the changed
        fields to a user without view_task (docs/api.md).
        """
        worker = isinstance(request.data, dict) and "lease" in request.data
        perms.require(request, perms.HOLD if worker else perms.OPERATE)
        task = load_task(task_id)
        data = valid(s.SetSerializer, request.data)
        if worker:
            held = remote.Held(task.id, data["lease"])
            if data["kind"] == "checkpoint":
                applied = remote.extend([(held, data["checkpoint"])])[0] is not None
            else:
                applied = remote.finish([remote_report(held, data)])[0]
            if not applied:
                raise LeaseLost()
        else:
            change = data["kind"]
            operation = OPERATIONS[data["status"] if change == "status" else change]
            options = {} if change == "status" else {change: data[change]}
            result = operation([task.id], by=request.user, reason=data.get("reason", ""), **options)
            if not result.changed:
                why = ", ".join(sorted(result.skipped)) or "nothing to change"
                raise NotApplicable(f"{result.action} does not apply to task {task.id}: {why}")
            can_view = request.user.has_perm(perms.VIEW)
            return Response(s.operated_task(load_task(task_id), can_view=can_view))
        return Response(s.HeldTaskSerializer(load_task(task_id)).data)  # with the lease: a checkpoint's new deadline


# -- batches for remote workers ----------------------------------------------------------------------------


class ReportRefSerializer(drf.Serializer):
    """A worker report as in the single set, plus `task_id` and `lease`; only those two are checked for the batch."""

    task_id = s.TaskIdField()
    lease = s.StrictInteger(min_value=0, max_value=validation.MAX_BIGINT)

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            raise drf.ValidationError("each item is a JSON object")
        return super().to_internal_value({k: data[k] for k in ("task_id", "lease") if k in data})


class ItemsSerializer(s.StrictSerializer):
    items = drf.ListField(child=ReportRefSerializer(), max_length=s.MAX_BATCH)


def refused(task_id: Any, error: str, detail: str = "") -> dict[str, Any]:
    answer = {"task_id": str(task_id), "outcome": "refused", "error": error}
    if detail:
        answer["detail"] = detail
    return answer


def applied(task_id: int) -> dict[str, Any]:
    return {"task_id": str(task_id), "outcome": "applied"}


class BatchSetView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.HOLD)]

    @extend_schema(
        operation_id="tasks_set_batch",
        # Documented as accepted at the HTTP level: an item's other fields are checked one by one
        # (a bad one is refused alone), so only task_id and lease are a request-wide contract.
        request=ItemsSerializer,
        responses={200: s.BatchResponseSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Workers' reports: each the single set's fields plus `task_id` and `lease`; a bad item is refused alone."""
        valid(ItemsSerializer, request.data)  # a malformed task_id or lease is the client's bug: all refused
        items = request.data["items"]
        results: list[dict[str, Any] | None] = [None] * len(items)
        reports: list[tuple[int, remote.RemoteReport]] = []
        checkpoints: list[tuple[int, remote.Held, Any]] = []
        checker = s.BatchSetItemSerializer()  # one for all items: building a serializer's fields is its dearest part
        for i, item in enumerate(items):
            try:
                data = checker.run_validation(item)
            except drf.ValidationError as exc:
                fields = flatten(exc.detail)
                detail = "; ".join(f"{k}: {' '.join(v)}" for k, v in fields.items())
                results[i] = refused(item["task_id"], "invalid", detail)
                continue
            held = remote.Held(data["task_id"], data["lease"])
            if data["kind"] == "checkpoint":
                checkpoints.append((i, held, data["checkpoint"]))
            else:
                reports.append((i, remote_report(held, data)))
        for (i, held, _), deadline in zip(checkpoints, remote.extend([(h, c) for _, h, c in checkpoints]), strict=True):
            results[i] = applied(held.task_id) if deadline else refused(held.task_id, "lease_lost")
        for (i, report), ok in zip(reports, remote.finish([r for _, r in reports]), strict=True):
            results[i] = applied(report.held.task_id) if ok else refused(report.held.task_id, "lease_lost")
        return Response({"results": results})


class HeartbeatView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.HOLD)]

    @extend_schema(
        operation_id="tasks_heartbeat",
        request=s.HeartbeatSerializer,
        responses={200: s.HeartbeatResponseSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Extend each attempt's deadline by its timeout; with `worker_id`, the worker's liveness beat instead.

        A beat lists every attempt the worker holds and extends none of them (only a handler's own
        heartbeat does, so a stuck one still times out); it answers which are still held. Those
        claimed for the worker that it does not list (a hold whose answer was lost) are handed
        back, and counted in `handed_back`.
        """
        data = valid(s.HeartbeatSerializer, request.data)
        helds = [remote.Held(item["task_id"], item["lease"]) for item in data["items"]]
        beat = "worker_id" in data
        deadlines = remote.held_deadlines(helds) if beat else remote.extend([(h, ...) for h in helds])
        answer: dict[str, Any] = {
            "results": [
                {**applied(h.task_id), "lease_expires_at": s.time_text(deadline)}
                if deadline
                else refused(h.task_id, "lease_lost")
                for h, deadline in zip(helds, deadlines, strict=True)
            ]
        }
        if beat:
            remote.beat(data["worker_id"])
            answer["handed_back"] = remote.hand_back_unlisted(data["worker_id"], helds)
        return Response(answer)


class ReleaseView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.HOLD)]

    @extend_schema(
        operation_id="tasks_release",
        request=s.LeaseBatchSerializer,
        responses={200: s.BatchResponseSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Hand claimed-but-unstarted tasks back to pending without using an attempt."""
        items = valid(s.LeaseBatchSerializer, request.data)["items"]
        helds = [remote.Held(item["task_id"], item["lease"]) for item in items]
        results = [
            applied(h.task_id) if ok else refused(h.task_id, "lease_lost")
            for h, ok in zip(helds, remote.release(helds), strict=True)
        ]
        return Response({"results": results})


# -- schedule configs and stats --------------------------------------------------------------------------


class ScheduleCfgsView(ApiView):
    permission_classes = [perms.Needs.on(GET=perms.VIEW_CONFIG)]

    @extend_schema(
        operation_id="schedule_cfgs_list",
        parameters=[OpenApiParameter("cursor", str), OpenApiParameter("page_size", int)],
        responses={200: s.ScheduleCfgPageSerializer, **errors(400)},
    )
    def get(self, request: Request) -> Response:
        paginator = ByTaskType()
        page = paginator.paginate_queryset(ScheduleCfg.objects.all(), request, view=self)
        return paginator.get_paginated_response(s.ScheduleCfgSerializer(page, many=True).data)


class ScheduleCfgView(ApiView):
    permission_classes = [perms.Needs.on(GET=perms.VIEW_CONFIG, PATCH=perms.CHANGE_CONFIG)]

    def _cfg(self, task_type: str) -> ScheduleCfg:
        cfg = ScheduleCfg.objects.filter(task_type=task_type).first()
        if cfg is None:
            raise NotFound(f"no schedule config for task type {task_type!r:.110}")
        return cfg

    @extend_schema(operation_id="schedule_cfgs_retrieve", responses={200: s.ScheduleCfgSerializer, **errors(404)})
    def get(self, request: Request, task_type: str) -> Response:
        return Response(s.ScheduleCfgSerializer(self._cfg(task_type)).data)

    @extend_schema(
        operation_id="schedule_cfgs_partial_update",
        request=s.ScheduleCfgSerializer,
        responses={200: s.ScheduleCfgSerializer, **errors(400, 404, 413)},
    )
    def patch(self, request: Request, task_type: str) -> Response:
        """Change some of a type's settings; validated by the model as in the admin, applied within CONFIG_REFRESH."""
        serializer = s.ScheduleCfgSerializer(self._cfg(task_type), data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        serializer.save()
        return Response(serializer.data)


class StatsQuerySerializer(s.StrictSerializer):
    # The stats rollup keeps whole minutes for a day (taskflow.engine.stats.MAX_WINDOW_S).
    window_s = drf.IntegerField(min_value=60, max_value=86400, required=False)


class StatsView(ApiView):
    permission_classes = [perms.Needs.on(GET=perms.VIEW)]

    @extend_schema(
        operation_id="stats",
        parameters=[
            OpenApiParameter(
                "window_s", int, description="seconds of finished tasks the rates cover, 60 to 86400 (default 3600)"
            )
        ],
        responses={200: OpenApiTypes.OBJECT, **errors(400, 404)},
    )
    def get(self, request: Request) -> Response:
        """Per-type counts, oldest pending age, success rate and run times: the console's numbers."""
        query = valid(StatsQuerySerializer, request.query_params.dict())
        try:
            stats = import_module("taskflow.engine.stats")  # the dashboard's module, loaded when first asked for
        except ModuleNotFoundError as exc:
            if exc.name != "taskflow.engine.stats":
                raise
            raise NotFound("stats are not available in this version of taskflow") from None
        return Response(stats.current(**query))

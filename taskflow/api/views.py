"""The API's views: each validates its input with a serializer and calls one engine function."""

from __future__ import annotations

import threading
from collections.abc import Callable
from importlib import import_module
from types import SimpleNamespace
from typing import Any

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers as drf
from rest_framework import status
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import APIException, NotFound
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

import taskflow

from ..engine import operations, remote, validation
from ..engine.attempts import ClaimedTask, Outcome
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


_serializers = threading.local()


def checker(serializer_class: type[drf.Serializer]) -> drf.Serializer:
    """This thread's serializer of `serializer_class`, made once: building one (a deep copy of every
    declared field) cost more than checking a request's body with it."""
    made = _serializers.__dict__
    serializer = made.get(serializer_class)
    if serializer is None:
        serializer = made[serializer_class] = serializer_class()
    return serializer


def valid(serializer_class: type[drf.Serializer], data: Any) -> dict[str, Any]:
    """`data` as validated by `serializer_class`; raises the 400 its `is_valid(raise_exception=True)` raises."""
    serializer = checker(serializer_class)
    for previous in ("_validated_data", "_errors", "_data"):  # what is_valid() and .data keep of the last call
        serializer.__dict__.pop(previous, None)
    serializer.initial_data = data
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


# -- remote workers: registration, and the credential every worker call presents ---------------------

WORKER_ID_HEADER = "Taskflow-Worker-Id"
WORKER_KEY_HEADER = "Taskflow-Worker-Key"
WORKER_HEADERS = [
    OpenApiParameter(
        WORKER_ID_HEADER,
        str,
        OpenApiParameter.HEADER,
        required=True,
        description="the `worker_id` POST workers/ issued",
    ),
    OpenApiParameter(
        WORKER_KEY_HEADER, str, OpenApiParameter.HEADER, required=True, description="the `worker_key` issued with it"
    ),
]


class WorkerRefused(APIException):
    status_code = status.HTTP_403_FORBIDDEN
    default_code = "worker_refused"
    default_detail = "a remote worker presents the worker id and key its registration returned"


class NotHeld(APIException):
    status_code = status.HTTP_403_FORBIDDEN
    default_code = "forbidden"
    default_detail = "this attempt_key is not the one given to this worker: the attempt is not its to report"


def calling_worker(request: Request) -> str:
    """The remote worker id the caller proved with its worker key (issued to this user), or 403."""
    try:
        return remote.authenticate(
            request.user.pk, request.headers.get(WORKER_ID_HEADER), request.headers.get(WORKER_KEY_HEADER)
        )
    except remote.WorkerRefused as exc:
        raise WorkerRefused(str(exc)) from None


def refusal(error: remote.Refused) -> APIException:
    return NotHeld() if error is remote.Refused.FORBIDDEN else LeaseLost()


class WorkersView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.HOLD)]

    @extend_schema(
        operation_id="workers_register",
        request=s.RegisterWorkerSerializer,
        responses={201: s.WorkerCredentialSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Register a remote worker: the server issues its id and key, bound to this user; both go with every call."""
        data = valid(s.RegisterWorkerSerializer, request.data)
        worker_id, key = remote.register(request.user.pk, **data)
        return Response({"worker_id": worker_id, "worker_key": key}, status=status.HTTP_201_CREATED)


class HoldView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.HOLD)]

    @extend_schema(
        operation_id="tasks_hold",
        parameters=WORKER_HEADERS,
        request=s.HoldSerializer,
        responses={200: s.HoldResponseSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Claim up to `limit` due tasks for the calling remote worker, and `reserve` more ahead; each comes with its
        lease and attempt key. Reserved ones are started with `tasks/start/` as threads free up."""
        worker_id = calling_worker(request)
        data = valid(s.HoldSerializer, request.data)
        claimed = remote.hold(data["task_types"], data["limit"], worker_id, reserve=data["reserve"])
        tasks = [held_task(c) for c in claimed]
        return Response({"tasks": s.HeldAttemptSerializer(tasks, many=True, context={"worker_id": worker_id}).data})


def held_task(claimed: ClaimedTask) -> SimpleNamespace:
    """A just-claimed task as HeldAttemptSerializer reads a Task, without reading it again: the attempt's data
    and the row's other columns as the claim left them (`shown`)."""
    assert claimed.shown is not None, "remote.hold claims with shown=True"
    return SimpleNamespace(
        **claimed.shown,
        id=claimed.id,
        task_type=claimed.task_type,
        key=claimed.key,
        version=claimed.version,
        priority=claimed.priority,
        payload=claimed.payload,
        stage=claimed.stage,
        context=claimed.context,
        checkpoint=claimed.checkpoint,
        trace_id=claimed.trace_id,
        lease_token=claimed.lease_token,
        progress=None,  # a new attempt has reported none yet
    )


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
        parameters=[
            OpenApiParameter(p.name, str, OpenApiParameter.HEADER, description=f"a worker's report: {p.description}")
            for p in WORKER_HEADERS
        ],
        request=s.SetSerializer,
        responses={200: s.SetAnswerSerializer, **errors(400, 403, 404, 409, 413)},
    )
    def post(self, request: Request, task_id: str) -> Response:
        """A worker's report on its attempt (with `lease`, `attempt_key` and worker headers), or one operator change.

        An operator's change answers the task as GET does, or only its state and the changed
        fields to a user without view_task (docs/api.md).
        """
        worker = isinstance(request.data, dict) and "lease" in request.data
        perms.require(request, perms.HOLD if worker else perms.OPERATE)
        worker_id = calling_worker(request) if worker else ""
        task = load_task(task_id)
        data = valid(s.SetSerializer, request.data)
        if worker:
            held = remote.Held(task.id, data["lease"], data["attempt_key"])
            if data["kind"] == "checkpoint":
                [outcome] = remote.extend(worker_id, [(held, data["checkpoint"])], [data.get("progress")])
                refused_as = outcome if isinstance(outcome, remote.Refused) else None
            else:
                [refused_as] = remote.finish(worker_id, [remote_report(held, data)])
            if refused_as is not None:
                raise refusal(refused_as)
            return Response(s.HeldTaskSerializer(load_task(task_id)).data)  # with the lease and a new deadline
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


# -- batches for remote workers ----------------------------------------------------------------------------


class ReportRefSerializer(drf.Serializer):
    """A worker report as in the single set (with `lease` and `attempt_key`), plus `task_id`.

    Only `task_id` and `lease` are checked for the whole batch; the rest item by item.
    """

    task_id = s.TaskIdField()
    lease = s.StrictInteger(min_value=0, max_value=validation.MAX_BIGINT)
    attempt_key = s.StrictText(required=False, max_length=s.MAX_ATTEMPT_KEY, help_text="the hold's attempt_key")

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            raise drf.ValidationError("each item is a JSON object")
        return super().to_internal_value({k: data[k] for k in ("task_id", "lease") if k in data})


class ItemsSerializer(s.StrictSerializer):
    items = drf.ListField(child=ReportRefSerializer(), max_length=s.MAX_BATCH)


def refused(task_id: Any, error: str, detail: str = "") -> dict[str, Any]:
    """One item's refusal: `invalid`, `lease_lost` (taken away) or `forbidden` (not this worker's attempt)."""
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
        parameters=WORKER_HEADERS,
        # Documented as accepted at the HTTP level: an item's other fields are checked one by one
        # (a bad one is refused alone), so only task_id and lease are a request-wide contract.
        request=ItemsSerializer,
        responses={200: s.BatchResponseSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Workers' reports: each the single set's fields plus `task_id`; a bad item is refused alone."""
        worker_id = calling_worker(request)
        body = request.data
        items = body.get("items") if isinstance(body, dict) and body.keys() == {"items"} else None
        # Success reports, nearly all of them, are checked without a serializer per item (s.plain_success).
        plain = [s.plain_success(i) for i in items] if isinstance(items, list) and len(items) <= s.MAX_BATCH else []
        if not plain or None in plain:
            valid(ItemsSerializer, body)  # a malformed task_id or lease is the client's bug: all refused
        items = body["items"]
        results: list[dict[str, Any] | None] = [None] * len(items)
        reports: list[tuple[int, remote.RemoteReport]] = []
        checkpoints: list[tuple[int, remote.Held, Any, Any]] = []
        item_checker = checker(s.BatchSetItemSerializer)
        for i, item in enumerate(items):
            try:
                data = (plain[i] if plain else None) or item_checker.run_validation(item)
            except drf.ValidationError as exc:
                fields = flatten(exc.detail)
                detail = "; ".join(f"{k}: {' '.join(v)}" for k, v in fields.items())
                results[i] = refused(item["task_id"], "invalid", detail)
                continue
            held = remote.Held(data["task_id"], data["lease"], data["attempt_key"])
            if data["kind"] == "checkpoint":
                checkpoints.append((i, held, data["checkpoint"], data.get("progress")))
            else:
                reports.append((i, remote_report(held, data)))
        # Each engine call beats for the worker: one of them is called even for a batch of none.
        if checkpoints:
            extended = remote.extend(
                worker_id, [(h, c) for _, h, c, _ in checkpoints], [p for *_, p in checkpoints]
            )
            for (i, held, *_), deadline in zip(checkpoints, extended, strict=True):
                results[i] = refused(held.task_id, deadline) if isinstance(deadline, str) else applied(held.task_id)
        if reports or not checkpoints:
            for (i, report), why in zip(reports, remote.finish(worker_id, [r for _, r in reports]), strict=True):
                results[i] = applied(report.held.task_id) if why is None else refused(report.held.task_id, why)
        return Response({"results": results})


class HeartbeatView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.HOLD)]

    @extend_schema(
        operation_id="tasks_heartbeat",
        parameters=WORKER_HEADERS,
        request=s.HeartbeatSerializer,
        responses={200: s.HeartbeatResponseSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Extend each attempt's deadline by its timeout (saving its `progress` if given); with `beat: true`, the
        worker's liveness beat instead.

        A beat lists every attempt the worker holds and extends none of them (only a handler's own
        heartbeat does, so a stuck one still times out); it answers which are still held. Those
        claimed for the calling worker that it does not list (a hold whose answer was lost) are
        handed back, and counted in `handed_back`. Only the caller's own attempts are ever touched.
        """
        worker_id = calling_worker(request)
        data = valid(s.HeartbeatSerializer, request.data)
        helds = [remote.Held(item["task_id"], item["lease"], item["attempt_key"]) for item in data["items"]]
        beat = data["beat"]
        if beat:
            deadlines = remote.held_deadlines(worker_id, helds)
        else:
            progress = [item.get("progress") for item in data["items"]]
            deadlines = remote.extend(worker_id, [(h, ...) for h in helds], progress)
        answer: dict[str, Any] = {
            "results": [
                refused(h.task_id, deadline)
                if isinstance(deadline, str)
                else {**applied(h.task_id), "lease_expires_at": s.time_text(deadline)}
                for h, deadline in zip(helds, deadlines, strict=True)
            ]
        }
        if beat:
            remote.beat(worker_id)
            answer["handed_back"] = remote.hand_back_unlisted(worker_id, helds)
        return Response(answer)


def each_held(request: Request, operation: Callable[[str, list[remote.Held]], list[Any]]) -> Response:
    """Apply an engine operation to the attempts a worker names (task, lease, attempt key): each applied or
    refused with why, for the calling worker only."""
    worker_id = calling_worker(request)
    items = valid(s.LeaseBatchSerializer, request.data)["items"]
    helds = [remote.Held(item["task_id"], item["lease"], item["attempt_key"]) for item in items]
    results = [
        applied(h.task_id) if why is None else refused(h.task_id, why)
        for h, why in zip(helds, operation(worker_id, helds), strict=True)
    ]
    return Response({"results": results})


class StartView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.HOLD)]

    @extend_schema(
        operation_id="tasks_start",
        parameters=WORKER_HEADERS,
        request=s.LeaseBatchSerializer,
        responses={200: s.BatchResponseSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Start reserved attempts (held with `reserve`) as the worker's threads take them; answers which it still
        holds, now started (their deadlines stay those of the hold). One refused was taken away: do not run it."""
        return each_held(request, remote.start)


class ReleaseView(ApiView):
    permission_classes = [perms.Needs.on(POST=perms.HOLD)]

    @extend_schema(
        operation_id="tasks_release",
        parameters=WORKER_HEADERS,
        request=s.LeaseBatchSerializer,
        responses={200: s.BatchResponseSerializer, **errors(400, 413)},
    )
    def post(self, request: Request) -> Response:
        """Hand claimed-but-unstarted tasks back to pending without using an attempt."""
        return each_held(request, remote.release)


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

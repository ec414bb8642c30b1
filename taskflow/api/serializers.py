"""What the API accepts and answers: strict JSON types, every value checked by the engine's own rules.

Fields take exactly their JSON type (no "5" for 5, no 1 for true), unknown fields are refused, and
each value is checked with the engine's validators, so an invalid value is a 400 naming its field
before anything is written.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.fields import empty

from ..engine import dependencies, remote, validation
from ..engine import progress as progress_rules
from ..exceptions import MAX_DELAY, MAX_REASON, MAX_STAGE, InvalidTask
from ..models import ScheduleCfg, Task
from .lookup import parse_task_id

MAX_BULK = 1000
MAX_BATCH = 1000
MAX_ATTEMPT_KEY = 200  # an attempt key is 64 hex digits; anything else is refused as not the holder's
# A due time a database stores everywhere, with room for the priority shift of order_time.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def engine_rule(check: Callable[..., Any], *args: Any) -> Callable[[Any], Any]:
    """A field validator running one of the engine's checks; its InvalidTask becomes the field's error."""

    def validate(value: Any) -> Any:
        try:
            return check(*args, value)
        except InvalidTask as exc:
            raise serializers.ValidationError(str(exc)) from None

    return validate


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know, and a body that is not a JSON object."""

    _given: Any = None  # the keys of the object being validated, while it is

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            return super().to_internal_value(data)
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({name: ["unknown field"] for name in unknown})
        self._given = data.keys()
        try:
            return super().to_internal_value(data)
        finally:
            self._given = None

    @property
    def _writable_fields(self) -> Any:
        # While an object is validated, only its own fields and those required or defaulted: DRF
        # skips an absent optional field without a default anyway (SkipField), after a round of
        # calls that, for a batch of a thousand reports each naming 5 of 17 fields, cost more than
        # the rest of the request.
        given = self._given
        for field in self._writable:
            if given is None or field.field_name in given or field.required or field.default is not empty:
                yield field

    @cached_property
    def _writable(self) -> list[serializers.Field]:
        return [field for field in self.fields.values() if not field.read_only]


class StrictInteger(serializers.IntegerField):
    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictNumber(serializers.FloatField):
    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            self.fail("invalid")
        try:
            value = float(data)
        except OverflowError:
            self.fail("invalid")
        if not math.isfinite(value):
            self.fail("invalid")
        return super().to_internal_value(value)


class StrictText(serializers.CharField):
    default_error_messages = {"not_text": "Must be a string."}

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("allow_blank", True)
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("not_text")
        text = super().to_internal_value(data)
        try:
            return validation.validate_short_text(self.field_name, text, self.max_length or 10**6)
        except InvalidTask as exc:
            raise serializers.ValidationError(str(exc)) from None


class TaskTypeField(StrictText):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_length=100, allow_blank=False, **kwargs)
        self.validators.append(engine_rule(validation.validate_task_type))


class StrictBoolean(serializers.BooleanField):
    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


@extend_schema_field(OpenApiTypes.ANY)
class JsonValue(serializers.JSONField):
    """Any JSON value the database can store under TASKFLOW["MAX_PAYLOAD_BYTES"] (checked with the field's name)."""

    def to_internal_value(self, data: Any) -> Any:
        engine_rule(validation.json_text, self.field_name)(data)
        return data


@extend_schema_field({"type": "string", "pattern": r"^[1-9][0-9]{0,18}$", "example": "7281947120394240"})
class TaskIdField(serializers.Field):
    """A task id: a decimal string in JSON (64-bit ids do not survive JavaScript numbers)."""

    default_error_messages = {"invalid": 'A task id is a string of decimal digits, e.g. "7281947120394240".'}

    def to_internal_value(self, data: Any) -> int:
        task_id = parse_task_id(data)
        if task_id is None:
            self.fail("invalid")
        return task_id  # type: ignore[return-value]

    def to_representation(self, value: Any) -> str:
        return str(value)


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "format": "date-time"},
            {"type": "number", "minimum": 0, "maximum": MAX_DELAY},
        ],
        "description": "an ISO 8601 time, or seconds from now (0 to a year)",
    }
)
class RunAfterField(serializers.Field):
    """When a task is due: an ISO 8601 time (naive means UTC), or seconds from now."""

    default_error_messages = {
        "invalid": "Give an ISO 8601 time or a number of seconds from 0 to a year.",
        "range": "Must be between 2000-01-01 and 9000-01-01.",
    }

    def to_internal_value(self, data: Any) -> datetime:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            if not (isinstance(data, int) or math.isfinite(data)) or not 0 <= data <= MAX_DELAY:
                self.fail("invalid")
            return timezone.now() + timedelta(seconds=float(data))
        if not isinstance(data, str):
            self.fail("invalid")
        try:
            when = serializers.DateTimeField(default_timezone=UTC).to_internal_value(data)
        except (serializers.ValidationError, OverflowError, ValueError):
            self.fail("invalid")
        if not EARLIEST <= when <= LATEST:
            self.fail("range")
        return when

    def to_representation(self, value: Any) -> Any:
        return value


def _priority(**kwargs: Any) -> StrictInteger:
    return StrictInteger(min_value=validation.MIN_PRIORITY, max_value=validation.MAX_PRIORITY, **kwargs)


def _count(**kwargs: Any) -> StrictInteger:
    return StrictInteger(min_value=0, max_value=validation.MAX_INT, **kwargs)


# -- tasks -------------------------------------------------------------------------------------------


class TaskSerializer(serializers.ModelSerializer):
    """A task as the API shows it."""

    task_id = TaskIdField(source="id", read_only=True)
    payload = serializers.JSONField(read_only=True)
    result = serializers.JSONField(read_only=True, allow_null=True)
    context = serializers.JSONField(read_only=True)
    checkpoint = serializers.JSONField(read_only=True, allow_null=True)
    progress = serializers.SerializerMethodField(
        help_text="the current (or last) attempt's ctx.progress(): done, total, message, percent, at; "
        "null until it reports (a new attempt starts with none)"
    )

    class Meta:
        model = Task
        fields = [
            "task_id",
            "task_type",
            "key",
            "version",
            "status",
            "status_msg",
            "priority",
            "payload",
            "result",
            "stage",
            "context",
            "checkpoint",
            "progress",
            "attempts",
            "max_retries",
            "timeout",
            "run_after",
            "user_id",
            "trace_id",
            "worker_id",
            "created_at",
            "updated_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields

    # Written out rather than DRF's per-field representation: a bulk create or a hold answers up
    # to a thousand tasks, and the generic path spent more time than the database. The fields
    # above still document the schema; tests check both agree.
    def to_representation(self, task: Task) -> dict[str, Any]:
        return {
            "task_id": str(task.id),
            "task_type": task.task_type,
            "key": task.key,
            "version": task.version,
            "status": task.status,
            "status_msg": task.status_msg,
            "priority": task.priority,
            "payload": task.payload,
            "result": task.result,
            "stage": task.stage,
            "context": task.context,
            "checkpoint": task.checkpoint,
            "progress": self.get_progress(task),
            "attempts": task.attempts,
            "max_retries": task.max_retries,
            "timeout": task.timeout,
            "run_after": time_text(task.run_after),
            "user_id": task.user_id,
            "trace_id": task.trace_id,
            "worker_id": task.worker_id,
            "created_at": time_text(task.created_at),
            "updated_at": time_text(task.updated_at),
            "started_at": time_text(task.started_at),
            "finished_at": time_text(task.finished_at),
        }


    @extend_schema_field(
        {
            "type": "object",
            "nullable": True,
            "properties": {
                "done": {"type": "number"},
                "total": {"type": "number"},
                "message": {"type": "string"},
                "percent": {"type": "number", "nullable": True},
                "at": {"type": "string", "format": "date-time"},
            },
        }
    )
    def get_progress(self, task: Task) -> dict[str, Any] | None:
        return progress_rules.shown(task.progress, task.lease_token)


def time_text(value: datetime | None) -> str | None:
    """As DRF writes an aware datetime in UTC: ISO 8601 with a "Z"."""
    if value is None:
        return None
    text = (value if value.tzinfo is UTC else value.astimezone(UTC)).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


class TaskPageSerializer(serializers.Serializer):
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = TaskSerializer(many=True)


class HeldTaskSerializer(TaskSerializer):
    """A task as a hold answers it: with the attempt's lease (fencing token) and deadline."""

    lease = serializers.IntegerField(source="lease_token", read_only=True)
    lease_expires_at = serializers.DateTimeField(read_only=True)

    class Meta(TaskSerializer.Meta):
        fields = [*TaskSerializer.Meta.fields, "lease", "lease_expires_at"]
        read_only_fields = fields

    def to_representation(self, task: Task) -> dict[str, Any]:
        return {
            **super().to_representation(task),
            "lease": task.lease_token,
            "lease_expires_at": time_text(task.lease_expires_at),
        }


# What an operator's change answers a user without view_task: the task's state and the fields an
# operator changes, none of its data (payload, result, context, checkpoint, messages, ids of others).
OPERATED_FIELDS = ("task_id", "task_type", "status", "priority", "max_retries", "run_after", "attempts", "updated_at")


def operated_task(task: Task, *, can_view: bool) -> dict[str, Any]:
    """The answer to an operator's change: the task as GET shows it, or only OPERATED_FIELDS without view_task."""
    shown = TaskSerializer(task).data
    return shown if can_view else {name: shown[name] for name in OPERATED_FIELDS}


class SetAnswerSerializer(HeldTaskSerializer):
    """The schema of a set's answer: a worker's report gets the task with its lease; an operator's change
    the task without it, and a user without view_task only OPERATED_FIELDS (the others are optional here)."""

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        for name, field in fields.items():
            if name not in OPERATED_FIELDS:
                field.read_only, field.required = False, False  # for the schema: not always present
        return fields


class HeldAttemptSerializer(HeldTaskSerializer):
    """A task held by the calling worker (`context={"worker_id": ...}`): also the attempt's key.

    The key is the secret its holder alone is given; every report, checkpoint, heartbeat and
    release of the attempt must present it.
    """

    attempt_key = serializers.SerializerMethodField(help_text="the holder's proof of this attempt (64 hex digits)")
    reserved = serializers.SerializerMethodField(
        help_text="claimed ahead and not started: start it (`tasks/start/`) before its handler runs, or release it"
    )

    class Meta(HeldTaskSerializer.Meta):
        fields = [*HeldTaskSerializer.Meta.fields, "attempt_key", "reserved"]
        read_only_fields = fields

    def get_attempt_key(self, task: Task) -> str:
        return remote.attempt_key(task.id, task.lease_token, self.context["worker_id"])

    def get_reserved(self, task: Task) -> bool:
        return task.started_at is None

    def to_representation(self, task: Task) -> dict[str, Any]:
        shown = super().to_representation(task)
        return {**shown, "attempt_key": self.get_attempt_key(task), "reserved": task.started_at is None}


class CreateTaskSerializer(StrictSerializer):
    """One task to create, with the options of taskflow.enqueue."""

    task_type = TaskTypeField()
    payload = JsonValue(required=False, default=dict)
    key = StrictText(required=False, max_length=255)
    version = StrictInteger(required=False, min_value=0, max_value=validation.MAX_BIGINT)
    priority = _priority(required=False)
    run_after = RunAfterField(required=False)
    max_retries = _count(required=False, allow_null=True)
    timeout = StrictInteger(required=False, allow_null=True, min_value=1, max_value=validation.MAX_INT)
    stage = StrictText(required=False, max_length=MAX_STAGE)
    user_id = StrictText(required=False, max_length=64)
    context = JsonValue(required=False, default=dict)
    trace_id = StrictText(required=False, max_length=32)
    retry_same_host = _count(required=False)
    # The task waits until these have succeeded (docs/dependencies.md); the engine checks they exist.
    depends_on = serializers.ListField(
        child=TaskIdField(), required=False, max_length=dependencies.MAX_DEPENDENCIES
    )
    on_dependency_failure = serializers.ChoiceField(choices=dependencies.ON_FAILURE, required=False)


class BulkCreateSerializer(StrictSerializer):
    tasks = CreateTaskSerializer(many=True, allow_empty=False, max_length=MAX_BULK)


class BulkResultSerializer(serializers.Serializer):
    outcome = serializers.ChoiceField(choices=["created", "existing", "replaced"])
    task = TaskSerializer()


class BulkResponseSerializer(serializers.Serializer):
    results = BulkResultSerializer(many=True)


class RegisterWorkerSerializer(StrictSerializer):
    """A remote worker introducing itself; the server issues its id from these."""

    host = StrictText(max_length=remote.MAX_HOST, allow_blank=False)
    pid = StrictInteger(min_value=0, max_value=validation.MAX_INT)
    task_types = serializers.ListField(child=TaskTypeField(), min_length=1, max_length=remote.MAX_HOLD_TYPES)
    concurrency = StrictInteger(min_value=1, max_value=remote.MAX_HOLD)


class WorkerCredentialSerializer(serializers.Serializer):
    worker_id = serializers.CharField(help_text="send it in the Taskflow-Worker-Id header of every worker call")
    worker_key = serializers.CharField(help_text="send it in the Taskflow-Worker-Key header of every worker call")


class HoldSerializer(StrictSerializer):
    task_types = serializers.ListField(child=TaskTypeField(), min_length=1, max_length=remote.MAX_HOLD_TYPES)
    limit = StrictInteger(min_value=0, max_value=remote.MAX_HOLD, help_text="tasks to start now, at most")
    reserve = StrictInteger(
        required=False,
        default=0,
        min_value=0,
        max_value=remote.MAX_HOLD,
        help_text="tasks to claim ahead after them, at most: held unstarted until `tasks/start/` (limited types: none)",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not 1 <= attrs["limit"] + attrs["reserve"] <= remote.MAX_HOLD:
            raise serializers.ValidationError({"limit": [f"limit and reserve must add up to 1 to {remote.MAX_HOLD}"]})
        return attrs


class HoldResponseSerializer(serializers.Serializer):
    tasks = HeldAttemptSerializer(many=True)


class ExactNumber(StrictNumber):
    """A JSON number kept as sent: an integer stays an integer."""

    def to_internal_value(self, data: Any) -> float:
        value = super().to_internal_value(data)
        return data if isinstance(data, int) else value


class ProgressSerializer(StrictSerializer):
    """A handler's progress as ctx.progress() takes it: numbers from 0, done <= total, a short message."""

    done = ExactNumber(min_value=0, max_value=progress_rules.MAX_NUMBER)
    total = ExactNumber(min_value=0, max_value=progress_rules.MAX_NUMBER)
    message = StrictText(required=False, max_length=progress_rules.MAX_MESSAGE)

    def validate(self, attrs: dict[str, Any]) -> progress_rules.Progress:  # type: ignore[override]
        done, total = attrs["done"], attrs["total"]
        if done > total:
            raise serializers.ValidationError({"done": [f"must not exceed total ({done} > {total})"]})
        return progress_rules.Progress(done, total, attrs.get("message", ""))


# -- set: a worker's report, or an operator's change --------------------------------------------------

WORKER_STATUSES = ("success", "failed", "pending")  # pending with a lease: snooze
OPERATOR_STATUSES = ("stopped", "pending")
OPERATOR_FIELDS = ("status", "run_after", "priority", "max_retries")
WORKER_ONLY = (
    "attempt_key",
    "result",
    "error",
    "detail",
    "retry",
    "stage",
    "context",
    "delay",
    "checkpoint",
    "progress",
    "cost_ms",
)
# Per kind of worker report: the fields it may carry besides lease (and task_id in a batch).
WORKER_KINDS = {
    "success": {"status", "result", "cost_ms"},
    "failed": {"status", "error", "detail", "retry", "cost_ms"},
    "pending": {"status", "delay", "error", "cost_ms"},
    "stage": {"stage", "context", "delay", "priority", "cost_ms"},
    "checkpoint": {"checkpoint", "progress"},
}


class SetSerializer(StrictSerializer):
    """One endpoint for both sides: with `lease` a worker's report, without it an operator's change."""

    lease = StrictInteger(required=False, min_value=0, max_value=validation.MAX_BIGINT)
    attempt_key = StrictText(
        required=False, allow_blank=False, max_length=MAX_ATTEMPT_KEY, help_text="with `lease`: the hold's attempt_key"
    )
    status = serializers.ChoiceField(choices=sorted({*WORKER_STATUSES, *OPERATOR_STATUSES}), required=False)
    result = JsonValue(required=False, allow_null=True)
    error = StrictText(required=False, max_length=MAX_REASON)
    detail = StrictText(required=False, max_length=MAX_REASON)
    retry = StrictBoolean(required=False)
    stage = StrictText(required=False, max_length=MAX_STAGE)
    context = JsonValue(required=False, allow_null=True)
    delay = StrictNumber(required=False, min_value=0, max_value=MAX_DELAY)
    priority = _priority(required=False)
    checkpoint = JsonValue(required=False, allow_null=True)
    progress = ProgressSerializer(required=False, help_text="with a checkpoint: the handler's progress")
    cost_ms = _count(required=False)
    run_after = RunAfterField(required=False)
    max_retries = _count(required=False)
    reason = StrictText(required=False, max_length=MAX_REASON)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "lease" in attrs:
            attrs["kind"] = self._worker_kind(attrs)
        else:
            attrs["kind"] = self._operator_change(attrs)
        return attrs

    def _worker_kind(self, attrs: dict[str, Any]) -> str:
        if "attempt_key" not in attrs:
            raise serializers.ValidationError(
                {"attempt_key": ["a worker's report carries the attempt_key its hold returned"]}
            )
        given = set(attrs) - {"lease", "attempt_key", "task_id"}
        if "status" in attrs:
            kind = attrs["status"]
            if kind not in WORKER_STATUSES:
                raise serializers.ValidationError({"status": [f"a worker reports one of {', '.join(WORKER_STATUSES)}"]})
        elif "stage" in attrs:
            kind = "stage"
        elif "checkpoint" in attrs:
            kind = "checkpoint"
        else:
            raise serializers.ValidationError("a report needs `status`, `stage` or `checkpoint`")
        extra = sorted(given - WORKER_KINDS[kind])
        if extra:
            raise serializers.ValidationError({name: [f"not part of a {kind} report"] for name in extra})
        if kind == "success" and "result" not in attrs:
            raise serializers.ValidationError({"result": ["a success report carries its result (null for none)"]})
        return kind

    def _operator_change(self, attrs: dict[str, Any]) -> str:
        worker_fields = sorted(set(attrs) & set(WORKER_ONLY))
        if worker_fields:
            raise serializers.ValidationError(
                {name: ["a worker's field: send it with the attempt's lease"] for name in worker_fields}
            )
        changes = [name for name in OPERATOR_FIELDS if name in attrs]
        if len(changes) != 1:
            raise serializers.ValidationError(
                f"an operator request makes exactly one change: one of {', '.join(OPERATOR_FIELDS)}"
            )
        if changes == ["status"] and attrs["status"] not in OPERATOR_STATUSES:
            raise serializers.ValidationError({"status": ["an operator sets `stopped` or `pending`"]})
        return changes[0]


class BatchSetItemSerializer(SetSerializer):
    """One report in a batch: the single set's fields plus the task and its lease."""

    task_id = TaskIdField()

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "lease" not in attrs:
            raise serializers.ValidationError({"lease": ["a batched report carries the attempt's lease"]})
        return super().validate(attrs)


_PLAIN_SUCCESS_FIELDS = frozenset({"task_id", "lease", "attempt_key", "status", "result", "cost_ms"})
_HEX_KEY = re.compile(r"[0-9a-f]{64}")


def plain_success(item: Any) -> dict[str, Any] | None:
    """A batched success report, as BatchSetItemSerializer validates it, or None if it is anything else.

    The shape nearly every report of a remote worker has, checked by the same rules without running a
    serializer per item (which cost more than the rest of the report); any other item, or one these
    checks doubt, goes through BatchSetItemSerializer and gets its answer and errors from it.
    """
    if type(item) is not dict or item.get("status") != "success" or "result" not in item:
        return None
    if not item.keys() <= _PLAIN_SUCCESS_FIELDS:
        return None
    task_id, lease, key = parse_task_id(item.get("task_id")), item.get("lease"), item.get("attempt_key")
    cost = item.get("cost_ms", 0)
    if task_id is None or type(lease) is not int or not 0 <= lease <= validation.MAX_BIGINT:
        return None
    if type(key) is not str or not _HEX_KEY.fullmatch(key):
        return None
    if type(cost) is not int or not 0 <= cost <= validation.MAX_INT:
        return None
    try:
        validation.json_text("result", item["result"])  # the rule of JsonValue
    except InvalidTask:
        return None
    data = {"task_id": task_id, "lease": lease, "attempt_key": key, "status": "success", "result": item["result"]}
    if "cost_ms" in item:
        data["cost_ms"] = cost
    return {**data, "kind": "success"}


class LeaseSerializer(StrictSerializer):
    task_id = TaskIdField()
    lease = StrictInteger(min_value=0, max_value=validation.MAX_BIGINT)
    attempt_key = StrictText(allow_blank=False, max_length=MAX_ATTEMPT_KEY, help_text="the hold's attempt_key")


class LeaseBatchSerializer(StrictSerializer):
    items = LeaseSerializer(many=True, max_length=MAX_BATCH)


class HeartbeatItemSerializer(LeaseSerializer):
    progress = ProgressSerializer(required=False, help_text="the handler's progress, saved with the heartbeat")


class HeartbeatSerializer(StrictSerializer):
    """Leases to extend (each with its progress, optionally); with `beat: true`, instead the worker's
    liveness beat listing every attempt it holds."""

    items = HeartbeatItemSerializer(many=True, max_length=MAX_BATCH)
    beat = StrictBoolean(required=False, default=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["beat"] and any("progress" in item for item in attrs["items"]):
            raise serializers.ValidationError({"beat": ["a liveness beat carries no progress: a heartbeat does"]})
        return attrs


class BatchResultSerializer(serializers.Serializer):
    task_id = TaskIdField()
    outcome = serializers.ChoiceField(choices=["applied", "refused"])
    error = serializers.CharField(required=False)
    detail = serializers.CharField(required=False)


class BatchResponseSerializer(serializers.Serializer):
    results = BatchResultSerializer(many=True)


class HeartbeatResultSerializer(BatchResultSerializer):
    lease_expires_at = serializers.DateTimeField(required=False, help_text="the new deadline of an applied one")


class HeartbeatResponseSerializer(serializers.Serializer):
    results = HeartbeatResultSerializer(many=True)
    handed_back = serializers.IntegerField(
        required=False, help_text="with beat: attempts of this worker it did not list, handed back"
    )


class ErrorSerializer(serializers.Serializer):
    error = serializers.CharField()
    detail = serializers.CharField()
    fields = serializers.DictField(child=serializers.ListField(child=serializers.CharField()), required=False)


# -- schedule configs -----------------------------------------------------------------------------------


class ScheduleCfgSerializer(serializers.ModelSerializer):
    """A task type's live config; edits are validated by the model, exactly as in the admin."""

    class Meta:
        model = ScheduleCfg
        exclude: list[str] = []
        read_only_fields = ["task_type", "updated_at"]

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - {n for n, f in self.fields.items() if not f.read_only})
            if unknown:
                raise serializers.ValidationError({name: ["unknown or read-only field"] for name in unknown})
            for name, value in data.items():
                wrong = (
                    isinstance(value, bool) != isinstance(self.fields[name], serializers.BooleanField)
                    or isinstance(value, str) != isinstance(self.fields[name], serializers.ChoiceField)
                    or value is None
                    or (isinstance(value, (int, float)) and not -1e300 < value < 1e300)
                )
                if wrong:
                    raise serializers.ValidationError({name: ["wrong type"]})
        return super().to_internal_value(data)

    def update(self, instance: ScheduleCfg, validated_data: dict[str, Any]) -> ScheduleCfg:
        for name, value in validated_data.items():
            setattr(instance, name, value)
        try:
            instance.clean_fields()
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None
        instance.save(update_fields=[*validated_data, "updated_at"])
        return instance


class ScheduleCfgPageSerializer(serializers.Serializer):
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = ScheduleCfgSerializer(many=True)

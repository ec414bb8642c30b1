"""Validation: task type names, the JSON size limit, text no database can store, and ScheduleCfg ranges."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.test import override_settings

import taskflow
from taskflow.conf import TaskflowSettings, get_settings, value_range
from taskflow.engine.attempts import heartbeat
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.registry import handler
from taskflow.engine.validation import json_text, storable_text, validate_task_type
from taskflow.models import RetryStrategy, ScheduleCfg, Task, TaskKey
from taskflow.runtime.context import TaskContext

T = "test.noop"
MIB = 1024 * 1024


def nothing_written() -> bool:
    return not Task.objects.exists() and not TaskKey.objects.exists() and not ScheduleCfg.objects.exists()


def with_settings(**values: Any) -> override_settings:
    from django.conf import settings

    return override_settings(TASKFLOW={**settings.TASKFLOW, **values})


def padded(size: int) -> dict[str, str]:
    """A payload whose JSON text is exactly `size` bytes."""
    overhead = len(json.dumps({"pad": ""}))
    return {"pad": "x" * (size - overhead)}


# -- task type names -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task_type",
    ["shop.tasks.send_receipt", "a", "A" + "b" * 99, "orders:confirm-v2", "mail.send_2"],
)
def test_task_type_names_a_django_module_path_would_use_are_valid(task_type: str) -> None:
    assert validate_task_type(task_type) == task_type


@pytest.mark.django_db
@pytest.mark.parametrize(
    "task_type",
    ["x.y\n", "\nx.y", "x.y\r\n", "x.y\x00", "x y", "x/y", "é.x", "-x", "_x", "1x", "*", "a" * 101, ""],
)
def test_a_task_type_with_anything_after_or_around_the_name_is_refused(task_type: str) -> None:
    # "x.y\n" used to pass (re.match's "$" matches before a trailing newline) and got a config row
    # of its own, a second type that looks the same as "x.y" in every listing.
    with pytest.raises(taskflow.InvalidTask, match="task_type must be 1-100 characters"):
        taskflow.enqueue(task_type)
    with pytest.raises(taskflow.InvalidTask):
        handler(task_type)
    assert nothing_written()


# -- size of JSON values ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_payload_up_to_the_default_limit_of_1_mib_is_stored_and_one_byte_more_is_refused() -> None:
    assert get_settings().MAX_PAYLOAD_BYTES == MIB
    with pytest.raises(taskflow.InvalidTask, match=r"payload is 1,048,577 bytes as JSON.*MAX_PAYLOAD_BYTES"):
        taskflow.enqueue(T, padded(MIB + 1))
    assert nothing_written()
    task = taskflow.enqueue(T, padded(MIB))
    assert Task.objects.get(pk=task.pk).payload == padded(MIB)


@pytest.mark.django_db
@pytest.mark.parametrize("field", ["payload", "context"])
def test_an_oversized_value_refuses_the_whole_bulk_call_naming_the_field(field: str) -> None:
    big = padded(2049)
    requests = [
        {"task_type": T, "payload": {"n": 1}},
        {"task_type": T, "key": "k", "payload": {"n": 2}},
        {"task_type": T, "payload": big} if field == "payload" else {"task_type": T, "context": big},
    ]
    with with_settings(MAX_PAYLOAD_BYTES=2048), pytest.raises(taskflow.InvalidTask, match=rf"^{field} is 2,049 bytes"):
        taskflow.enqueue_many(requests)
    assert nothing_written()


@pytest.mark.parametrize("size", [1024, 5000])
def test_the_limit_is_the_json_text_with_every_non_ascii_character_escaped(size: int) -> None:
    # Six bytes of JSON text per "é" ("\u00e9"), whatever the database's own encoding.
    value = {"pad": "é" * ((size - len('{"pad": ""}')) // 6)}
    with with_settings(MAX_PAYLOAD_BYTES=size):
        assert json_text("result", value) == json.dumps(value)
        value["pad"] += "é"
        with pytest.raises(taskflow.InvalidTask, match=r"^result is [\d,]+ bytes as JSON"):
            json_text("result", value)


@pytest.mark.parametrize(
    "value", [{1, 2}, float("inf"), {"nested": [object()]}, b"bytes"], ids=["set", "inf", "object", "bytes"]
)
def test_a_result_that_is_not_json_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(taskflow.InvalidTask, match="^result must be JSON-serialisable"):
        json_text("result", value)


def test_a_value_nested_too_deep_for_json_is_refused_not_a_recursion_error() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(taskflow.InvalidTask, match="^result must be JSON-serialisable"):
        json_text("result", deep)


# -- text no database can store --------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("payload", "options", "field"),
    [
        ({"text": "a\x00b"}, {}, "payload"),
        ({"a\x00": 1}, {}, "payload"),
        ({"text": "\\\x00"}, {}, "payload"),  # a backslash, then NUL: "\\\u0000" in JSON
        ({}, {"context": {"list": ["x", "\x00"]}}, "context"),
        ({"text": "lone \ud800 surrogate"}, {}, "payload"),
        ({"text": "\udc00\ud83d"}, {}, "payload"),
        ({}, {"key": "k\x00"}, "key"),
        ({}, {"stage": "index\x00"}, "stage"),
        ({}, {"trace_id": "\x00"}, "trace_id"),
        ({}, {"user_id": "u\x00"}, "user_id"),
        ({}, {"key": "k\ud800"}, "key"),
    ],
)
def test_nul_and_lone_surrogates_are_refused_the_same_way_on_every_database(
    payload: Any, options: dict[str, Any], field: str
) -> None:
    # PostgreSQL refuses them with a database error (other databases store them): refused here, before
    # anything is written, they are a clear InvalidTask everywhere.
    with pytest.raises(taskflow.InvalidTask, match=rf"^{field} contains"):
        taskflow.enqueue(T, payload, **options)
    assert nothing_written()


@pytest.mark.django_db
def test_text_that_only_looks_like_an_escape_and_paired_surrogates_are_stored_exactly() -> None:
    payload = {
        "backslash_u0000": "\\u0000",  # a backslash and "u0000": JSON "\\\\u0000", not a NUL
        "two_backslashes_u0000": "\\\\u0000",
        "emoji": "\U0001f600",  # a surrogate pair in JSON text
        "accents": "déjà vu",
    }
    task = taskflow.enqueue(T, payload, key="\\u0000 \U0001f600", stage="é")
    stored = Task.objects.get(pk=task.pk)
    assert (stored.payload, stored.key, stored.stage) == (payload, "\\u0000 \U0001f600", "é")


def test_storable_text_keeps_messages_readable_instead_of_losing_them() -> None:
    assert storable_text("plain") == "plain"
    assert storable_text("déjà vu \U0001f600") == "déjà vu \U0001f600"
    assert storable_text("a\x00b \ud800") == "a\\x00b \\ud800"


# -- checkpoints -----------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("checkpoint", "message"),
    [
        (padded(2049), r"^checkpoint is 2,049 bytes"),
        ({"at": "x\x00"}, r"^checkpoint contains a NUL"),
        ({"at": {1}}, r"^checkpoint must be JSON-serialisable"),
    ],
)
def test_a_checkpoint_no_database_could_store_is_refused_and_writes_nothing(checkpoint: Any, message: str) -> None:
    taskflow.enqueue(T)
    [held] = claim_batch(configs.get(T), 1, "w1")
    ctx = TaskContext(held)
    ctx.save_checkpoint({"at": 1})
    before = Task.objects.filter(pk=held.id).values().get()
    with with_settings(MAX_PAYLOAD_BYTES=2048):
        with pytest.raises(taskflow.InvalidTask, match=message):
            heartbeat(held, checkpoint=checkpoint)
        with pytest.raises(taskflow.InvalidTask, match=message):
            ctx.save_checkpoint(checkpoint)
    assert Task.objects.filter(pk=held.id).values().get() == before  # deadline and checkpoint kept
    assert ctx.checkpoint == {"at": 1}


# -- ScheduleCfg ranges ----------------------------------------------------------------------------


def valid_cfg(**fields: Any) -> ScheduleCfg:
    return ScheduleCfg(**{"task_type": "t.cfg", **fields})


@pytest.mark.django_db
def test_a_config_created_from_the_default_settings_is_valid() -> None:
    ScheduleCfg.from_settings("t.cfg").full_clean()
    # The settings and the fields share their ranges: a default at the edge of either is valid.
    for setting, field in [("SCHEDULE_LIMIT", "schedule_limit"), ("RETRY_JITTER", "retry_jitter")]:
        for edge in value_range(setting):
            valid_cfg(**{field: edge}).full_clean()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "bad_field"),
    [
        ({"max_processing_time": 0}, "max_processing_time"),
        ({"schedule_limit": 0}, "schedule_limit"),
        ({"schedule_limit": 1001}, "schedule_limit"),
        ({"schedule_interval": 0.0}, "schedule_interval"),
        ({"schedule_interval": -1.0}, "schedule_interval"),
        ({"schedule_interval": math.inf}, "schedule_interval"),
        ({"retry_interval": -5.0}, "retry_interval"),
        ({"retry_interval": math.nan}, "retry_interval"),
        ({"max_retry_interval": 1e300}, "max_retry_interval"),
        ({"retry_jitter": 1.5}, "retry_jitter"),
        ({"retry_jitter": -0.1}, "retry_jitter"),
        ({"priority_aging": -1.0}, "priority_aging"),
        ({"max_retry_num": 10_000}, "max_retry_num"),
        ({"purge_after_days": 10**6}, "purge_after_days"),
        ({"retry_interval": 600.0, "max_retry_interval": 60.0}, "retry_interval"),
        ({"retry_strategy": "linear"}, "retry_strategy"),
    ],
)
def test_full_clean_refuses_a_config_a_worker_could_not_run_with(fields: dict[str, Any], bad_field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        valid_cfg(**fields).full_clean()
    assert set(refused.value.error_dict) == {bad_field}


@pytest.mark.django_db
def test_a_form_showing_one_of_the_retry_intervals_gets_the_error_on_that_one() -> None:
    cfg = valid_cfg(retry_interval=600.0, max_retry_interval=60.0)
    with pytest.raises(ValidationError) as refused:
        cfg.full_clean(exclude=["retry_interval"])
    assert set(refused.value.error_dict) == {"max_retry_interval"}
    cfg.full_clean(exclude=["retry_interval", "max_retry_interval"])  # nothing shown, nothing to say


def test_the_settings_know_exactly_the_models_retry_strategies() -> None:
    from taskflow.conf import RETRY_STRATEGIES

    assert set(RETRY_STRATEGIES) == set(RetryStrategy.values)
    assert TaskflowSettings().RETRY_STRATEGY in RETRY_STRATEGIES


@pytest.mark.django_db
@pytest.mark.parametrize("run_after", [1e20, float("nan"), -1e20])
def test_a_run_after_no_database_can_store_is_refused_not_an_overflow(run_after: float) -> None:
    with pytest.raises(taskflow.InvalidTask, match="run_after"):
        taskflow.enqueue("test.noop", {}, run_after=run_after)
    assert not Task.objects.exists()

"""The HTTP API: creating, reading and listing tasks, authentication, permissions and bad input."""

from __future__ import annotations

import base64
import importlib.util
import json

import pytest
from django.contrib.auth.models import User
from django.test import override_settings
from rest_framework.test import APIClient

import taskflow
from taskflow.models import ScheduleCfg, Task, TaskKey
from tests.apiclients import ROLES, Api, api_as, user_with
from tests.remote_support import register_worker

pytestmark = pytest.mark.django_db
T = "api.job"


@pytest.fixture
def producer() -> Api:
    return api_as("producer")


def error_of(body: dict) -> str:
    assert set(body) <= {"error", "detail", "fields", "newest_version"} and body["detail"], body
    return body["error"]


# -- authentication --------------------------------------------------------------------------------------

ENDPOINTS = [
    ("get", "/api/tasks/"),
    ("post", "/api/tasks/"),
    ("post", "/api/tasks/bulk/"),
    ("get", "/api/tasks/1/"),
    ("post", "/api/tasks/1/set/"),
    ("post", "/api/tasks/hold/"),
    ("post", "/api/tasks/set/"),
    ("post", "/api/tasks/heartbeat/"),
    ("post", "/api/tasks/release/"),
    ("get", "/api/schedule-cfgs/"),
    ("get", "/api/schedule-cfgs/x/"),
    ("patch", "/api/schedule-cfgs/x/"),
    ("get", "/api/stats/"),
    ("get", "/api/schema/"),
]


@pytest.mark.parametrize(("method", "url"), ENDPOINTS)
def test_every_endpoint_answers_401_without_credentials(method: str, url: str) -> None:
    client = APIClient()
    response = (
        client.get(url) if method == "get" else getattr(client, method)(url, "{}", content_type="application/json")
    )
    assert response.status_code == 401
    assert response.json()["error"] == "not_authenticated"
    assert "Token" in response["WWW-Authenticate"]


def test_docs_need_a_logged_in_user_and_serve_swagger_from_our_own_static_files() -> None:
    assert APIClient().get("/api/docs/").status_code == 401
    client = APIClient()
    client.force_login(user_with("reader"))
    page = client.get("/api/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/" in html
    assert "cdn" not in html.lower() and "unpkg" not in html.lower()
    assert client.get("/api/schema/").json()["openapi"].startswith("3.")


def test_bearer_is_accepted_like_token_and_a_wrong_key_or_basic_auth_is_refused(producer: Api) -> None:
    assert Api(producer.user, keyword="Bearer").get("/api/tasks/")[0] == 200
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token not-a-key")
    assert client.get("/api/tasks/").status_code == 401
    basic = base64.b64encode(b"producer:pw-producer").decode()
    client.credentials(HTTP_AUTHORIZATION=f"Basic {basic}")
    response = client.get("/api/tasks/")
    assert response.status_code == 401 and response.json()["error"] == "not_authenticated"


def test_session_authentication_enforces_csrf() -> None:
    user = user_with("session", "add_task")
    client = APIClient(enforce_csrf_checks=True)
    client.login(username="session", password="pw-session")
    body = json.dumps({"task_type": T})
    refused = client.post("/api/tasks/", body, content_type="application/json")
    assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
    assert Task.objects.count() == 0
    client.get("/admin/login/")  # sets the CSRF cookie
    token = client.cookies["csrftoken"].value
    accepted = client.post("/api/tasks/", body, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert accepted.status_code == 201, accepted.content
    assert user.is_authenticated


# -- permissions per role ------------------------------------------------------------------------------

# The permission each endpoint needs (the set endpoint's depends on the side: see test_api_set).
NEEDS = {
    ("get", "/api/tasks/"): "view_task",
    ("post", "/api/tasks/"): "add_task",
    ("post", "/api/tasks/bulk/"): "add_task",
    ("get", "/api/tasks/{id}/"): "view_task",
    ("post", "/api/workers/"): "hold_task",
    ("post", "/api/tasks/hold/"): "hold_task",
    ("post", "/api/tasks/set/"): "hold_task",
    ("post", "/api/tasks/heartbeat/"): "hold_task",
    ("post", "/api/tasks/release/"): "hold_task",
    ("get", "/api/schedule-cfgs/"): "view_schedulecfg",
    ("get", "/api/schedule-cfgs/{type}/"): "view_schedulecfg",
    ("patch", "/api/schedule-cfgs/{type}/"): "change_schedulecfg",
}
BODIES = {
    "/api/tasks/": {"task_type": T},
    "/api/tasks/bulk/": {"tasks": [{"task_type": T}]},
    "/api/workers/": {"host": "h", "pid": 1, "task_types": [T], "concurrency": 1},
    "/api/tasks/hold/": {"task_types": [T], "limit": 1},
    "/api/tasks/set/": {"items": []},
    "/api/tasks/heartbeat/": {"items": []},
    "/api/tasks/release/": {"items": []},
    "/api/schedule-cfgs/{type}/": {"paused": False},
}


@pytest.mark.parametrize("role", ["nobody", "producer", "worker", "operator"])
def test_each_role_reaches_exactly_the_endpoints_its_permissions_allow(role: str) -> None:
    api = api_as(role)
    if "hold_task" in ROLES[role]:
        register_worker(api, task_types=(T,))  # worker calls carry the worker credential it was issued
    task = taskflow.enqueue(T)
    ScheduleCfg.objects.get_or_create(task_type=T)
    for (method, pattern), permission in NEEDS.items():
        url = pattern.format(id=task.id, type=T)
        status, body = api.call(method, url, BODIES.get(pattern))
        if permission in ROLES[role]:
            assert status in (200, 201), (role, method, url, status, body)
        else:
            assert (status, error_of(body)) == (403, "permission_denied"), (role, method, url, body)


# -- create ----------------------------------------------------------------------------------------------


def test_create_answers_201_with_the_task_and_string_ids(producer: Api) -> None:
    status, body = producer.post(
        "/api/tasks/",
        {
            "task_type": T,
            "payload": {"n": 1},
            "priority": 5,
            "stage": "fetch",
            "user_id": "u7",
            "context": {"a": [1]},
            "max_retries": 2,
            "timeout": 30,
            "trace_id": "abc",
        },
    )
    assert status == 201
    task = Task.objects.get()
    assert body["task_id"] == str(task.id) and isinstance(body["task_id"], str)
    assert (body["task_type"], body["payload"], body["priority"], body["stage"], body["status"]) == (
        T,
        {"n": 1},
        5,
        "fetch",
        "pending",
    )
    assert (task.user_id, task.context, task.max_retries, task.timeout, task.trace_id) == (
        "u7",
        {"a": [1]},
        2,
        30,
        "abc",
    )
    for name in ("key", "version", "status_msg", "result", "checkpoint", "attempts", "run_after", "worker_id"):
        assert name in body
    for name in ("created_at", "updated_at", "finished_at"):
        assert name in body


def test_create_accepts_run_after_as_a_time_or_seconds_from_now(producer: Api) -> None:
    assert producer.post("/api/tasks/", {"task_type": T, "run_after": "2030-01-02T03:04:05Z"})[0] == 201
    assert producer.post("/api/tasks/", {"task_type": T, "run_after": 60})[0] == 201
    times = sorted(Task.objects.values_list("run_after", flat=True))
    assert times[1].year == 2030 and times[0].year < 2030


def test_create_with_a_key_answers_existing_replaced_and_stale_versions(producer: Api) -> None:
    first = producer.post("/api/tasks/", {"task_type": T, "key": "k", "version": 2})
    again = producer.post("/api/tasks/", {"task_type": T, "key": "k", "version": 2, "payload": {"other": 1}})
    assert (first[0], again[0]) == (201, 200) and first[1]["task_id"] == again[1]["task_id"]
    taskflow.terminate([int(first[1]["task_id"])], by="test")
    replaced = producer.post("/api/tasks/", {"task_type": T, "key": "k", "version": 2})
    assert replaced[0] == 201 and replaced[1]["task_id"] == first[1]["task_id"]
    assert replaced[1]["status"] == "pending"
    status, body = producer.post("/api/tasks/", {"task_type": T, "key": "k", "version": 1})
    assert (status, error_of(body), body["newest_version"]) == (409, "stale_version", 2)
    assert Task.objects.count() == 1


BAD_CREATES = [
    ({"task_type": "1bad"}, "task_type"),
    ({"task_type": "a b"}, "task_type"),
    ({"task_type": 5}, "task_type"),
    ({}, "task_type"),
    ({"task_type": T, "priority": 101}, "priority"),
    ({"task_type": T, "priority": "5"}, "priority"),
    ({"task_type": T, "priority": 1.5}, "priority"),
    ({"task_type": T, "priority": True}, "priority"),
    ({"task_type": T, "version": -1}, "version"),
    ({"task_type": T, "key": 7}, "key"),
    ({"task_type": T, "key": "a\x00b"}, "key"),
    ({"task_type": T, "timeout": 0}, "timeout"),
    ({"task_type": T, "max_retries": -1}, "max_retries"),
    ({"task_type": T, "run_after": "yesterday"}, "run_after"),
    ({"task_type": T, "run_after": "0001-01-01T00:00:00Z"}, "run_after"),
    ({"task_type": T, "run_after": -5}, "run_after"),
    ({"task_type": T, "run_after": 10**30}, "run_after"),
    ({"task_type": T, "payload": {"s": "\x00"}}, "payload"),
    ({"task_type": T, "stage": "s" * 101}, "stage"),
    ({"task_type": T, "trace_id": "t" * 33}, "trace_id"),
    ({"task_type": T, "surprise": 1}, "surprise"),
]


@pytest.mark.parametrize(("body", "field"), BAD_CREATES)
def test_invalid_creates_are_400s_naming_the_field_and_write_nothing(producer: Api, body: dict, field: str) -> None:
    status, answer = producer.post("/api/tasks/", body)
    assert (status, error_of(answer)) == (400, "invalid"), answer
    assert field in answer["fields"], answer
    assert Task.objects.count() == 0


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"null", b'"text"', b'{"task_type": NaN}', b"\xff\xfe"])
def test_malformed_bodies_are_400s(producer: Api, raw: bytes) -> None:
    status, body = producer.post("/api/tasks/", raw=raw)
    assert status == 400 and error_of(body) in ("malformed_request", "invalid")
    assert Task.objects.count() == 0


@override_settings(TASKFLOW={"MAX_PAYLOAD_BYTES": 1024, "MAX_REQUEST_BYTES": 4096})
def test_a_payload_over_max_payload_bytes_is_a_400_naming_it_and_a_body_over_max_request_bytes_a_413(
    producer: Api,
) -> None:
    status, body = producer.post("/api/tasks/", {"task_type": T, "payload": "x" * 2000})
    assert status == 400 and "payload" in body["fields"] and "MAX_PAYLOAD_BYTES" in body["detail"]
    status, body = producer.post("/api/tasks/", {"task_type": T, "payload": "x" * 5000})
    assert (status, error_of(body)) == (413, "request_too_large")
    status, body = producer.post("/api/tasks/bulk/", {"tasks": [{"task_type": T, "payload": "x" * 600}] * 8})
    assert status == 413
    assert Task.objects.count() == 0


def test_the_default_request_limit_is_eight_mebibytes(producer: Api) -> None:
    body = b'{"task_type": "api.job", "payload": "' + b"x" * (8 * 1024 * 1024) + b'"}'
    status, answer = producer.post("/api/tasks/", raw=body)
    assert (status, error_of(answer)) == (413, "request_too_large")


def test_a_wrong_method_and_a_wrong_media_type_are_json_errors(producer: Api) -> None:
    status, body = producer.call("delete", "/api/tasks/")
    assert (status, error_of(body)) == (405, "method_not_allowed")
    response = producer.client.post("/api/tasks/", "task_type=x", content_type="application/x-www-form-urlencoded")
    assert response.status_code == 415 and response.json()["error"] == "unsupported_media_type"


# -- bulk --------------------------------------------------------------------------------------------------


def test_bulk_create_answers_each_outcome_in_request_order(producer: Api) -> None:
    kept = taskflow.enqueue(T, key="old", version=1)
    stopped = taskflow.enqueue(T, key="dead", version=1)
    taskflow.terminate([stopped.id], by="test")
    status, body = producer.post(
        "/api/tasks/bulk/",
        {
            "tasks": [
                {"task_type": T, "payload": {"i": 0}},
                {"task_type": T, "key": "old", "version": 1},
                {"task_type": T, "key": "dead", "version": 1},
                {"task_type": "api.other", "key": "new"},
            ]
        },
    )
    assert status == 200
    assert [r["outcome"] for r in body["results"]] == ["created", "existing", "replaced", "created"]
    assert body["results"][1]["task"]["task_id"] == str(kept.id)
    assert body["results"][2]["task"]["task_id"] == str(stopped.id)
    assert body["results"][0]["task"]["payload"] == {"i": 0}
    assert Task.objects.count() == 4


def test_bulk_create_is_all_or_nothing(producer: Api) -> None:
    taskflow.enqueue(T, key="k", version=5)
    before = (Task.objects.count(), TaskKey.objects.count())
    items = [{"task_type": T, "payload": {"i": i}} for i in range(3)]
    status, body = producer.post("/api/tasks/bulk/", {"tasks": [*items, {"task_type": T, "priority": 500}]})
    assert status == 400 and "tasks[3].priority" in body["fields"]
    status, body = producer.post("/api/tasks/bulk/", {"tasks": [*items, {"task_type": T, "key": "k", "version": 4}]})
    assert (status, error_of(body)) == (409, "stale_version")
    keyed = [{"task_type": T, "key": "x"}, {"task_type": T, "key": "k", "version": 1}]
    status, body = producer.post("/api/tasks/bulk/", {"tasks": [*items, *keyed]})
    assert status == 409
    assert (Task.objects.count(), TaskKey.objects.count()) == before


def test_bulk_create_takes_one_to_a_thousand_tasks(producer: Api) -> None:
    assert producer.post("/api/tasks/bulk/", {"tasks": []})[0] == 400
    assert producer.post("/api/tasks/bulk/", {"tasks": [{"task_type": T}] * 1001})[0] == 400
    assert producer.post("/api/tasks/bulk/", {"task": []})[0] == 400
    status, body = producer.post("/api/tasks/bulk/", {"tasks": [{"task_type": T, "payload": i} for i in range(1000)]})
    assert status == 200 and len(body["results"]) == 1000
    assert [r["task"]["payload"] for r in body["results"]] == list(range(1000))


# -- read --------------------------------------------------------------------------------------------------


def test_get_a_task_by_its_string_id_and_404_for_unknown_or_malformed_ids(producer: Api) -> None:
    task = taskflow.enqueue(T, {"n": 1})
    status, body = producer.get(f"/api/tasks/{task.id}/")
    assert status == 200 and body["task_id"] == str(task.id) and body["payload"] == {"n": 1}
    for bad in (task.id + 1, "abc", "-1", "0", "1" * 30, "1.5", "%20"):
        status, body = producer.get(f"/api/tasks/{bad}/")
        assert (status, error_of(body)) == (404, "not_found"), bad


def test_list_is_newest_first_filtered_and_cursor_paginated(producer: Api) -> None:
    tasks = [taskflow.enqueue(T, {"i": i}, user_id="u1" if i % 2 else "u2", stage="s") for i in range(7)]
    other = taskflow.enqueue("api.other", key="k1")
    status, body = producer.get("/api/tasks/")
    assert status == 200 and set(body) == {"next", "previous", "results"}
    assert [r["task_id"] for r in body["results"]] == [str(t.id) for t in [other, *reversed(tasks)]]

    seen: list[str] = []
    url = f"/api/tasks/?task_type={T}&page_size=3"
    while url:
        status, body = producer.get(url)
        assert status == 200 and len(body["results"]) <= 3
        seen += [r["task_id"] for r in body["results"]]
        url = body["next"]
    assert seen == [str(t.id) for t in reversed(tasks)]
    # ...and back again from the last page.
    assert body["previous"] is not None
    status, back = producer.get(body["previous"])
    assert [r["task_id"] for r in back["results"]] == seen[3:6]

    assert len(producer.get("/api/tasks/?user_id=u1")[1]["results"]) == 3
    assert [r["task_id"] for r in producer.get("/api/tasks/?key=k1")[1]["results"]] == [str(other.id)]
    assert len(producer.get("/api/tasks/?stage=s&status=pending")[1]["results"]) == 7
    assert producer.get("/api/tasks/?status=failed")[1]["results"] == []


@pytest.mark.parametrize(
    "query",
    [
        "page_size=0",
        "page_size=501",
        "page_size=abc",
        "page_size=-1",
        "status=sleeping",
        "task_type=1bad",
        "cursor=garbage",
        "cursor=" + base64.b64encode(b"p=abc").decode(),
        "cursor=" + base64.b64encode(b"o=-4").decode(),
        "colour=red",
    ],
)
def test_list_refuses_bad_query_parameters_with_400(producer: Api, query: str) -> None:
    status, body = producer.get(f"/api/tasks/?{query}")
    assert (status, error_of(body)) == (400, "invalid"), body


def test_list_page_size_bounds_are_one_and_five_hundred(producer: Api) -> None:
    taskflow.enqueue_many([{"task_type": T} for _ in range(501)])
    assert len(producer.get("/api/tasks/?page_size=1")[1]["results"]) == 1
    assert len(producer.get("/api/tasks/?page_size=500")[1]["results"]) == 500
    assert len(producer.get("/api/tasks/")[1]["results"]) == 50


def test_list_runs_no_count(producer: Api, django_assert_max_num_queries) -> None:  # noqa: ANN001
    taskflow.enqueue_many([{"task_type": T} for _ in range(5)])
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        producer.get(f"/api/tasks/?task_type={T}&page_size=2")
    statements = [q["sql"].upper() for q in queries.captured_queries]
    assert not any("COUNT(" in q for q in statements)
    assert sum('"TASKFLOW_TASK"' in q or "`TASKFLOW_TASK`" in q for q in statements) == 1


# -- schedule configs ------------------------------------------------------------------------------------


def test_schedule_configs_are_listed_read_and_patched_with_the_models_validation() -> None:
    api = api_as("operator")
    for name in ("b.type", "a.type"):
        ScheduleCfg.objects.create(task_type=name)
    status, body = api.get("/api/schedule-cfgs/")
    assert status == 200 and [c["task_type"] for c in body["results"]] == ["a.type", "b.type"]
    status, body = api.get("/api/schedule-cfgs/a.type/")
    assert status == 200 and body["schedule_limit"] == ScheduleCfg._meta.get_field("schedule_limit").default

    status, body = api.patch("/api/schedule-cfgs/a.type/", {"paused": True, "concurrency_limit": 4})
    assert status == 200 and body["paused"] is True and body["concurrency_limit"] == 4
    cfg = ScheduleCfg.objects.get(task_type="a.type")
    assert cfg.paused and cfg.concurrency_limit == 4

    bad = [
        ({"retry_interval": 100.0, "max_retry_interval": 10.0}, "retry_interval"),
        ({"schedule_limit": 0}, "schedule_limit"),
        ({"schedule_limit": "5"}, "schedule_limit"),
        ({"paused": "yes"}, "paused"),
        ({"retry_strategy": "random"}, "retry_strategy"),
        ({"task_type": "other"}, "task_type"),
        ({"colour": 1}, "colour"),
        ({"retry_jitter": 10**400}, "retry_jitter"),
    ]
    for change, field in bad:
        status, body = api.patch("/api/schedule-cfgs/a.type/", change)
        assert status == 400 and field in body["fields"], (change, body)
    cfg.refresh_from_db()
    assert (cfg.schedule_limit, cfg.retry_interval, cfg.max_retry_interval, cfg.retry_strategy) == (
        100,
        10.0,
        3600.0,
        "exponential",
    )

    assert api.get("/api/schedule-cfgs/none.such/")[0] == 404
    assert api.patch("/api/schedule-cfgs/none.such/", {"paused": True})[0] == 404
    assert not ScheduleCfg.objects.filter(task_type="none.such").exists()


def test_a_user_may_be_given_each_permission_alone() -> None:
    reader = Api(user_with("cfg-reader", "view_schedulecfg"))
    ScheduleCfg.objects.create(task_type="a.type")
    assert reader.get("/api/schedule-cfgs/a.type/")[0] == 200
    assert reader.patch("/api/schedule-cfgs/a.type/", {"paused": True})[0] == 403
    assert User.objects.count() == 1


def test_the_written_out_task_representation_is_what_drf_would_write() -> None:
    from rest_framework import serializers

    from taskflow.api.serializers import HeldTaskSerializer, TaskSerializer
    from taskflow.engine import remote

    taskflow.enqueue(T, {"a": [1, "x"]}, key="k", version=3, priority=-4, stage="s", user_id="u", context={"c": 1})
    [claimed] = remote.hold([T], 1, "host:1:w")
    task = Task.objects.get(pk=claimed.id)
    task.result, task.checkpoint = {"r": None}, [1, 2]
    for cls in (TaskSerializer, HeldTaskSerializer):
        serializer = cls(task)
        generic = serializers.ModelSerializer.to_representation(serializer, task)
        assert serializer.data == generic
        assert list(serializer.data) == list(generic)
    assert HeldTaskSerializer(task).data["lease"] == claimed.lease_token


@pytest.mark.skipif(
    importlib.util.find_spec("taskflow.engine.stats") is not None,
    reason="taskflow.engine.stats is installed (tests/test_api_stats.py covers the endpoint)",
)
def test_stats_without_the_stats_module_is_a_json_404(producer: Api) -> None:
    status, body = producer.get("/api/stats/")
    assert (status, error_of(body)) == (404, "not_found")


def test_create_with_depends_on_waits_for_its_dependencies_and_refuses_unknown_ones(producer: Api) -> None:
    first = taskflow.enqueue(T, {"n": 1})
    status, body = producer.post(
        "/api/tasks/", {"task_type": T, "depends_on": [str(first.id)], "on_dependency_failure": "run"}
    )
    assert status == 201 and body["status"] == "waiting"

    status, body = producer.post("/api/tasks/bulk/", {"tasks": [{"task_type": T, "depends_on": [str(first.id)]}]})
    assert status == 200, body
    assert body["results"][0]["task"]["status"] == "waiting"

    before = Task.objects.count()
    unknown = str(first.id + 1)
    for bad, field in (
        ({"depends_on": [unknown]}, "depends_on"),
        ({"depends_on": [first.id]}, "depends_on"),  # ids are strings in JSON
        ({"depends_on": str(first.id)}, "depends_on"),
        ({"depends_on": [str(first.id)], "on_dependency_failure": "ignore"}, "on_dependency_failure"),
    ):
        status, body = producer.post("/api/tasks/", {"task_type": T, **bad})
        assert status == 400 and error_of(body) == "invalid" and field in "".join(body["fields"]), body
    assert Task.objects.count() == before

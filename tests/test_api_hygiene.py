"""The API where its edges meet: what an operator's change shows, methods a view does not name, cursors
this API never gave out, ids past the bigint range, the schema's content types and unknown paths."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from django.core import signing
from django.tasks.exceptions import TaskResultDoesNotExist
from rest_framework.response import Response
from rest_framework.test import APIClient, APIRequestFactory, force_authenticate

import taskflow
from taskflow.api import permissions as perms
from taskflow.api.views import ApiView
from taskflow.models import ScheduleCfg, Task
from tests.apiclients import ROLES, Api, api_as, user_with
from tests.taskapp import djtasks

pytestmark = pytest.mark.django_db
T = "api.hygiene"
# What an operator's change shows a user without view_task (docs/api.md): no payload, result, context...
OPERATED_FIELDS = {"task_id", "task_type", "status", "priority", "max_retries", "run_after", "attempts", "updated_at"}
TOO_BIG = str(2**64)  # past every database's bigint: SQLite raised OverflowError at the query


def error_of(response: Any) -> str:
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    body = response.json()
    assert body["detail"], body
    return body["error"]


# -- (a) an operator without view_task ----------------------------------------------------------------


def test_an_operator_without_view_task_is_answered_the_tasks_state_not_its_data() -> None:
    task = taskflow.enqueue(T, {"secret": "card-4111"}, run_after=3600, context={"secret": "ctx"})
    operator = Api(user_with("op", "operate_task"))
    assert operator.get(f"/api/tasks/{task.id}/")[0] == 403
    status, body = operator.post(f"/api/tasks/{task.id}/set/", {"priority": 7})
    assert status == 200
    assert set(body) == OPERATED_FIELDS
    assert (body["task_id"], body["priority"], body["status"]) == (str(task.id), 7, "pending")
    status, body = operator.post(f"/api/tasks/{task.id}/set/", {"status": "stopped"})
    assert (status, set(body), body["status"]) == (200, OPERATED_FIELDS, "stopped")
    assert "card-4111" not in operator.response.content.decode()


def test_an_operator_with_view_task_is_answered_the_task_as_get_shows_it() -> None:
    task = taskflow.enqueue(T, {"visible": True}, run_after=3600)
    operator = Api(user_with("op", "operate_task", "view_task"))
    status, body = operator.post(f"/api/tasks/{task.id}/set/", {"max_retries": 2})
    assert status == 200 and body["max_retries"] == 2
    assert body == operator.get(f"/api/tasks/{task.id}/")[1]  # the attempt's lease is the holder's business


# -- (c) methods a view does not name -----------------------------------------------------------------


class PutHandlerView(ApiView):
    """A view whose handlers outnumber its permission map: PUT must not reach its code."""

    permission_classes = [perms.Needs.on(POST=perms.ADD)]
    reached: list[str] = []

    def post(self, request: Any) -> Response:
        self.reached.append("post")
        return Response({})

    def put(self, request: Any) -> Response:
        self.reached.append("put")
        return Response({})

    def get(self, request: Any) -> Response:
        self.reached.append("get")
        return Response({})


@pytest.mark.parametrize("method", ["put", "get", "head", "delete", "patch"])
def test_a_method_the_permission_map_does_not_name_is_refused_before_the_view_runs(method: str) -> None:
    PutHandlerView.reached = []
    request = getattr(APIRequestFactory(), method)("/x/")
    force_authenticate(request, user_with("everything", *ROLES["everything"]))
    response = PutHandlerView.as_view()(request)
    assert response.status_code == 405
    assert response.data["error"] == "method_not_allowed"
    assert PutHandlerView.reached == []


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("put", "/api/tasks/"),
        ("delete", "/api/tasks/"),
        ("patch", "/api/tasks/{id}/"),
        ("delete", "/api/tasks/{id}/"),
        ("get", "/api/tasks/hold/"),
        ("put", "/api/schedule-cfgs/{type}/"),
        ("delete", "/api/schedule-cfgs/{type}/"),
        ("post", "/api/stats/"),
        ("put", "/api/tasks/{id}/set/"),
    ],
)
def test_every_endpoint_answers_405_json_for_a_method_it_does_not_list(method: str, url: str) -> None:
    task = taskflow.enqueue(T, run_after=3600)
    client = APIClient()
    client.force_authenticate(user_with("everything", *ROLES["everything"]))
    url = url.format(id=task.id, type=T)
    body = {} if method == "get" else {"data": "{}", "content_type": "application/json"}
    response = getattr(client, method)(url, **body)
    assert (response.status_code, error_of(response)) == (405, "method_not_allowed")
    assert Task.objects.get(pk=task.pk).status == "pending"


def test_head_needs_what_get_needs_and_options_runs_no_view_code() -> None:
    task = taskflow.enqueue(T, run_after=3600)
    client = APIClient()
    client.force_authenticate(user_with("producer", "add_task"))
    # Before: HEAD was let through to the view (a 200 or 404 told a producer which task ids exist).
    assert client.head(f"/api/tasks/{task.id}/").status_code == 403
    assert client.head("/api/tasks/999/").status_code == 403
    assert client.head("/api/stats/").status_code == 403
    client.force_authenticate(user_with("reader", "view_task"))
    assert client.head(f"/api/tasks/{task.id}/").status_code == 200
    assert client.head("/api/tasks/999/").status_code == 404
    options = client.options("/api/tasks/")
    assert options.status_code == 200 and "POST" in options["Allow"]
    assert APIClient().options("/api/tasks/").status_code == 401


# -- (e) cursors --------------------------------------------------------------------------------------


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize(
    "cursor",
    [b64(""), b64("p=1"), b64("o=3"), b64("r=1"), b64("p=99999&o=0"), b64("x=1"), "e30", "e30:1abc:def"],
)
def test_a_cursor_this_api_never_gave_out_is_a_400(cursor: str) -> None:
    taskflow.enqueue_many([{"task_type": T} for _ in range(3)])
    reader = Api(user_with("reader", "view_task"))
    status, body = reader.get(f"/api/tasks/?cursor={cursor}")
    assert (status, body["error"], list(body["fields"])) == (400, "invalid", ["cursor"]), body


def test_a_cursor_works_for_its_own_list_only_and_a_changed_one_is_refused() -> None:
    taskflow.enqueue_many([{"task_type": T} for _ in range(3)] + [{"task_type": "api.other"} for _ in range(3)])
    reader = Api(user_with("reader", "view_task"))
    status, body = reader.get(f"/api/tasks/?task_type={T}&page_size=2")
    cursor = body["next"].split("cursor=")[1].split("&")[0]
    assert reader.get(f"/api/tasks/?task_type={T}&page_size=2&cursor={cursor}")[0] == 200
    assert reader.get(f"/api/tasks/?task_type={T}&page_size=1&cursor={cursor}")[0] == 200  # a page size may change
    for other in (f"task_type=api.other&cursor={cursor}", f"cursor={cursor}", f"task_type={T}&status=pending"):
        other += "" if "cursor" in other else f"&cursor={cursor}"
        status, body = reader.get(f"/api/tasks/?{other}")
        assert (status, list(body.get("fields", {}))) == (400, ["cursor"]), (other, body)
    forged = signing.dumps({"p": "1"}, salt="another:salt", compress=False)
    assert reader.get(f"/api/tasks/?task_type={T}&cursor={forged}")[0] == 400


def test_schedule_config_pages_refuse_a_foreign_cursor_too() -> None:
    for i in range(3):
        ScheduleCfg.objects.get_or_create(task_type=f"api.cfg{i}")
    reader = Api(user_with("cfgs", "view_schedulecfg"))
    status, body = reader.get("/api/schedule-cfgs/?page_size=1")
    assert status == 200 and body["next"]
    assert reader.get(body["next"])[0] == 200
    tasks_cursor = body["next"].split("cursor=")[1].split("&")[0]
    both = Api(user_with("both", "view_task"))
    assert both.get(f"/api/tasks/?cursor={tasks_cursor}")[0] == 400  # given out for another list
    assert reader.get("/api/schedule-cfgs/?cursor=" + b64("p=api.cfg1"))[0] == 400


# -- (f) ids past the bigint range ---------------------------------------------------------------------


@pytest.mark.parametrize("result_id", [TOO_BIG, str(2**63), "99999999999999999999999", "-1", "0", "1e3", " 1", "+1"])
def test_get_result_of_an_id_no_task_can_have_is_task_result_does_not_exist(result_id: str) -> None:
    with pytest.raises(TaskResultDoesNotExist):
        djtasks.noop_task.get_result(result_id)


def test_pages_and_api_answer_404_for_an_id_past_the_bigint_range(client: Any) -> None:
    assert client.get(f"/words/{TOO_BIG}/").status_code == 404
    assert client.get(f"/documents/{TOO_BIG}/").status_code == 404
    assert client.get(f"/documents/{TOO_BIG}/status/").status_code == 404
    reader = Api(user_with("reader", "view_task"))
    assert reader.get(f"/api/tasks/{TOO_BIG}/")[0] == 404
    operator = Api(user_with("op", "operate_task", "hold_task"))
    assert operator.post(f"/api/tasks/{TOO_BIG}/set/", {"priority": 1})[0] == 404
    producer = Api(user_with("producer", "add_task"))
    status, body = producer.post("/api/tasks/", {"task_type": T, "depends_on": [TOO_BIG]})
    assert (status, list(body["fields"])) == (400, ["depends_on[0]"]), body


# -- (g) the schema and unknown paths --------------------------------------------------------------------


def test_the_schema_is_served_as_application_json_and_anonymous_callers_get_401() -> None:
    client = APIClient()
    client.force_authenticate(user_with("reader"))
    for accept in ("application/json", "application/vnd.oai.openapi+json", "*/*"):
        response = client.get("/api/schema/", HTTP_ACCEPT=accept)
        assert response.status_code == 200, (accept, response.content[:200])
        assert response.json()["openapi"].startswith("3.")
    assert client.get("/api/schema/", HTTP_ACCEPT="application/json")["Content-Type"].startswith("application/json")
    assert error_of(client.get("/api/schema/", HTTP_ACCEPT="application/yaml")) == "not_acceptable"
    anonymous = APIClient()
    for accept in ("application/json", "text/html", "application/yaml", "*/*"):
        response = anonymous.get("/api/schema/", HTTP_ACCEPT=accept)
        assert (response.status_code, error_of(response)) == (401, "not_authenticated"), accept


@pytest.mark.parametrize("path", ["/api/tasks/", "/api/stats/", "/api/docs/", "/api/tasks/hold/"])
def test_a_caller_without_credentials_or_permission_hears_so_whatever_it_accepts(path: str) -> None:
    for accept in ("text/html", "application/xml", "application/json"):
        assert APIClient().get(path, HTTP_ACCEPT=accept).status_code == 401, accept
    client = APIClient()
    client.force_authenticate(user_with("nobody"))
    if path != "/api/docs/":
        assert client.get(path, HTTP_ACCEPT="text/html").status_code in (403, 405)
        assert client.get(path, HTTP_ACCEPT="application/json").status_code in (403, 405)
    # Allowed, the Accept header decides: 406 for what the endpoint cannot write.
    client.force_authenticate(user_with("everything", *ROLES["everything"]))
    if path in ("/api/tasks/", "/api/stats/"):
        assert error_of(client.get(path, HTTP_ACCEPT="application/xml")) == "not_acceptable"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/"),
        ("get", "/api/nothing-here/"),
        ("post", "/api/tasks/1/set/more/"),
        ("get", "/api/tasks"),
        ("delete", "/api/schema/extra"),
    ],
)
def test_an_unknown_path_under_the_api_is_a_json_404(method: str, path: str) -> None:
    client = APIClient()
    client.force_authenticate(user_with("reader", "view_task"))
    response = getattr(client, method)(path)
    assert (response.status_code, error_of(response)) == (404, "not_found")
    assert APIClient().get(path).status_code == 404


# -- a value the database refuses ---------------------------------------------------------------------


@pytest.mark.parametrize("error", ["DataError", "IntegrityError"])
def test_a_value_the_database_refuses_is_a_400_not_a_503_to_retry(monkeypatch, error: str) -> None:  # noqa: ANN001
    """Were validation ever to miss one, a client honouring Retry-After must not resend it for ever."""
    from django import db

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise getattr(db, error)("value refused by the database")

    monkeypatch.setattr(taskflow, "enqueue", refuse)
    producer = api_as("producer")
    status, body = producer.post("/api/tasks/", {"task_type": T})
    assert (status, body["error"]) == (400, "refused_by_database"), body
    assert not producer.response.has_header("Retry-After")

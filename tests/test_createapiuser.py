"""`manage.py createapiuser`: one command per API user, whose role really decides what the API lets it do."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

import taskflow
from taskflow.api.accounts import ROLES
from taskflow.management.commands.createapiuser import ROLE_NAMES

pytestmark = pytest.mark.django_db
T = "api.accounts"


def create(*args: str) -> str:
    """Run the command; returns what it printed on stdout (the token alone)."""
    out, err = io.StringIO(), io.StringIO()
    call_command("createapiuser", *args, stdout=out, stderr=err)
    assert "shown only this once" in err.getvalue()
    return out.getvalue().strip()


def api(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def post(client: APIClient, url: str, body: dict[str, Any]) -> int:
    return client.post(url, json.dumps(body), content_type="application/json").status_code


def test_the_command_offers_every_role() -> None:
    assert tuple(ROLES) == ROLE_NAMES


def test_a_worker_can_register_and_hold_but_not_read_or_operate() -> None:
    token = create("remote-1", "--role", "worker")
    user = User.objects.get(username="remote-1")
    assert not user.has_usable_password() and not user.is_staff
    assert [g.name for g in user.groups.all()] == ["taskflow API workers"]
    assert Token.objects.get(user=user).key == token
    task = taskflow.enqueue(T, {"n": 1})
    client = api(token)
    answer = client.post(
        "/api/workers/",
        json.dumps({"host": "h", "pid": 1, "task_types": [T], "concurrency": 1}),
        content_type="application/json",
    ).json()
    client.credentials(
        HTTP_AUTHORIZATION=f"Token {token}",
        HTTP_TASKFLOW_WORKER_ID=answer["worker_id"],
        HTTP_TASKFLOW_WORKER_KEY=answer["worker_key"],
    )
    held = client.post(
        "/api/tasks/hold/", json.dumps({"task_types": [T], "limit": 1}), content_type="application/json"
    ).json()
    assert [t["task_id"] for t in held["tasks"]] == [str(task.id)]
    assert client.get("/api/tasks/").status_code == 403
    assert post(client, f"/api/tasks/{task.id}/set/", {"status": "stopped"}) == 403


def test_a_viewer_can_read_but_not_operate_hold_or_create() -> None:
    client = api(create("dashboard", "--role", "viewer"))
    task = taskflow.enqueue(T, {"n": 1})
    assert client.get(f"/api/tasks/{task.id}/").status_code == 200
    assert client.get("/api/schedule-cfgs/").status_code == 200
    assert post(client, f"/api/tasks/{task.id}/set/", {"status": "stopped"}) == 403
    assert post(client, "/api/tasks/hold/", {"task_types": [T], "limit": 1}) == 403
    assert post(client, "/api/tasks/", {"task_type": T}) == 403
    task.refresh_from_db()
    assert task.status == "pending"


def test_an_operator_can_stop_a_task_but_not_create_one() -> None:
    client = api(create("ops", "--role", "operator"))
    task = taskflow.enqueue(T, {"n": 1})
    assert post(client, f"/api/tasks/{task.id}/set/", {"status": "stopped", "reason": "test"}) == 200
    task.refresh_from_db()
    assert task.status == "stopped"
    assert post(client, "/api/tasks/", {"task_type": T}) == 403


def test_a_producer_can_create_tasks() -> None:
    client = api(create("shop", "--role", "producer"))
    assert post(client, "/api/tasks/", {"task_type": T, "payload": {"n": 2}}) == 201


def test_an_existing_user_is_an_error_and_keeps_its_token() -> None:
    token = create("remote-1", "--role", "worker")
    with pytest.raises(CommandError, match="exists already: pass --rotate-token"):
        create("remote-1", "--role", "operator")
    user = User.objects.get(username="remote-1")
    assert Token.objects.get(user=user).key == token
    assert [g.name for g in user.groups.all()] == ["taskflow API workers"]


def test_rotate_token_replaces_the_old_one() -> None:
    old = create("remote-1", "--role", "worker")
    new = create("remote-1", "--rotate-token")
    assert new != old
    assert api(old).get("/api/schema/").status_code == 401
    assert api(new).get("/api/schema/").status_code == 200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bad name!", "--role", "worker"), "cannot be created: username"),
        (("", "--role", "worker"), "cannot be created"),
        (("x" * 151, "--role", "worker"), "cannot be created"),
        (("remote-1",), "--role is required"),
        (("remote-1", "--role", "admin"), "invalid choice"),
        (("nobody", "--rotate-token"), "no user 'nobody'"),
    ],
)
def test_bad_input_is_an_error_and_creates_nothing(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        create(*args)
    assert not User.objects.exists()
    assert not Group.objects.exists()
    assert not Token.objects.exists()

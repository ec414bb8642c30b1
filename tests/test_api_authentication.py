"""The API's token lookups are kept per process for API_AUTH_REFRESH seconds, and revocations still hold.

A change made through the ORM in this process (a deleted token, a withdrawn permission, a
deactivated user, a group losing a permission) empties the cache at once; one made where no signal
reaches this process (another server process, raw SQL) takes effect within API_AUTH_REFRESH.
"""

from __future__ import annotations

import time

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token

from taskflow.api import authentication

from .apiclients import Api, user_with

pytestmark = pytest.mark.django_db

T = "api.auth"
CREATE = "/api/tasks/"


def create(api: Api) -> int:
    return api.post(CREATE, {"task_type": T})[0]


@pytest.fixture(autouse=True)
def empty_cache() -> None:
    authentication.forget_credentials()


@pytest.fixture
def producer() -> Api:
    return Api(user_with("producer", "add_task"))


def auth_queries(captured: CaptureQueriesContext) -> list[str]:
    tables = ("authtoken_token", "auth_permission", "auth_user")
    return [q["sql"] for q in captured.captured_queries if any(t in q["sql"] for t in tables)]


def test_a_token_is_read_once_per_refresh_not_on_every_request(producer: Api) -> None:
    assert create(producer) == 201
    with CaptureQueriesContext(connection) as captured:
        assert create(producer) == 201
        assert create(producer) == 201
    assert auth_queries(captured) == []


@override_settings(TASKFLOW={"API_AUTH_REFRESH": 0})
def test_with_no_refresh_every_request_reads_the_token(producer: Api) -> None:
    assert create(producer) == 201
    with CaptureQueriesContext(connection) as captured:
        assert create(producer) == 201
    assert len(auth_queries(captured)) >= 2  # the token and its user, the permissions
    Token.objects.filter(user=producer.user).update(key="0" * 40)  # no signal: nothing else could tell
    assert create(producer) == 401


def test_revocations_in_this_process_take_effect_at_once(producer: Api) -> None:
    assert create(producer) == 201
    user = producer.user
    assert user is not None
    add_task = Permission.objects.get(content_type__app_label="taskflow", codename="add_task")

    user.user_permissions.remove(add_task)
    assert create(producer) == 403
    user.user_permissions.add(add_task)
    assert create(producer) == 201

    group = Group.objects.create(name="producers")
    group.permissions.add(add_task)
    user.groups.add(group)
    user.user_permissions.remove(add_task)
    assert create(producer) == 201  # through the group
    group.permissions.remove(add_task)
    assert create(producer) == 403
    group.permissions.add(add_task)
    assert create(producer) == 201
    user.groups.remove(group)
    assert create(producer) == 403
    user.user_permissions.add(add_task)

    user.is_active = False
    user.save()
    assert create(producer) == 401
    user.is_active = True
    user.save()
    assert create(producer) == 201

    Token.objects.get(user=user).delete()
    assert create(producer) == 401


@override_settings(TASKFLOW={"API_AUTH_REFRESH": 0.5})
def test_revocations_no_signal_reaches_take_effect_within_the_refresh(producer: Api) -> None:
    assert create(producer) == 201
    user = producer.user
    assert user is not None
    # As another server process or raw SQL would: no signal reaches this process's cache.
    User.objects.filter(pk=user.pk).update(is_active=False)
    User.user_permissions.through.objects.filter(user_id=user.pk).delete()
    Token.objects.filter(user=user)._raw_delete(connection.alias)
    assert create(producer) == 201, "kept for API_AUTH_REFRESH"
    time.sleep(0.6)
    assert create(producer) == 401


def test_a_refused_token_is_never_kept(producer: Api) -> None:
    token = Token.objects.get(user=producer.user)
    key = token.key
    Token.objects.filter(pk=key)._raw_delete(connection.alias)
    assert create(producer) == 401
    Token.objects.bulk_create([Token(key=key, user=producer.user)])  # no signal either
    assert create(producer) == 201


def test_a_request_cannot_change_what_the_next_one_sees(producer: Api) -> None:
    assert create(producer) == 201
    [entry] = authentication._entries.values()
    first = authentication.TokenOrBearerAuthentication().authenticate_credentials(entry.token.key)[0]
    first.is_active = False
    first.username = "changed"
    second = authentication.TokenOrBearerAuthentication().authenticate_credentials(entry.token.key)[0]
    assert second.is_active and second.username == "producer"
    assert create(producer) == 201

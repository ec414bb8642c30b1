"""API test clients: one user per role, each with a DRF token (see tests/test_api*.py)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.models import Permission, User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

# The roles of the issue, by the permissions each one's user holds.
ROLES: dict[str, tuple[str, ...]] = {
    "nobody": (),
    "producer": ("add_task", "view_task"),
    "worker": ("hold_task",),
    "operator": ("operate_task", "view_task", "view_schedulecfg", "change_schedulecfg"),
    "everything": (
        "add_task",
        "view_task",
        "hold_task",
        "operate_task",
        "view_schedulecfg",
        "change_schedulecfg",
    ),
}


def user_with(name: str, *codenames: str) -> User:
    user = User.objects.create_user(name, password="pw-" + name)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="taskflow", codename__in=codenames))
    return user


class Api:
    """A client speaking JSON with one user's token (or none): `api.post(url, body)` returns (status, json)."""

    def __init__(self, user: User | None = None, *, keyword: str = "Token") -> None:
        self.client = APIClient()
        self.user = user
        if user is not None:
            token, _ = Token.objects.get_or_create(user=user)
            self.client.credentials(HTTP_AUTHORIZATION=f"{keyword} {token.key}")

    def call(self, method: str, url: str, body: Any = None, *, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body))
        if method == "get":
            response = self.client.get(url)
        else:
            response = getattr(self.client, method)(url, data=data, content_type="application/json")
        self.response = response
        assert response["Content-Type"].startswith("application/json"), response.content[:300]
        return response.status_code, response.json()

    def get(self, url: str) -> tuple[int, Any]:
        return self.call("get", url)

    def post(self, url: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
        return self.call("post", url, body, **kwargs)

    def patch(self, url: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
        return self.call("patch", url, body, **kwargs)


def api_as(role: str) -> Api:
    return Api(user_with(role, *ROLES[role]))

"""Who may call what: one Django permission per kind of caller, checked on authenticated users only.

Producers need `taskflow.add_task`, remote workers `taskflow.hold_task`, operators
`taskflow.operate_task`, readers `taskflow.view_task`; schedule configs are read with
`view_schedulecfg` and edited with `change_schedulecfg`.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import MethodNotAllowed, NotAcceptable, NotAuthenticated, PermissionDenied
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

ADD = "taskflow.add_task"
HOLD = "taskflow.hold_task"
OPERATE = "taskflow.operate_task"
VIEW = "taskflow.view_task"
VIEW_CONFIG = "taskflow.view_schedulecfg"
CHANGE_CONFIG = "taskflow.change_schedulecfg"


def require(request: Request, permission: str) -> None:
    """Raise 401 for an anonymous caller, 403 for one without `permission`."""
    user = request.user
    if not (user and user.is_authenticated):
        raise NotAuthenticated()
    if not user.has_perm(permission):
        raise PermissionDenied(f"this needs the {permission} permission")


class Needs(BasePermission):
    """A permission class per HTTP method: `Needs.on(GET=VIEW, PATCH=CHANGE_CONFIG)`.

    A method not named is refused (405) before any view code runs; HEAD needs what GET needs, and
    OPTIONS (DRF's description of the view, which runs no view code) any logged-in user.
    """

    by_method: dict[str, str] = {}

    @classmethod
    def on(cls, **by_method: str) -> type[Needs]:
        return type("Needs", (cls,), {"by_method": by_method})

    def has_permission(self, request: Request, view: Any) -> bool:
        method = request.method or ""
        user = request.user
        if not (user and user.is_authenticated):
            raise NotAuthenticated()
        if method == "OPTIONS":
            return True
        permission = self.by_method.get("GET" if method == "HEAD" else method)
        if permission is None:
            raise MethodNotAllowed(method)
        if not user.has_perm(permission):
            raise PermissionDenied(f"this needs the {permission} permission")
        return True


class LoggedIn(BasePermission):
    """Any authenticated user (the schema and its documentation)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        if not (request.user and request.user.is_authenticated):
            raise NotAuthenticated()
        return True


class PermissionsBeforeNegotiation:
    """A view mixin: a caller refused by the permissions hears that (401/403), not 406, whatever it accepts.

    DRF negotiates the content type before it checks who is calling.
    """

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        try:
            super().initial(request, *args, **kwargs)  # type: ignore[misc]
        except NotAcceptable:
            self.check_permissions(request)  # type: ignore[attr-defined]
            raise

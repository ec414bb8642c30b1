"""API users by role: a user in its role's group, holding a DRF token (`manage.py createapiuser`).

A role is a group of taskflow permissions (permissions.py says what each one allows). The user has
no password (it signs in with its token only) and no staff access. Its token is handed back once,
to be shown once: DRF keeps it in its token table, and nothing here writes it anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group, Permission
from django.core.exceptions import ValidationError
from django.db import transaction
from rest_framework.authtoken.models import Token

from ..exceptions import TaskflowError


@dataclass(frozen=True)
class Role:
    name: str
    group: str
    codenames: tuple[str, ...]  # taskflow permissions
    does: str


ROLES: dict[str, Role] = {
    role.name: role
    for role in (
        Role("worker", "taskflow API workers", ("hold_task",), "hold tasks and report on them (a remote worker)"),
        Role("producer", "taskflow API producers", ("add_task", "view_task"), "create tasks and read them"),
        Role(
            "operator",
            "taskflow API operators",
            ("operate_task", "view_task", "view_schedulecfg", "change_schedulecfg"),
            "stop, retry, reschedule and re-prioritise tasks, edit schedule configs, read everything",
        ),
        Role("viewer", "taskflow API viewers", ("view_task", "view_schedulecfg"), "read tasks, stats and configs"),
    )
}


class AccountError(TaskflowError):
    """An API user could not be created or given a new token; nothing was changed."""


@dataclass(frozen=True)
class Credential:
    user: AbstractBaseUser
    role: Role | None
    token: str  # shown once; DRF keeps it in its token table


def create_api_user(username: str, role_name: str) -> Credential:
    """A new user in the role's group, with a new token; AccountError if it exists or a value is wrong."""
    role = _role(role_name)
    user_model = get_user_model()
    with transaction.atomic():
        if user_model._default_manager.filter(**{user_model.USERNAME_FIELD: username}).exists():
            raise AccountError(f"user {username!r} exists already: pass --rotate-token to give it a new token")
        user = user_model(**{user_model.USERNAME_FIELD: username})
        user.set_unusable_password()
        try:
            user.full_clean(exclude=["password"])
        except ValidationError as exc:
            raise AccountError(f"user {username!r} cannot be created: {_messages(exc)}") from None
        user.save()
        user.groups.add(_group(role))  # type: ignore[attr-defined]
        token = Token.objects.create(user=user)
    return Credential(user, role, token.key)


def rotate_token(username: str, role_name: str | None = None) -> Credential:
    """Replace the user's token (the old one stops working at once), adding it to a role's group if named."""
    role = _role(role_name) if role_name is not None else None
    user_model = get_user_model()
    with transaction.atomic():
        try:
            user = user_model._default_manager.get(**{user_model.USERNAME_FIELD: username})
        except user_model.DoesNotExist:
            raise AccountError(f"no user {username!r}: leave out --rotate-token to create it") from None
        if role is not None:
            user.groups.add(_group(role))  # type: ignore[attr-defined]
        Token.objects.filter(user=user).delete()
        token = Token.objects.create(user=user)
    return Credential(user, role, token.key)


def _role(name: str) -> Role:
    try:
        return ROLES[name]
    except KeyError:
        raise AccountError(f"unknown role {name!r}: one of {', '.join(ROLES)}") from None


def _group(role: Role) -> Group:
    """The role's group, holding at least the role's permissions (what an admin added to it stays)."""
    permissions = list(Permission.objects.filter(content_type__app_label="taskflow", codename__in=role.codenames))
    missing = set(role.codenames) - {p.codename for p in permissions}
    if missing:
        raise AccountError(f"permissions {', '.join(sorted(missing))} do not exist yet: run manage.py migrate first")
    group, _ = Group.objects.get_or_create(name=role.group)
    group.permissions.add(*permissions)
    return group


def _messages(exc: ValidationError) -> str:
    return "; ".join(f"{field}: {' '.join(errors)}" for field, errors in exc.message_dict.items())

"""Token authentication accepting both `Authorization: Token <key>` and `Authorization: Bearer <key>`.

A token's user and permissions cost three queries (the token with its user, the user's and its
groups' permissions); a remote worker or a producer calls many times a second with the same token,
so each server process keeps them for TASKFLOW["API_AUTH_REFRESH"] seconds. A deleted token, a
deactivated user or a withdrawn permission therefore takes effect within that bound in every
process, and at once in the process that made the change (its signals empty the cache).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.db.models.base import ModelState
from django.db.models.signals import m2m_changed, post_delete, post_save
from rest_framework.authentication import TokenAuthentication, get_authorization_header
from rest_framework.request import Request

from ..conf import get_settings

MAX_ENTRIES = 10_000  # tokens kept per process; past it, expired ones are dropped (all of them if none is)


@dataclass(frozen=True)
class _Entry:
    until: float  # time.monotonic() after which the token is read again
    user: Any  # with its permission caches filled; each request gets a copy
    token: Any


_entries: dict[str, _Entry] = {}
_lock = threading.Lock()
_watching = False
_generation = 0  # bumped by every change: a lookup that began before one is not kept


def forget_credentials(**kwargs: Any) -> None:
    """Empty the cache (connected to every change of a token, a user, a group or a permission)."""
    global _generation
    with _lock:
        _entries.clear()
        _generation += 1


def _watch_changes(token_model: type) -> None:
    """Connect the signals that empty the cache, once (when it first keeps something, so tokens are installed)."""
    global _watching
    if _watching:
        return
    user = get_user_model()
    for model in (token_model, user, Group, Permission):
        for signal in (post_save, post_delete):
            signal.connect(forget_credentials, sender=model, dispatch_uid=f"taskflow.api.auth.{model._meta.label}")
    # A custom user model may have no groups or permissions of its own.
    relations = [getattr(user, name, None) for name in ("groups", "user_permissions")] + [Group.permissions]
    for through in {r.through for r in relations if r is not None}:
        m2m_changed.connect(forget_credentials, sender=through, dispatch_uid=f"taskflow.api.auth.{through._meta.label}")
    _watching = True


def _copy(user: Any) -> Any:
    """A copy of the kept user for one request, which may set attributes on it.

    The permission caches it shares are only read. Made by hand: copy.copy() of a model (its
    pickling protocol) cost a few percent of a request.
    """
    clone = object.__new__(type(user))
    clone.__dict__.update(user.__dict__)
    clone._state = ModelState()
    clone._state.db, clone._state.adding = user._state.db, False
    return clone


class TokenOrBearerAuthentication(TokenAuthentication):
    """DRF's token authentication (rest_framework.authtoken tokens), under either keyword."""

    keywords = ("Token", "Bearer")

    def authenticate(self, request: Request) -> Any:
        auth = get_authorization_header(request).split()
        if not auth:
            return None
        for keyword in self.keywords:
            if auth[0].lower() == keyword.lower().encode():
                self.keyword = keyword
                return super().authenticate(request)
        return None

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        """The token's user and the token, read at most every API_AUTH_REFRESH seconds per process.

        Refusals (an unknown token, an inactive user) are never kept: each is read again.
        """
        refresh = get_settings().API_AUTH_REFRESH
        if refresh <= 0:
            return super().authenticate_credentials(key)
        now = time.monotonic()
        entry = _entries.get(key)
        if entry is None or entry.until <= now:
            with _lock:
                _watch_changes(self.get_model())
                generation = _generation
            user, token = super().authenticate_credentials(key)
            user.get_all_permissions()  # fills the auth backend's caches on the user: has_perm reads no more
            entry = _Entry(now + refresh, user, token)
            with _lock:
                if generation == _generation:  # else a change came while reading: use it, keep nothing
                    if len(_entries) >= MAX_ENTRIES:
                        for stale in [k for k, e in _entries.items() if e.until <= now] or list(_entries):
                            del _entries[stale]
                    _entries[key] = entry
        return _copy(entry.user), entry.token

    def authenticate_header(self, request: Request) -> str:
        return 'Token realm="api", Bearer realm="api"'

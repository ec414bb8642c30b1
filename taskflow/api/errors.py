"""Every API error as JSON: `{"error": "<code>", "detail": "...", "fields": {name: [messages]}}`.

`fields` comes with 400s only, one entry per invalid field; nested fields are named with their
path (`tasks[3].priority`). Conflicts with the engine's state are 409s with their own codes
(`lease_lost`, `not_applicable`, `stale_version`); a database that is busy or away is a 503 the
caller may retry, never a 500; a value the database itself refuses (a bug of validation) is a 400
`refused_by_database`, which no retry would change.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import DatabaseError, DataError, IntegrityError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response

from ..engine import sql
from ..exceptions import InvalidTask, StaleVersion

log = logging.getLogger("taskflow.api")


class RequestTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "request_too_large"
    default_detail = "the request body is too large"


class LeaseLost(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "lease_lost"
    default_detail = "this lease no longer holds the task (the attempt was reported, rescued or stopped)"


class NotApplicable(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "not_applicable"
    default_detail = "this change does not apply to the task as it is now"


class Unavailable(exceptions.APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_code = "unavailable"
    default_detail = "the database is busy or unreachable; try again"


# DRF's own codes, renamed where theirs would read oddly in a client.
_CODES = {
    exceptions.ParseError: "malformed_request",
    exceptions.NotAuthenticated: "not_authenticated",
    exceptions.AuthenticationFailed: "authentication_failed",
    exceptions.PermissionDenied: "permission_denied",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.NotAcceptable: "not_acceptable",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.Throttled: "throttled",
    exceptions.ValidationError: "invalid",
}


def error_body(code: str, detail: str, fields: dict[str, list[str]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"error": code, "detail": detail}
    if fields is not None:
        body["fields"] = fields
    return body


def flatten(errors: Any, prefix: str = "") -> dict[str, list[str]]:
    """DRF's nested error structure as {"path.to[0].field": [messages]}."""
    out: dict[str, list[str]] = {}
    if isinstance(errors, dict):
        for name, value in errors.items():
            if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
                path = f"{prefix}[{name}]"  # an item of a list
            else:
                key = "" if name == "non_field_errors" else name
                path = f"{prefix}.{key}" if prefix and key else (prefix or key)
            for k, v in flatten(value, path).items():
                out.setdefault(k, []).extend(v)
    elif isinstance(errors, list) and errors and all(isinstance(e, (dict, list)) for e in errors):
        for i, value in enumerate(errors):
            for k, v in flatten(value, f"{prefix}[{i}]").items():
                out.setdefault(k, []).extend(v)
    elif isinstance(errors, list):
        out[prefix or "non_field_errors"] = [str(e) for e in errors]
    else:
        out[prefix or "non_field_errors"] = [str(errors)]
    return {k: v for k, v in out.items() if v}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """The API's EXCEPTION_HANDLER (set on every view): JSON for every error, and no 500 for the expected ones."""
    headers: dict[str, str] = {}
    if isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or "not found")
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, StaleVersion):
        body = error_body("stale_version", str(exc))
        body["newest_version"] = exc.newest
        return Response(body, status=status.HTTP_409_CONFLICT)
    elif isinstance(exc, InvalidTask):
        message = str(exc)
        field = message.split(" ", 1)[0]
        fields = {field: [message]} if field.isidentifier() and field.islower() else {"non_field_errors": [message]}
        return Response(error_body("invalid", message, fields), status=status.HTTP_400_BAD_REQUEST)
    elif isinstance(exc, DataError | IntegrityError) and not sql.is_lock_conflict(exc):
        # The database refused a value that validation let through: the same request would be
        # refused again, so a 503 would send a client that honours Retry-After round for ever.
        log.error("API request refused by the database: %s: %s", type(exc).__name__, exc)
        message = "the database refused a value of this request; sending it again will not help"
        return Response(error_body("refused_by_database", message), status=status.HTTP_400_BAD_REQUEST)
    elif isinstance(exc, DatabaseError):
        # A lock conflict or an outage: nothing was written; the caller tries again.
        log.warning("API request refused for now: %s: %s", type(exc).__name__, exc)
        what = "busy" if sql.is_lock_conflict(exc) else "unavailable"
        exc = Unavailable(f"the database is {what}; try again")
        headers["Retry-After"] = "1"
    if not isinstance(exc, exceptions.APIException):
        return None  # a bug: Django's 500 (and its log) is the honest answer
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header  # type: ignore[attr-defined]
    if getattr(exc, "wait", None):
        headers["Retry-After"] = str(int(exc.wait))  # type: ignore[attr-defined]
    code = _code(exc)
    if isinstance(exc, exceptions.ValidationError):
        fields = flatten(exc.detail)
        detail = "; ".join(f"{k}: {' '.join(v)}" if k != "non_field_errors" else " ".join(v) for k, v in fields.items())
        body = error_body(code, detail or "invalid input", fields)
    else:
        body = error_body(code, _text(exc.detail))
    return Response(body, status=exc.status_code, headers=headers)


def _code(exc: exceptions.APIException) -> str:
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return exc.default_code


def _text(detail: Any) -> str:
    if isinstance(detail, list):
        return " ".join(_text(d) for d in detail)
    if isinstance(detail, dict):
        return " ".join(f"{k}: {_text(v)}" for k, v in detail.items())
    return str(detail)

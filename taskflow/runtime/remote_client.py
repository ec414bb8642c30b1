"""The worker side of taskflow's HTTP API as the remote worker calls it: keep-alive sessions, answers sorted out.

Every failure is one of three: `Unreachable` (no usable answer: try again later), `AccessDenied`
(401/403: stop), `Rejected` (another 4xx, with the server's JSON error in `body`).
"""

from __future__ import annotations

import threading
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urljoin

import requests


class ApiError(Exception):
    """The API answered with something the remote worker cannot act on."""

    def __init__(self, message: str, status: int = 0, body: Any = None) -> None:
        super().__init__(message)
        self.status, self.body = status, body


class Unreachable(ApiError):
    """No usable answer (connection refused or reset, a timeout, a 5xx): try again later."""


class AccessDenied(ApiError):
    """401 or 403: the token is wrong or lacks the worker permission; retrying cannot help."""


class Rejected(ApiError):
    """Another 4xx: the request itself was refused (its JSON body is in `body`)."""


class ApiClient:
    """The worker side of the taskflow HTTP API, over keep-alive sessions (one per thread)."""

    def __init__(self, url: str, token: str, *, timeout: float = 10.0) -> None:
        self.root = url if url.endswith("/") else url + "/"
        self.token = token
        self.timeout = timeout
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.headers.update(
                {"Authorization": f"Token {self.token}", "Accept": "application/json", "User-Agent": "taskflow-remote"}
            )
            self._local.session = session
        return session

    def post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], datetime | None]:
        """POST JSON; returns the answer's JSON and the server's clock (its Date header), or raises ApiError."""
        url = urljoin(self.root, path)
        try:
            response = self._session().post(url, json=body, timeout=(min(5.0, self.timeout), self.timeout))
        except requests.RequestException as exc:
            # A broken keep-alive connection must not poison the next try.
            self._local.session = None
            raise Unreachable(f"{url}: {type(exc).__name__}: {exc}") from None
        try:
            answer = response.json()
        except ValueError:
            answer = None
        status = response.status_code
        if status in (401, 403):
            detail = answer.get("detail", "") if isinstance(answer, dict) else response.text[:200]
            raise AccessDenied(f"{url} answered {status}: {detail}", status, answer)
        if status >= 500 or status in (408, 429) or (status < 400 and not isinstance(answer, dict)):
            raise Unreachable(f"{url} answered {status}", status, answer)
        if status >= 400:
            raise Rejected(f"{url} answered {status}: {answer!r}"[:1000], status, answer)
        return answer, _server_clock(response)

    def hold(self, task_types: list[str], limit: int, worker_id: str) -> tuple[list[dict[str, Any]], datetime | None]:
        answer, clock = self.post("tasks/hold/", {"task_types": task_types, "limit": limit, "worker_id": worker_id})
        return answer["tasks"], clock

    def batch(self, path: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """POST `{"items": items}` to a batch endpoint; the per-item results, in order."""
        return self._batch(path, {"items": items})[0]

    def beat(self, worker_id: str, held: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """A liveness beat listing every attempt held: per-item results, and how many the server handed back."""
        results, answer = self._batch("tasks/heartbeat/", {"worker_id": worker_id, "items": held})
        handed_back = answer.get("handed_back", 0)
        return results, handed_back if isinstance(handed_back, int) else 0

    def _batch(self, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        answer, _ = self.post(path, body)
        results = answer.get("results")
        if not isinstance(results, list) or len(results) != len(body["items"]):
            raise Unreachable(f"{path}: an answer without one result per item: {answer!r}"[:500])
        return results, answer

    def set_task(self, task_id: str, body: dict[str, Any]) -> dict[str, Any]:
        answer, _ = self.post(f"tasks/{task_id}/set/", body)
        return answer


def _server_clock(response: requests.Response) -> datetime | None:
    try:
        return parsedate_to_datetime(response.headers["Date"])
    except (KeyError, TypeError, ValueError):
        return None

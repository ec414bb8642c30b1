"""The worker side of taskflow's HTTP API as the remote worker calls it: keep-alive sessions, answers sorted out.

Every failure is one of three: `Unreachable` (no usable answer: try again later), `AccessDenied`
(401/403: stop, unless it is `credential_refused`), `Rejected` (another 4xx, with the server's JSON
error in `body`). A worker registers first (`register`); the client then sends the worker id and
key the server issued with every call, in the Taskflow-Worker-Id and Taskflow-Worker-Key headers.
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

    credential: tuple[str, str] | None = None

    @property
    def credential_refused(self) -> bool:
        """The worker's id and key were refused (the server's SECRET_KEY changed, say): register again."""
        return isinstance(self.body, dict) and self.body.get("error") == "worker_refused"


class Rejected(ApiError):
    """Another 4xx: the request itself was refused (its JSON body is in `body`)."""


class ApiClient:
    """The worker side of the taskflow HTTP API, over keep-alive sessions (one per thread)."""

    def __init__(self, url: str, token: str, *, timeout: float = 10.0) -> None:
        self.root = url if url.endswith("/") else url + "/"
        self.token = token
        self.timeout = timeout
        self._local = threading.local()
        self.credential: tuple[str, str] | None = None  # (worker_id, worker_key), as `register` got them

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
        credential = self.credential
        headers = (
            {} if credential is None else {"Taskflow-Worker-Id": credential[0], "Taskflow-Worker-Key": credential[1]}
        )
        try:
            response = self._session().post(
                url, json=body, headers=headers, timeout=(min(5.0, self.timeout), self.timeout)
            )
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
            denied = AccessDenied(f"{url} answered {status}: {detail}", status, answer)
            denied.credential = credential  # what was refused, if the client has registered again since
            raise denied
        if status >= 500 or status in (408, 429) or (status < 400 and not isinstance(answer, dict)):
            raise Unreachable(f"{url} answered {status}", status, answer)
        if status >= 400:
            raise Rejected(f"{url} answered {status}: {answer!r}"[:1000], status, answer)
        return answer, _server_clock(response)

    def register(self, host: str, pid: int, task_types: list[str], concurrency: int) -> str:
        """Have the server issue this worker's id and key (kept for every later call); returns the id."""
        body = {"host": host, "pid": pid, "task_types": task_types, "concurrency": concurrency}
        answer, _ = self.post("workers/", body)
        worker_id, key = answer.get("worker_id"), answer.get("worker_key")
        if not (isinstance(worker_id, str) and isinstance(key, str)):
            raise Unreachable(f"workers/: an answer without worker_id and worker_key: {answer!r}"[:500])
        self.credential = (worker_id, key)
        return worker_id

    def hold(self, task_types: list[str], limit: int, reserve: int = 0) -> tuple[list[dict[str, Any]], datetime | None]:
        body: dict[str, Any] = {"task_types": task_types, "limit": limit}
        if reserve:
            body["reserve"] = reserve
        answer, clock = self.post("tasks/hold/", body)
        return answer["tasks"], clock

    def batch(self, path: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """POST `{"items": items}` to a batch endpoint; the per-item results, in order."""
        return self._batch(path, {"items": items})[0]

    def beat(self, held: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """A liveness beat listing every attempt held: per-item results, and how many the server handed back."""
        results, answer = self._batch("tasks/heartbeat/", {"beat": True, "items": held})
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

"""What the remote worker's tests share: API users with tokens, and a TCP proxy that can cut the line."""

from __future__ import annotations

import contextlib
import socket
import threading

from django.contrib.auth.models import Permission, User
from rest_framework.authtoken.models import Token


def api_token(username: str, *codenames: str) -> str:
    """A new user holding these taskflow permissions, and its API token."""
    user = User.objects.create_user(username)
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename, content_type__app_label="taskflow"))
    return Token.objects.create(user=user).key


def require_liveness_beat(api_url: str, token: str) -> None:
    """Skip unless the server takes a remote worker's liveness beat (`worker_id` on tasks/heartbeat/).

    Until the API branch has it (see docs/remote.md, "Liveness"), the tests that need it say so
    instead of failing; once the server has it they run, and can fail.
    """
    import pytest

    from taskflow.runtime.remote_client import ApiClient, Rejected

    try:
        client = ApiClient(api_url, token)
        client.register("probe-host", 1, ["probe.type"], 1)
        client.beat([])
    except Rejected as exc:
        pytest.skip(f"the API does not take a remote worker's liveness beat yet ({exc.status}: {exc.body})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to a server; `cut()` makes it unreachable (refused, open connections reset)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.restore()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    close = cut

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    client.close()
                    upstream.close()
                    return
                self._sockets |= {client, upstream}
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def register_worker(api, host: str = "remote-host", pid: int = 4242, task_types: tuple[str, ...] = ("api.job",)) -> str:  # noqa: ANN001
    """Register a remote worker for `api`'s user (tests.apiclients.Api); its later calls carry the issued id and key."""
    body = {"host": host, "pid": pid, "task_types": list(task_types), "concurrency": 4}
    status, answer = api.post("/api/workers/", body)
    assert status == 201, answer
    headers = {
        "HTTP_TASKFLOW_WORKER_ID": answer["worker_id"],
        "HTTP_TASKFLOW_WORKER_KEY": answer["worker_key"],
    }
    api.client.credentials(**{**api.client._credentials, **headers})
    api.worker_id, api.worker_key = answer["worker_id"], answer["worker_key"]
    return answer["worker_id"]

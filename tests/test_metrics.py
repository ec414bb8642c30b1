"""/metrics (taskflow/metrics.py): who may read it, and what it says about tasks in known states."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

import taskflow
from taskflow.engine import stats
from taskflow.metrics import TOKEN_ENV
from taskflow.models import ScheduleCfg, Status, Task

pytestmark = pytest.mark.django_db

URL = "/metrics"
TOKEN = "s3cret-metrics-token"
A = "test.noop"
B = "test.record"


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return TOKEN


def user_client(name: str, *codenames: str, staff: bool = True) -> Client:
    user = User.objects.create_user(name, password="pw", is_staff=staff)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="taskflow", codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def test_without_credentials_it_is_401_with_a_bearer_challenge(token: str) -> None:
    response = Client().get(URL)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert b"taskflow_" not in response.content
    # Another scheme is not a credential /metrics knows.
    assert Client().get(URL, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401


def test_the_right_bearer_token_reads_the_metrics(token: str) -> None:
    response = Client().get(URL, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    assert b"taskflow_stats_refreshed_timestamp_seconds" in response.content
    assert Client().get(URL, headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize("given", ["wrong", TOKEN + "x", TOKEN[:-1], ""])
def test_a_wrong_bearer_token_is_403(token: str, given: str) -> None:
    response = Client().get(URL, headers={"Authorization": f"Bearer {given}"})
    assert response.status_code == 403
    assert b"taskflow_" not in response.content


def test_no_token_is_accepted_while_none_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert Client().get(URL, headers={"Authorization": "Bearer "}).status_code == 403
    assert Client().get(URL, headers={"Authorization": "Bearer anything"}).status_code == 403


def test_staff_sessions_with_view_task_read_it_other_users_get_403(token: str) -> None:
    assert user_client("sam", "view_task").get(URL).status_code == 200
    assert user_client("sue", "view_schedulecfg").get(URL).status_code == 403  # staff without view_task
    assert user_client("nina", "view_task", staff=False).get(URL).status_code == 403
    superuser = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(superuser)
    assert client.get(URL).status_code == 200
    # A wrong token is refused even with a staff session: the credential offered is checked.
    assert user_client("sid", "view_task").get(URL, headers={"Authorization": "Bearer no"}).status_code == 403


def test_only_get(token: str) -> None:
    response = Client().post(URL, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 405


def samples(token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = Client().get(URL, headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200
    out = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_the_metrics_say_what_the_rollup_holds(token: str) -> None:
    now = timezone.now()
    ScheduleCfg.objects.get_or_create(task_type=B, defaults={"concurrency_limit": 4, "paused": True})
    long_ago = now - timedelta(minutes=10)  # final minutes: in the counters
    for run_ms in (20, 20, 700):
        t = taskflow.enqueue(A)
        Task.objects.filter(pk=t.pk).update(
            status=Status.SUCCESS,
            started_at=long_ago - timedelta(milliseconds=run_ms),
            finished_at=long_ago,
            attempts=2,
        )
    t = taskflow.enqueue(A)
    Task.objects.filter(pk=t.pk).update(status=Status.FAILED, started_at=long_ago, finished_at=long_ago, attempts=3)
    t = taskflow.enqueue(A)
    Task.objects.filter(pk=t.pk).update(status=Status.PROCESSING, started_at=now)
    due = now - timedelta(seconds=42)
    t = taskflow.enqueue(A)
    Task.objects.filter(pk=t.pk).update(run_after=due, order_time=due)
    stats.refresh(now)

    got = samples(token)
    a, b = (("task_type", A),), (("task_type", B),)
    assert got["taskflow_tasks", (("status", "success"), *a)] == 4 - 1
    assert got["taskflow_tasks", (("status", "failed"), *a)] == 1
    assert got["taskflow_tasks", (("status", "pending"), *a)] == 1
    assert got["taskflow_tasks", (("status", "processing"), *a)] == 1
    assert got["taskflow_tasks", (("status", "stopped"), *a)] == 0
    assert got["taskflow_oldest_pending_age_seconds", a] == pytest.approx(42, abs=0.01)
    assert got["taskflow_in_flight", a] == 1
    assert ("taskflow_concurrency_limit", a) not in got
    assert got["taskflow_concurrency_limit", b] == 4
    assert got["taskflow_paused", a] == 0 and got["taskflow_paused", b] == 1
    assert got["taskflow_completions_total", a] == 3
    assert got["taskflow_failures_total", a] == 1
    assert got["taskflow_stops_total", a] == 0
    assert got["taskflow_claims_total", a] == 3 * 2 + 3
    assert got["taskflow_run_time_seconds_count", a] == 4
    assert got["taskflow_run_time_seconds_bucket", (("le", "0.005"), *a)] == 1  # the instant failure
    assert got["taskflow_run_time_seconds_bucket", (("le", "0.01"), *a)] == 1
    assert got["taskflow_run_time_seconds_bucket", (("le", "0.025"), *a)] == 3  # and the two 20 ms runs
    assert got["taskflow_run_time_seconds_bucket", (("le", "0.5"), *a)] == 3
    assert got["taskflow_run_time_seconds_bucket", (("le", "1"), *a)] == 4
    assert got["taskflow_run_time_seconds_bucket", (("le", "+Inf"), *a)] == 4
    assert got["taskflow_run_time_seconds_sum", a] == pytest.approx(0.74, abs=0.005)
    assert got["taskflow_completions_total", b] == 0  # nothing finished yet, but counted from 0
    assert got["taskflow_stats_refreshed_timestamp_seconds", ()] == pytest.approx(now.timestamp())

"""GET /api/stats/: the console's numbers (taskflow.engine.stats) as they are, for users with view_task."""

from __future__ import annotations

import pytest

stats = pytest.importorskip("taskflow.engine.stats")

import taskflow  # noqa: E402
from tests.apiclients import api_as  # noqa: E402

pytestmark = pytest.mark.django_db
T = "api.stats"


def shape(value: object) -> object:
    """The structure of a JSON value: keys and types, not the numbers (a timing may move between two reads)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def test_stats_answers_the_engines_current_numbers_to_users_with_view_task() -> None:
    taskflow.enqueue_many([{"task_type": T}] * 3)
    stats.refresh()
    status, body = api_as("producer").get("/api/stats/")
    assert status == 200
    expected = stats.current()
    assert shape(body) == shape(expected)
    assert body["types"][T]["counts"]["pending"] == 3
    assert "window_s" in body


def test_stats_takes_a_window_and_refuses_a_bad_one() -> None:
    stats.refresh()
    api = api_as("operator")
    status, body = api.get("/api/stats/?window_s=60")
    assert status == 200 and body["window_s"] == 60
    assert api.get(f"/api/stats/?window_s={stats.MAX_WINDOW_S}")[1]["window_s"] == stats.MAX_WINDOW_S
    for bad in ("0", "59", "abc", "-5", str(stats.MAX_WINDOW_S + 1)):
        status, body = api.get(f"/api/stats/?window_s={bad}")
        assert (status, body["error"]) == (400, "invalid")


@pytest.mark.parametrize("role", ["nobody", "worker"])
def test_stats_needs_view_task(role: str) -> None:
    status, body = api_as(role).get("/api/stats/")
    assert (status, body["error"]) == (403, "permission_denied")

"""The console and rolled tasks: the task page finds them, history is browsable read-only, retry_now brings one back."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

import taskflow
from taskflow.engine import rolling
from taskflow.models import Status, Task
from tests.conftest import drop_history_tables, staff

pytestmark = pytest.mark.django_db(transaction=True)
T = "test.noop"
HISTORY = "/admin/taskflow/task/history/"


@pytest.fixture(autouse=True)
def _no_history_tables() -> None:
    yield
    drop_history_tables()




def rolled(count: int, status: str = Status.SUCCESS) -> list[Task]:
    tasks = [taskflow.enqueue(T, {"n": i}, key=f"k{i}") for i in range(count)]
    Task.objects.filter(pk__in=[t.pk for t in tasks]).update(
        status=status, finished_at=timezone.now() - timedelta(days=2)
    )
    rolling.roll(pause=0)
    return tasks


def test_the_task_page_shows_a_rolled_task_read_only_with_retry_now_as_its_only_action() -> None:
    [failed] = rolled(1, Status.FAILED)
    operator = staff("olga", "view_task", "operate_task")

    page = operator.get(f"/admin/taskflow/task/{failed.pk}/change/")

    assert page.status_code == 200
    html = page.content.decode()
    assert rolling.history_table(1) in html and 'id="tf-in-history"' in html
    assert [a["name"] for a in page.context["task_actions"]] == ["retry_now"]  # not reschedule, priority, ...

    url = page.context["task_actions"][0]["url"]
    confirm = operator.post(
        url.split("?")[0],
        {"_selected_action": failed.pk, "select_across": "0", "_from_task": "1", "_confirm": "1", "reason": "rolled"},
    )
    assert confirm.status_code == 302
    task = taskflow.get_task(failed.pk)
    assert task.status == Status.PENDING and not hasattr(task, "history_position")
    again = operator.get(f"/admin/taskflow/task/{failed.pk}/change/")
    assert 'id="tf-in-history"' not in again.content.decode()
    assert "terminate" in [a["name"] for a in again.context["task_actions"]]


def test_history_is_browsable_read_only_by_table_status_and_page() -> None:
    done = rolled(60)
    viewer = staff("victor", "view_task")

    page = viewer.get(HISTORY)

    assert page.status_code == 200
    shown = [t.pk for t in page.context["tasks"]]
    assert shown == sorted((t.pk for t in done), reverse=True)[:50]
    html = page.content.decode()
    assert "action-checkbox" not in html and 'name="action"' not in html  # nothing to act with
    older = viewer.get(HISTORY + page.context["older_url"])
    assert [t.pk for t in older.context["tasks"]] == sorted((t.pk for t in done), reverse=True)[50:]
    assert older.context["older_url"] == ""
    none = viewer.get(HISTORY, {"table": 1, "status": "failed"})
    assert none.context["tasks"] == []
    bad = viewer.get(HISTORY, {"table": 99})
    assert bad.status_code == 200 and bad.context["form"].errors and bad.context["tasks"] == []
    assert viewer.post(HISTORY).status_code in (200, 405)  # POST changes nothing either way
    # The task list links here; the positions list links each kept table.
    assert HISTORY in viewer.get("/admin/taskflow/task/").content.decode()


def test_history_needs_the_view_permission_and_a_dropped_task_is_not_found() -> None:
    [task] = rolled(1)
    assert staff("nobody").get(HISTORY).status_code == 403
    viewer = staff("victor", "view_task")
    rolling.roll(now=timezone.now() + timedelta(days=40), pause=0)  # retention drops table 1
    page = viewer.get(f"/admin/taskflow/task/{task.pk}/change/")
    assert page.status_code == 302  # the admin's "does not exist" redirect
    assert viewer.get(HISTORY).context["tasks"] == []


def test_the_task_page_lists_other_versions_of_its_key_in_both_tables() -> None:
    [v1] = rolled(1)  # key k0, version 0, in history
    v2 = taskflow.enqueue(T, {}, key="k0", version=2)
    viewer = staff("victor", "view_task")

    hot_page = viewer.get(f"/admin/taskflow/task/{v2.pk}/change/")
    history_page = viewer.get(f"/admin/taskflow/task/{v1.pk}/change/")

    assert [(v.pk, v.version) for v in hot_page.context["other_versions"]] == [(v1.pk, 0)]
    assert [(v.pk, v.version) for v in history_page.context["other_versions"]] == [(v2.pk, 2)]

"""The operator console: staff only, task rows read-only, schedule configs editable live."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

import taskflow
from taskflow.engine.configs import configs
from taskflow.models import ScheduleCfg, Status, Task

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    return client


def test_the_console_is_for_staff_only() -> None:
    taskflow.enqueue("test.noop")
    anonymous = Client().get("/admin/taskflow/task/")
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]

    not_staff = Client()
    not_staff.force_login(User.objects.create_user("someone", password="pw"))
    assert not_staff.get("/admin/taskflow/task/").status_code == 302


def test_staff_see_and_filter_tasks(staff_client: Client) -> None:
    noop = taskflow.enqueue("test.noop", {"x": 1}, key="order-7")
    other = taskflow.enqueue("test.record", {"n": 1})
    Task.objects.filter(pk=other.pk).update(status=Status.FAILED)

    listing = staff_client.get("/admin/taskflow/task/", {"status__exact": "pending"})
    assert listing.status_code == 200
    shown = {t.pk for t in listing.context["cl"].result_list}
    assert shown == {noop.pk}
    found = staff_client.get("/admin/taskflow/task/", {"q": "order-7"})
    assert {t.pk for t in found.context["cl"].result_list} == {noop.pk}
    assert staff_client.get(f"/admin/taskflow/task/{noop.pk}/change/").status_code == 200


def test_task_rows_cannot_be_edited_added_or_deleted_from_the_console(staff_client: Client) -> None:
    task = taskflow.enqueue("test.noop")
    response = staff_client.post(f"/admin/taskflow/task/{task.pk}/change/", {"status": "success", "attempts": 9})
    assert response.status_code == 403
    assert staff_client.get("/admin/taskflow/task/add/").status_code == 403
    assert staff_client.post(f"/admin/taskflow/task/{task.pk}/delete/", {"post": "yes"}).status_code == 403
    task.refresh_from_db()
    assert (task.status, task.attempts) == (Status.PENDING, 0)


def test_pausing_a_type_from_the_console_reaches_the_workers_config(staff_client: Client) -> None:
    configs.get("test.noop")  # created with defaults on first use
    response = staff_client.post(
        "/admin/taskflow/schedulecfg/",
        {
            "form-TOTAL_FORMS": "1",
            "form-INITIAL_FORMS": "1",
            "form-0-task_type": "test.noop",
            "form-0-paused": "on",
            "form-0-concurrency_limit": "3",
            "_save": "Save",
        },
    )
    assert response.status_code == 302
    cfg = ScheduleCfg.objects.get(pk="test.noop")
    assert cfg.paused and cfg.concurrency_limit == 3
    configs.clear()
    assert configs.get("test.noop").paused

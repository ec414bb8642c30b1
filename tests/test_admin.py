"""The operator console: staff only, task rows read-only, schedule configs editable live."""

from __future__ import annotations

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

import taskflow
from taskflow.admin import ScheduleCfgAdmin
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


# Every number and choice on the change page (task_type is read-only there, paused a checkbox).
EDITABLE = [
    name
    for _, options in ScheduleCfgAdmin.fieldsets
    for name in options["fields"]
    if name not in ("task_type", "paused", "updated_at")
]


def change_form(cfg: ScheduleCfg, **changes: str) -> dict[str, str]:
    """The POST of a config's change page as the browser sends it, with `changes` typed in."""
    return {**{name: str(getattr(cfg, name)) for name in EDITABLE}, **changes, "_save": "Save"}


def change_url(cfg: ScheduleCfg) -> str:
    return reverse("admin:taskflow_schedulecfg_change", args=[quote(cfg.pk)])


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_processing_time", "0", "greater than or equal to 1"),
        ("schedule_interval", "0", "greater than or equal to 0.01"),
        ("schedule_interval", "-1", "greater than or equal to 0.01"),
        ("schedule_limit", "0", "greater than or equal to 1"),
        ("schedule_limit", "1001", "less than or equal to 1000"),
        ("retry_jitter", "1.5", "less than or equal to 1"),
        ("retry_interval", "-1", "greater than or equal to 0"),
        ("retry_interval", "7200", "must not exceed the max retry interval"),
        ("priority_aging", "-2", "greater than or equal to 0"),
        ("max_retry_interval", "1e300", "less than or equal to 31536000"),
    ],
)
def test_the_console_refuses_a_schedule_config_a_worker_could_not_run_with(
    staff_client: Client, field: str, value: str, error: str
) -> None:
    cfg = configs.get("test.noop")
    before = ScheduleCfg.objects.filter(pk=cfg.pk).values().get()
    response = staff_client.post(change_url(cfg), change_form(cfg, **{field: value}))
    assert response.status_code == 200  # the form again, with the error; nothing saved
    errors = response.context["adminform"].form.errors
    assert list(errors) == [field] and error in errors[field][0]
    assert ScheduleCfg.objects.filter(pk=cfg.pk).values().get() == before


def test_the_console_saves_a_valid_schedule_config(staff_client: Client) -> None:
    cfg = configs.get("test.noop")
    response = staff_client.post(change_url(cfg), change_form(cfg, max_processing_time="1", retry_jitter="1"))
    assert response.status_code == 302
    saved = ScheduleCfg.objects.get(pk=cfg.pk)
    assert (saved.max_processing_time, saved.retry_jitter) == (1, 1.0)

"""The console in a real headless Chromium: log in, filter, open a task, act through the confirmation
pages (one task and every task matching a filter), see results and the audit trail, edit and pause
a task type, and what staff without taskflow.operate_task see (no actions)."""

from __future__ import annotations

import pytest
from django.contrib import admin

import taskflow
from taskflow.engine.attempts import Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.models import ScheduleCfg, Status, Task, TaskEvent

from .conftest import Console

pytestmark = pytest.mark.browser

T = "test.noop"
OTHER = "test.record"
OPERATOR = ("view_task", "operate_task", "view_taskevent", "view_schedulecfg", "view_workerprocess")


def failed(task_type: str = T, n: int = 1) -> list[Task]:
    """`n` tasks of `task_type` that failed for good (their one attempt failed, no retries)."""
    tasks = [taskflow.enqueue(task_type, {"n": i}, max_retries=0) for i in range(n)]
    held = claim_batch(configs.get(task_type), 100, "host-a:1:w")
    finish_attempts([Report(t, Outcome.ERROR, error="ValueError: broken input") for t in held])
    return tasks


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tasks per list page, so a filter matching three shows the admin's "select all" link."""
    monkeypatch.setattr(admin.site._registry[Task], "list_per_page", 2)


def test_log_in_filter_search_and_open_a_task(console: Console, make_user) -> None:  # noqa: ANN001
    make_user("olga", *OPERATOR)
    for i in range(3):
        taskflow.enqueue(T, {"n": i})
    [bad] = failed(OTHER)
    taskflow.enqueue(T, {"doc": 7}, key="doc-7", trace_id="trace-7")

    console.login("olga")
    console.open("/admin/taskflow/task/")
    assert len(console.all("#result_list tbody tr")) == 5
    assert console.all("span.tf-badge.tf-failed")
    console.screenshot("task-list")

    # The status filter in the sidebar, then the type filter: one failed task of OTHER.
    console.follow_link("Failed")
    console.follow_link(OTHER)
    console.find(".tf-count")
    assert console.text(".tf-count") == "1"
    assert [r.text for r in console.all("#result_list tbody th a")] == [str(bad.pk)]

    # Search by key, then open the task.
    console.open("/admin/taskflow/task/")
    console.type("#searchbar", "doc-7")
    console.follow('#changelist-search input[type="submit"]')
    console.find(".tf-count")
    assert console.text(".tf-count") == "1"
    console.follow("#result_list tbody th a")
    console.find("#tf-attempts")
    assert '"doc": 7' in console.text(".field-payload_block")

    console.open(f"/admin/taskflow/task/{bad.pk}/change/")
    console.find("#tf-attempts")
    assert "ValueError: broken input" in console.text("#tf-attempts")
    assert "failed after 1 attempts" in console.text(".field-status_msg_block")
    labels = {a.get_attribute("textContent").strip() for a in console.all("a.tf-action")}
    assert labels == {"Retry now", "Reschedule", "Set priority", "Set max retries"}
    console.screenshot("task-page")


ONE_TASK = [
    # action, the button's label, fields to type (css -> text), what the task looks like afterwards
    ("terminate", "Terminate", {}, lambda t: t.status == Status.STOPPED),
    ("retry_now", "Retry now", {}, lambda t: t.status == Status.PENDING and t.attempts == 0),
    ("reschedule", "Reschedule", {"#id_delay": "7200"}, lambda t: t.status == Status.PENDING and t.run_after),
    ("set_priority", "Set priority", {"#id_priority": "33"}, lambda t: t.priority == 33),
    ("set_max_retries", "Set max retries", {"#id_max_retries": "9"}, lambda t: t.max_retries == 9),
]


def test_each_action_on_one_task_from_its_page(console: Console, make_user) -> None:  # noqa: ANN001
    make_user("olga", *OPERATOR)
    console.login("olga")
    for action, label, fields, done in ONE_TASK:
        [task] = failed() if action in ("retry_now", "reschedule") else [taskflow.enqueue(T, {})]
        console.open(f"/admin/taskflow/task/{task.pk}/change/")
        console.follow(f"a.tf-action-{action}")
        console.find("#tf-operate-form")
        assert "Selected: 1 selected task" in console.text(".tf-selected")
        if not fields:
            assert console.text(".tf-would-change") == "1"  # the engine's dry run
        for css, text in fields.items():
            console.type(css, text)
        console.type("#id_reason", f"browser {action}")
        console.follow("#tf-confirm")
        assert console.messages()[0] == f"{label}: 1 task changed."
        task.refresh_from_db()
        assert done(task), action
        # Back on the task page: the action is in its history.
        history = console.text("#tf-events")
        assert f"browser {action}" in history and "olga" in history and action in history


def test_a_reason_is_required(console: Console, make_user) -> None:  # noqa: ANN001
    make_user("olga", *OPERATOR)
    task = taskflow.enqueue(T, {})
    console.login("olga")
    console.open(f"/admin/taskflow/task/{task.pk}/change/")
    console.follow("a.tf-action-terminate")
    console.follow("#tf-confirm")
    assert "This field is required." in console.text("#tf-operate-form")
    assert Task.objects.get(pk=task.pk).status == Status.PENDING


def test_each_action_on_all_tasks_matching_the_filter(console: Console, make_user, small_pages) -> None:  # noqa: ANN001
    make_user("olga", *OPERATOR)
    console.login("olga")
    for action, label, fields, done in ONE_TASK:
        Task.objects.all().delete()
        if action in ("retry_now", "reschedule"):
            matching, status = failed(n=3), "failed"
            failed(OTHER)
        else:
            matching, status = [taskflow.enqueue(T, {"n": i}) for i in range(3)], "pending"
            taskflow.enqueue(OTHER, {})
        console.open(f"/admin/taskflow/task/?task_type={T}&status__exact={status}")
        console.click("#action-toggle")  # every row of the page ...
        console.click_link("Select all 3 tasks matching the filter")  # ... then every row matching
        console.choose('select[name="action"]', action)
        console.follow('button[name="index"]')
        console.find("#tf-operate-form")
        assert "all 3 tasks matching the filter" in console.text(".tf-selected")
        for css, text in fields.items():
            console.type(css, text)
        if fields:
            console.follow("#tf-preview-button")
            console.find("#tf-operate-form")
        assert console.text(".tf-would-change") == "3"
        if action == "set_priority":
            console.screenshot("confirmation-page")
        console.type("#id_reason", f"bulk {action}")
        console.follow("#tf-confirm")
        assert console.messages()[0] == f"{label}: 3 tasks changed."
        for task in matching:
            task.refresh_from_db()
            assert done(task), action
        assert TaskEvent.objects.filter(action=action, reason=f"bulk {action}").count() == 3
        assert not TaskEvent.objects.filter(action=action).exclude(task_id__in=[t.pk for t in matching]).exists()

    # The audit trail: every action is listed, filterable by action.
    console.open("/admin/taskflow/taskevent/?action=set_priority")
    rows = console.all("#result_list tbody tr")
    assert len(rows) == 3 and all("bulk set_priority" in r.text and "olga" in r.text for r in rows)
    console.screenshot("task-events")


def test_edit_and_pause_a_task_type(console: Console, make_user) -> None:  # noqa: ANN001
    make_user("tom", "view_task", "view_schedulecfg", "change_schedulecfg")
    configs.get(T)
    configs.get(OTHER)
    console.login("tom")
    console.open(f"/admin/taskflow/schedulecfg/{T}/change/")
    console.type("#id_max_retry_num", "5")
    console.type("#id_retry_interval", "999999")  # over max_retry_interval: refused
    console.follow('input[name="_save"]')
    assert "must not exceed the max retry interval" in console.text(".errorlist")
    console.type("#id_retry_interval", "0.5")
    console.follow('input[name="_save"]')
    console.messages()
    assert ScheduleCfg.objects.get(pk=T).max_retry_num == 5

    console.open("/admin/taskflow/schedulecfg/")
    for box in console.all("input.action-select"):
        if box.get_attribute("value") == T:
            box.click()
    console.choose('select[name="action"]', "pause")
    console.follow('button[name="index"]')
    assert console.messages() == [f"Paused 1 task type(s): {T}."]
    assert set(ScheduleCfg.objects.filter(paused=True).values_list("pk", flat=True)) == {T}
    console.follow_link("all")  # the type's tasks, from its row
    console.find("#changelist-filter")
    assert f"task_type={T}" in console.driver.current_url or f"task_type={T}" in console.driver.current_url.replace(
        "%2E", "."
    )
    console.screenshot("task-types")


def test_staff_without_operate_task_see_no_actions(console: Console, make_user) -> None:  # noqa: ANN001
    make_user("victor", "view_task", "view_taskevent")
    task = taskflow.enqueue(T, {})
    console.login("victor")
    console.open("/admin/taskflow/task/")
    console.find("#result_list")
    assert not console.all('select[name="action"]') and not console.all("input.action-select")
    console.open(f"/admin/taskflow/task/{task.pk}/change/")
    console.find("#tf-events")
    assert not console.all("a.tf-action")
    console.open(f"/admin/taskflow/task/operate/terminate/?_selected_action={task.pk}")
    assert "403" in console.driver.title or "Forbidden" in console.text()
    assert Task.objects.get(pk=task.pk).status == Status.PENDING


def test_dashboard(console: Console, make_user) -> None:  # noqa: ANN001
    """From the index to the dashboard: numbers and a chart per type; a number leads to its tasks."""
    from datetime import timedelta

    from django.utils import timezone

    from taskflow.engine import stats

    now = timezone.now()
    outcomes = {T: (40, 4), OTHER: (25, 7)}  # (succeeded, failed) over the last hour
    failed_ids = set()
    for task_type, (ok, bad) in outcomes.items():
        for i in range(ok + bad):
            task = taskflow.enqueue(task_type, {"n": i})
            ended = now - timedelta(minutes=(i * 7) % 58, seconds=i % 50)
            status = Status.FAILED if i < bad else Status.SUCCESS
            run = timedelta(milliseconds=40 + (i * 37) % 900)
            Task.objects.filter(pk=task.pk).update(status=status, started_at=ended - run, finished_at=ended)
            if task_type == OTHER and status == Status.FAILED:
                failed_ids.add(task.pk)
    taskflow.enqueue(OTHER, {"waiting": True})
    ScheduleCfg.objects.filter(pk=OTHER).update(concurrency_limit=4, paused=True)
    stats.refresh()
    make_user("dana", "view_task", "view_schedulecfg")

    console.login("dana")
    console.follow_link("Dashboard")  # its entry in the index
    assert console.driver.current_url.endswith("/admin/taskflow/dashboard/")
    other = console.find('div.tf-type[data-task-type="test.record"]')
    assert other.find_element(console.by.CSS_SELECTOR, "a.tf-count-failed").text == "7"
    assert other.find_element(console.by.CSS_SELECTOR, "a.tf-completed").text == "25"
    assert "paused" in other.find_element(console.by.CSS_SELECTOR, "h2").text
    assert len(other.find_elements(console.by.CSS_SELECTOR, "svg.tf-chart rect")) >= 10
    noop = console.find('div.tf-type[data-task-type="test.noop"]')
    assert noop.find_element(console.by.CSS_SELECTOR, "a.tf-rate").text == f"{40 / 44 * 100:.1f} %"
    console.screenshot("dashboard")

    console.follow('div.tf-type[data-task-type="test.record"] a.tf-count-failed')
    rows = console.all("#result_list tbody tr")
    assert len(rows) == 7
    assert {int(r.find_element(console.by.CSS_SELECTOR, "th, td.field-id").text) for r in rows} == failed_ids

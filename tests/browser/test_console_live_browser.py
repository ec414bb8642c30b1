"""The live console in a real headless Chromium: pages refresh themselves without a reload, pause
stops that (remembered by the browser), a running task's progress bar moves, the task list fits a
1,400 px window with both sidebars, and the host project's admin keeps its own header."""

from __future__ import annotations

import time

import pytest
from selenium.webdriver.support.ui import WebDriverWait

import taskflow
from taskflow.admin import live
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.models import Status, Task
from taskflow.runtime.context import TaskContext

from .conftest import WAIT, Console

pytestmark = pytest.mark.browser

T = "test.noop"
OPERATOR = ("view_task", "operate_task", "view_taskevent", "view_schedulecfg", "view_workerprocess")
REFRESH = 0.5  # seconds, for the test; pages refresh every live.REFRESH_SECONDS


@pytest.fixture
def quick_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live, "REFRESH_SECONDS", REFRESH)


def until(console: Console, condition, message: str) -> None:  # noqa: ANN001
    WebDriverWait(console.driver, WAIT).until(lambda driver: condition(), message)


def live_on(console: Console) -> None:
    """Start from "live" whatever an earlier test left in this browser's storage."""
    console.driver.execute_script("localStorage.removeItem('taskflow.live.paused')")


def mark(console: Console) -> None:
    """A mark on this page's window: a reload would lose it."""
    console.driver.execute_script("window.tfNoReload = true")


def not_reloaded(console: Console) -> bool:
    return console.driver.execute_script("return window.tfNoReload === true")


def badge(console: Console, task_id: int) -> str:
    cells = console.all(f'#result_list tr:has(input.action-select[value="{task_id}"]) span.tf-badge')
    return cells[0].text if cells else ""


def test_the_list_and_the_task_page_refresh_without_a_reload_and_pause_stops_it(
    console: Console, make_user, quick_refresh: None  # noqa: ANN001
) -> None:
    make_user("olga", *OPERATOR)
    watched = taskflow.enqueue(T, {"n": 1})
    ticked = taskflow.enqueue(T, {"n": 2})
    console.login("olga")
    live_on(console)
    console.open("/admin/taskflow/task/")
    assert console.find("#tf-live").is_displayed()
    assert console.text(".tf-live-toggle") == "Pause"
    mark(console)
    console.click(f'input.action-select[value="{ticked.pk}"]')  # the operator's selection
    assert badge(console, watched.pk) == "pending"

    Task.objects.filter(pk=watched.pk).update(status=Status.FAILED)
    until(console, lambda: badge(console, watched.pk) == "failed", "the list never showed the new status")
    assert not_reloaded(console)
    assert console.find(f'input.action-select[value="{ticked.pk}"]').is_selected()  # selection kept
    assert "Updated" in console.text(".tf-live-status")

    # Paused: the database changes, the page does not; the pause outlives a reload.
    console.click(".tf-live-toggle")
    assert console.text(".tf-live-toggle") == "Resume"
    Task.objects.filter(pk=watched.pk).update(status=Status.STOPPED)
    time.sleep(REFRESH * 6)
    assert badge(console, watched.pk) == "failed"
    console.open("/admin/taskflow/task/")
    assert console.text(".tf-live-toggle") == "Resume" and "paused" in console.text(".tf-live-status")
    mark(console)
    time.sleep(REFRESH * 4)
    Task.objects.filter(pk=watched.pk).update(status=Status.PENDING)
    time.sleep(REFRESH * 4)
    assert badge(console, watched.pk) == "stopped"
    console.click(".tf-live-toggle")
    until(console, lambda: badge(console, watched.pk) == "pending", "resumed, the list never refreshed")
    assert not_reloaded(console)

    # The task page: its status badge and its actions follow the task.
    console.open(f"/admin/taskflow/task/{watched.pk}/change/")
    mark(console)
    assert console.text(".field-status_badge .tf-badge") == "pending"
    Task.objects.filter(pk=watched.pk).update(status=Status.FAILED)
    until(
        console, lambda: console.text(".field-status_badge .tf-badge") == "failed", "the task page never refreshed"
    )
    assert not_reloaded(console)


def test_the_progress_bar_moves_as_a_running_task_reports(console: Console, make_user, quick_refresh: None) -> None:  # noqa: ANN001
    make_user("olga", *OPERATOR)
    task = taskflow.enqueue(T, {"rows": 400})
    [attempt] = claim_batch(configs.get(T), 1, "host-a:1:w")
    console.login("olga")
    live_on(console)
    console.open(f"/admin/taskflow/task/{task.pk}/change/")
    mark(console)
    assert console.text(".field-progress_block .readonly") == "-"

    TaskContext(attempt).progress(100, 400, "rows 1-100")
    shown = lambda: console.text(".field-progress_block .readonly")  # noqa: E731
    until(console, lambda: "25 %" in shown(), "no progress bar on the task page")
    assert "rows 1-100" in console.text(".field-progress_block .readonly")
    value = lambda: console.find(".field-progress_block .readonly progress").get_attribute("value")  # noqa: E731
    assert float(value()) == 100
    TaskContext(attempt).progress(300, 400, "rows 201-300")
    until(console, lambda: float(value()) == 300, "the bar did not move")
    assert "75 %" in console.text(".field-progress_block .readonly") and not_reloaded(console)

    console.open("/admin/taskflow/task/")
    assert "75 %" in console.text(f'#result_list tr:has(input.action-select[value="{task.pk}"]) .field-state')
    console.screenshot("task-list-progress")


def test_the_task_list_fits_1400_px_with_both_sidebars(console: Console, make_user) -> None:  # noqa: ANN001
    make_user("olga", *OPERATOR)
    for i in range(5):
        taskflow.enqueue(
            "reports.render_quarterly_statement",
            {"n": i},
            key=f"customer-4711-quarterly-statement-2026-q{i}",
            stage="render-and-upload-pdf",
            priority=-100,
        )
    worker = "worker-host-eu-west-1a.example.internal:123456:abcdef"
    [attempt] = claim_batch(configs.get("reports.render_quarterly_statement"), 1, worker)
    TaskContext(attempt).progress(12345, 67890, "a long message")
    size = console.driver.get_window_size()
    try:
        console.driver.set_window_size(1400, size["height"])
        console.login("olga")
        console.driver.execute_script("localStorage.setItem('django.admin.navSidebarIsOpen', 'true')")
        console.open("/admin/taskflow/task/")
        assert console.find("#nav-sidebar").is_displayed() and console.find("#changelist-filter").is_displayed()
        inner, scrolled = console.driver.execute_script(
            "return [window.innerWidth, document.scrollingElement.scrollWidth]"
        )
        assert inner <= 1400 and scrolled <= inner, f"the page is {scrolled} px wide in a {inner} px window"
        # Nor does the table scroll inside its own box (the admin's .results scrolls what overflows).
        table, box = console.driver.execute_script(
            "const box = document.querySelector('#changelist .results');"
            "return [document.querySelector('#result_list').getBoundingClientRect().width, box.clientWidth]"
        )
        assert table <= box, f"the table is {table} px wide in a {box} px box"
        console.screenshot("task-list-1400")
    finally:
        console.driver.set_window_size(size["width"], size["height"])


def test_the_host_projects_admin_keeps_its_own_header(console: Console, make_user) -> None:  # noqa: ANN001
    make_user("olga", *OPERATOR)
    console.login("olga")
    console.open("/admin/")
    assert console.text("#site-name") == "Django administration"
    assert console.driver.title.endswith("Django site admin")
    console.open("/admin/taskflow/task/")
    assert console.text("#site-name") == "Django administration"

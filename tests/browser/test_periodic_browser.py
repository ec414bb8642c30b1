"""Periodic tasks in a real headless Chromium: a bad cron refused on the form, an edit, disable,
"run now", and the links between a schedule and its tasks."""

from __future__ import annotations

import pytest

from taskflow.engine.periodic import create_schedule, fire_schedule
from taskflow.models import PeriodicTask, Task

from .conftest import Console

pytestmark = pytest.mark.browser

OPERATOR = ("view_task", "operate_task", "view_periodictask", "change_periodictask", "view_schedulecfg")


def test_edit_disable_and_run_a_schedule_now(console: Console, make_user) -> None:  # noqa: ANN001
    make_user("pia", *OPERATOR)
    create_schedule(PeriodicTask(name="report", task_type="test.noop", cron="0 3 * * *", payload={"n": 1}))
    [tick] = fire_schedule("report", PeriodicTask.objects.get(pk="report").next_run_at)
    console.login("pia")

    console.open("/admin/taskflow/periodictask/report/change/")
    console.type("#id_cron", "0 25 * * *")
    console.follow('input[name="_save"]')
    assert "Not a valid cron expression (Bad hour)" in console.text(".errorlist")
    assert PeriodicTask.objects.get(pk="report").cron == "0 3 * * *"
    console.type("#id_cron", "30 4 * * 1-5")
    console.type("#id_timezone", "Asia/Tokyo")
    console.follow('input[name="_save"]')
    console.messages()
    row = PeriodicTask.objects.get(pk="report")
    assert (row.cron, row.timezone) == ("30 4 * * 1-5", "Asia/Tokyo")
    assert "30 4 * * 1-5 (Asia/Tokyo)" in console.text("#result_list")

    console.find('input.action-select[value="report"]').click()
    console.choose('select[name="action"]', "disable")
    console.follow('button[name="index"]')
    assert console.messages() == ["Disabled 1 schedule(s): report."]
    assert "disabled" in console.text("#result_list")
    console.screenshot("periodic-list")

    console.open("/admin/taskflow/periodictask/report/change/")
    console.screenshot("periodic-schedule")
    console.follow("button.tf-action-run-now")
    [message] = console.messages()
    manual = Task.objects.get(key="periodic:report:manual")
    assert message == f"Schedule report: enqueued task {manual.pk}."
    console.follow_link(str(manual.pk))
    assert "“run now”" in console.text("#tf-periodic")
    console.follow_link("report")
    console.follow_link("ticks")  # the schedule's tick tasks, by key
    assert [a.text for a in console.all("#result_list tbody th a")] == [str(tick.pk)]
    console.follow_link(str(tick.pk))
    assert ", for its tick at " in console.text("#tf-periodic")
    console.screenshot("periodic-task")

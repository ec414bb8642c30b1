"""Dependencies in the console, in a real headless Chromium: a waiting task's page shows what it waits
for and what waits for it, links lead there, and terminating it stops its dependents."""

from __future__ import annotations

import pytest

import taskflow
from taskflow.models import Status, Task

from .conftest import Console
from .test_console_browser import OPERATOR, T

pytestmark = pytest.mark.browser


def test_a_waiting_tasks_page_links_its_graph_and_terminate_stops_its_dependents(console: Console, make_user) -> None:  # noqa: ANN001
    make_user("olga", *OPERATOR)
    a = taskflow.enqueue(T, {"n": "a"})
    b = taskflow.enqueue(T, {"n": "b"}, depends_on=[a.id])
    d = taskflow.enqueue(T, {"n": "d"}, depends_on=[b.id])
    console.login("olga")

    console.open("/admin/taskflow/task/?status__exact=waiting")
    assert len(console.all("span.tf-badge.tf-waiting")) == 2
    console.open(f"/admin/taskflow/task/{b.pk}/change/")
    section = console.text("#tf-dependencies")
    assert f"waits for {a.pk}" in section and f"waited for by {d.pk}" in section
    labels = {x.get_attribute("textContent").strip() for x in console.all("a.tf-action")}
    assert labels == {"Terminate", "Reschedule", "Set priority", "Set max retries"}
    console.screenshot("waiting-task")

    console.follow(f'#tf-dependencies a[href$="/{a.pk}/change/"]')  # to the dependency ...
    console.find("#tf-dependencies")
    assert f"waited for by {b.pk}" in console.text("#tf-dependencies")
    console.follow(f'#tf-dependencies a[href$="/{b.pk}/change/"]')  # ... and back

    console.follow("a.tf-action-terminate")
    console.find("#tf-operate-form")
    console.type("#id_reason", "not needed")
    console.follow("#tf-confirm")
    assert console.messages()[0] == "Terminate: 1 task changed."
    assert Task.objects.get(pk=b.pk).status == Status.STOPPED
    d.refresh_from_db()
    assert (d.status, d.status_msg) == (Status.STOPPED, f"dependency {b.pk} was stopped (stopped by olga: not needed)")
    console.open(f"/admin/taskflow/task/{d.pk}/change/")
    assert f"dependency {b.pk} was stopped" in console.text(".field-status_msg_block")

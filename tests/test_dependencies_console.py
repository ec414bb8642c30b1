"""Dependencies in the console: the waiting status in the list and its filter, and a task's dependencies
and dependents on its page."""

from __future__ import annotations

import re
from html import unescape
from pathlib import Path

import pytest
from django.test import Client

import taskflow
from taskflow.engine.attempts import Outcome
from taskflow.models import Task

from .test_console import LIST, OPERATOR_PERMS, T, finish, shown, staff

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def operator() -> Client:
    return staff("olga", *OPERATOR_PERMS)


def test_waiting_tasks_have_their_badge_and_their_filter(operator: Client) -> None:
    a = taskflow.enqueue(T, {})
    b = taskflow.enqueue(T, {}, depends_on=[a.id])
    page = operator.get(LIST)
    assert '<span class="tf-badge tf-waiting">waiting</span>' in page.content.decode()
    assert "?status__exact=waiting" in page.content.decode()  # offered by the status filter
    assert "after its dependencies" in page.content.decode()  # its due column
    assert shown(operator.get(LIST, {"status__exact": "waiting"})) == {b.pk}
    css = Path(taskflow.__file__).parent / "static/taskflow/console.css"
    assert ".tf-waiting {" in css.read_text()


def test_the_task_page_shows_dependencies_and_dependents_with_their_status_and_links(operator: Client) -> None:
    a = taskflow.enqueue(T, {}, max_retries=0)
    b = taskflow.enqueue(T, {}, depends_on=[a.id])
    c = taskflow.enqueue("test.record", {}, depends_on=[b.id], on_dependency_failure="run")
    finish(a, Outcome.FAIL, "boom")

    html = unescape(operator.get(f"{LIST}{b.pk}/change/").content.decode())
    section = html[html.index('id="tf-dependencies"') : html.index("</fieldset>", html.index('id="tf-dependencies"'))]
    rows = re.findall(r'<tr class="tf-(dependency|dependent)">(.*?)</tr>', section, re.S)
    assert [kind for kind, _ in rows] == ["dependency", "dependent"]
    assert f'href="/admin/taskflow/task/{a.pk}/change/"' in rows[0][1] and "tf-failed" in rows[0][1]
    assert f'href="/admin/taskflow/task/{c.pk}/change/"' in rows[1][1] and "tf-pending" in rows[1][1]
    assert "it runs anyway" in rows[1][1] and "test.record" in rows[1][1]
    assert f"dependency {a.pk} failed" in html  # B's own status message
    # A waiting task offers terminate and reschedule, not retry_now.
    waiting = taskflow.enqueue(T, {}, depends_on=[taskflow.enqueue(T, {}).id])
    actions = re.findall(r"tf-action tf-action-(\w+)", operator.get(f"{LIST}{waiting.pk}/change/").content.decode())
    assert actions == ["terminate", "reschedule", "set_priority", "set_max_retries"]


def test_a_task_without_dependencies_shows_no_dependency_section(operator: Client) -> None:
    task = taskflow.enqueue(T, {})
    assert 'id="tf-dependencies"' not in operator.get(f"{LIST}{task.pk}/change/").content.decode()


def test_a_dependency_gone_is_shown_without_a_link(operator: Client) -> None:
    a = taskflow.enqueue(T, {})
    b = taskflow.enqueue(T, {}, depends_on=[a.id])
    Task.objects.filter(pk=a.pk).delete()
    html = operator.get(f"{LIST}{b.pk}/change/").content.decode()
    assert "tf-missing" in html and f"/admin/taskflow/task/{a.pk}/change/" not in html

"""The console showing the present: live pages (without JavaScript too), search by a payload value, times to the
second, effective values, the dashboard's totals and fleet, the workers' types, and the host admin's own titles."""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape

import pytest
from django.contrib import admin
from django.test import Client
from django.utils import timezone

import taskflow
from taskflow.admin import display
from taskflow.engine import payload_search, stats, workers
from taskflow.engine.attempts import Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.models import ScheduleCfg, Status, Task
from tests.conftest import staff

pytestmark = pytest.mark.django_db
T = "test.noop"
OTHER = "test.record"
LIST = "/admin/taskflow/task/"


@pytest.fixture
def viewer() -> Client:
    return staff("vera", "view_task", "view_workerprocess", "view_schedulecfg")


def listed(client: Client, **query: str) -> tuple[set[int], list[str]]:
    """The task ids a list page shows, and its admin messages."""
    response = client.get(LIST, query)
    assert response.status_code == 200
    ids = {int(i) for i in re.findall(r'/admin/taskflow/task/(\d+)/change/', response.content.decode())}
    return ids, [str(m) for m in response.context["messages"]]


# -- search by a payload value -----------------------------------------------------------------------------


def test_search_by_a_payload_value_matches_its_json_type_and_path(viewer: Client) -> None:
    by_int = taskflow.enqueue(T, {"order_id": 42, "customer": {"email": "ann@example.com", "vip": True}})
    by_text = taskflow.enqueue(T, {"order_id": "42", "tags": ["a", "b"], "note": None})
    other = taskflow.enqueue(OTHER, {"order_id": 43, "contains": 7})

    assert listed(viewer, q="payload.order_id = 42")[0] == {by_int.pk}
    assert listed(viewer, q='payload.order_id = "42"')[0] == {by_text.pk}
    assert listed(viewer, q="payload.order_id=43")[0] == {other.pk}
    assert listed(viewer, q='payload.customer.email = "ann@example.com"')[0] == {by_int.pk}
    assert listed(viewer, q="payload.customer.email = ann@example.com")[0] == {by_int.pk}  # a bare word: a string
    assert listed(viewer, q="payload.customer.vip = true")[0] == {by_int.pk}
    assert listed(viewer, q="payload.tags.1 = b")[0] == {by_text.pk}  # an array index
    assert listed(viewer, q="payload.contains = 7")[0] == {other.pk}  # a key named like a lookup is a key
    assert listed(viewer, q="payload.order_id = 42", task_type=OTHER)[0] == set()  # with the list's filters
    assert listed(viewer, q="payload.missing = 1")[0] == set()


@pytest.mark.parametrize(
    ("term", "says"),
    [
        ("payload.order_id", "compares a path with a value"),
        ("payload.order id = 4", "'order id' is not a key"),
        ("payload..x = 4", "an empty key"),
        ("payload.a__b = 4", "'a__b' is not a key"),
        ("payload.x = ", "no value after '='"),
        ("payload.x = [1, 2]", "a number, a string, true, false or null"),
        ("payload.x = NaN", "finite number"),
        ("payload." + ".".join("k" * 9) + " = 1", "at most 8 keys"),
    ],
)
def test_a_malformed_payload_search_is_a_clear_message_not_a_500(viewer: Client, term: str, says: str) -> None:
    taskflow.enqueue(T, {"x": 4})
    ids, messages = listed(viewer, q=term)
    assert ids == set()
    assert len(messages) == 1 and says in messages[0], messages


def test_the_payload_search_reads_only_the_newest_tasks_matching_the_filters(
    viewer: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(payload_search, "SCAN_LIMIT", 3)
    old = taskflow.enqueue(T, {"order_id": 1})
    newer = [taskflow.enqueue(T, {"order_id": 1 if i == 2 else 2}) for i in range(3)]
    other_type = taskflow.enqueue(OTHER, {"order_id": 2})

    ids, messages = listed(viewer, q="payload.order_id = 1")
    assert ids == {newer[2].pk}  # the old one lies beyond the newest three
    assert "newest 3 tasks" in messages[0]
    # A type filter reaches further back in that type.
    ids, _ = listed(viewer, q="payload.order_id = 1", task_type=T)
    assert ids == {newer[2].pk}
    assert listed(viewer, q="payload.order_id = 2", task_type=OTHER)[0] == {other_type.pk}
    monkeypatch.setattr(payload_search, "SCAN_LIMIT", 10)
    ids, messages = listed(viewer, q="payload.order_id = 1")
    assert ids == {old.pk, newer[2].pk} and messages == []


def test_the_exact_searches_still_work_beside_the_payload_search(viewer: Client) -> None:
    keyed = taskflow.enqueue(T, {"payload": 1}, key="order-7", trace_id="trace-7")
    for term in (str(keyed.pk), "order-7", "trace-7", "payload.payload = 1"):
        assert listed(viewer, q=term)[0] == {keyed.pk}, term


# -- times and effective values ------------------------------------------------------------------------------


def test_times_are_shown_to_the_second_with_how_long_ago_and_attempts_to_the_millisecond() -> None:
    now = timezone.now()
    when = now - timedelta(seconds=3, microseconds=250_000)
    shown = str(display.timestamp(when, now=now))
    local = timezone.localtime(when)
    assert local.strftime("%Y-%m-%d %H:%M:%S") in shown and "(3 s ago)" in shown
    assert local.strftime("%H:%M:%S.") + f"{local.microsecond // 1000:03d}" in str(display.timestamp(when, ms=True))
    assert display.timestamp(None) == "-"


def page_text(client: Client, url: str) -> str:
    page = unescape(client.get(url).content.decode()).replace("\xa0", " ")
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))


def test_the_task_page_shows_times_to_the_second_and_effective_values(viewer: Client) -> None:
    ScheduleCfg.objects.update_or_create(task_type=T, defaults={"max_retry_num": 3, "max_processing_time": 300})
    configs.clear()
    defaulted = taskflow.enqueue(T, {})
    own = taskflow.enqueue(OTHER, {}, max_retries=5, timeout=20)
    [attempt] = claim_batch(configs.get(T), 1, "host-a:1:w")
    finish_attempts([Report(attempt, Outcome.ERROR, error="boom")])

    text = page_text(viewer, f"{LIST}{defaulted.pk}/change/")
    assert "Max retries: 3 (type default)" in text and "Timeout: 300 s (type default)" in text
    created = timezone.localtime(Task.objects.get(pk=defaulted.pk).created_at).strftime("%Y-%m-%d %H:%M:%S")
    assert f"Created at: {created} (" in text
    attempts = text[text.index("Attempts (schedule log") :]
    started = timezone.localtime(attempt.claimed_at)
    assert re.search(re.escape(started.strftime("%Y-%m-%d %H:%M:%S.")) + r"\d{3} \(", attempts), attempts[:300]

    text = page_text(viewer, f"{LIST}{own.pk}/change/")
    assert "Max retries: 5" in text and "Timeout: 20 s" in text and "type default" not in text


# -- live pages without JavaScript ---------------------------------------------------------------------------


def test_live_pages_carry_a_hidden_control_and_their_script_but_work_without_it(viewer: Client) -> None:
    task = taskflow.enqueue(T, {})
    for url in (LIST, f"{LIST}{task.pk}/change/", "/admin/taskflow/dashboard/"):
        page = viewer.get(url).content.decode()
        assert re.search(r'<div id="tf-live"[^>]*\bhidden\b', page), url
        assert "taskflow/live.js" in page and "//cdn" not in page and "https://" not in page.split("<body")[1]
    # A page with a form open (an action's confirmation) and the history are not live.
    staff_operator = staff("olga", "view_task", "operate_task")
    confirm = staff_operator.get(f"{LIST}operate/terminate/", {"_selected_action": task.pk, "select_across": 0})
    assert confirm.status_code == 200 and 'id="tf-live"' not in confirm.content.decode()


def test_the_list_shows_a_running_tasks_progress_in_its_status(viewer: Client) -> None:
    from taskflow.runtime.context import TaskContext

    task = taskflow.enqueue(T, {})
    [attempt] = claim_batch(configs.get(T), 1, "host-a:1:w")
    TaskContext(attempt).progress(30, 120, "pages")
    page = viewer.get(LIST).content.decode()
    assert '<progress max="120" value="30"' in page and "25 %" in page and "30 of 120: pages" in page
    assert Task.objects.get(pk=task.pk).status == Status.PROCESSING


# -- the dashboard's totals and the workers page ---------------------------------------------------------------


def test_the_dashboard_starts_with_totals_across_types_and_the_fleet(viewer: Client) -> None:
    for task_type in (T, OTHER):
        taskflow.enqueue(task_type, {})
    taskflow.enqueue(T, {}, max_retries=0)
    held = claim_batch(configs.get(T), 2, "host-a:1:w")
    finish_attempts([Report(held[0], Outcome.SUCCESS), Report(held[1], Outcome.ERROR, error="x")])
    taskflow.enqueue(T, {})
    claim_batch(configs.get(T), 1, "host-b:2:w")
    workers.beat("host-a:1:w", "host-a", [T], 4, pid=1)
    workers.beat("host-a:3:w", "host-a", [T, OTHER], 2, pid=3)
    workers.beat("host-b:2:w", "host-b", [OTHER], 1, pid=2)
    stats.refresh()

    page = unescape(viewer.get("/admin/taskflow/dashboard/").content.decode())
    totals = page[page.index('id="totals"') : page.index('id="type-')]
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", totals))
    assert "workers alive 3 on 2 hosts" in text
    assert "host-a : 2 workers" in text and "host-b : 1 worker" in text
    assert "in flight / worker capacity 1 / 7" in text
    assert re.search(r"last 5 min: completed 1 \(0\.2/min\)", text), text
    assert "last 5 min: failed 1" in text
    counts = dict(re.findall(r'class="tf-total-(\w+)" href="[^"]*">(\d+)<', totals))
    assert counts["pending"] == "1" and counts["processing"] == "1" and counts["success"] == "1"


def test_the_workers_page_lists_each_workers_types_one_to_a_line() -> None:
    client = staff("wes", "view_workerprocess")
    workers.beat("host-a:1:w", "host-a", ["emails.send", "reports.render"], 4, pid=1)
    page = client.get("/admin/taskflow/workerprocess/").content.decode()
    assert '<ul class="tf-types"><li>emails.send</li><li>reports.render</li></ul>' in page


# -- the host project's admin ---------------------------------------------------------------------------------


def test_installing_taskflow_leaves_the_host_admins_titles_alone(viewer: Client) -> None:
    assert (admin.site.site_header, admin.site.site_title, admin.site.index_title) == (
        "Django administration",
        "Django site admin",
        "Site administration",
    )
    page = viewer.get("/admin/").content.decode()
    assert re.search(r'id="site-name"><a href="/admin/">Django administration</a>', page), page[:2000]


def test_the_example_project_titles_its_own_admin() -> None:
    from project.admin import ExampleAdminConfig, ExampleAdminSite

    assert ExampleAdminConfig.default_site == "project.admin.ExampleAdminSite"
    assert ExampleAdminSite.site_header == "taskflow example"

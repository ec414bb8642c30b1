"""The dashboard (/admin/taskflow/dashboard/): who sees it, what it shows, and where its numbers lead."""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import taskflow
from taskflow.engine import stats
from taskflow.models import ScheduleCfg, Status, Task, TaskStats

pytestmark = pytest.mark.django_db

URL = "/admin/taskflow/dashboard/"
A = "test.noop"
B = "test.record"


def staff(name: str, *codenames: str) -> Client:
    user = User.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="taskflow", codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def viewer() -> Client:
    return staff("vera", "view_task", "view_schedulecfg")


def put(task_type: str, status: str, **columns: object) -> Task:
    created = taskflow.enqueue(task_type)
    Task.objects.filter(pk=created.pk).update(status=status, **columns)
    return created


@pytest.fixture
def tasks() -> dict[str, Task]:
    now = timezone.now().replace(second=30, microsecond=0)
    three_ago = now - timedelta(minutes=3)
    made = {
        "ok1": put(A, Status.SUCCESS, started_at=three_ago - timedelta(milliseconds=80), finished_at=three_ago),
        "ok2": put(A, Status.SUCCESS, started_at=now - timedelta(seconds=2), finished_at=now - timedelta(seconds=1)),
        "bad": put(A, Status.FAILED, started_at=three_ago, finished_at=three_ago),
        "old": put(A, Status.FAILED, started_at=now - timedelta(hours=3), finished_at=now - timedelta(hours=3)),
        "due": put(A, Status.PENDING, run_after=now - timedelta(minutes=5), order_time=now - timedelta(minutes=5)),
        "running": put(A, Status.PROCESSING, started_at=now),
    }
    configs_b = ScheduleCfg.objects.get_or_create(task_type=B)[0]
    configs_b.paused, configs_b.concurrency_limit = True, 5
    configs_b.save()
    stats.refresh(now)
    return made


def card(html: str, task_type: str) -> str:
    match = re.search(
        rf'<div class="module tf-type"[^>]*data-task-type="{re.escape(task_type)}">(.*?)</figure>', html, re.S
    )
    assert match, f"no panel for {task_type}"
    return match.group(1)


def link(fragment: str, css: str) -> tuple[str, str]:
    """(href, text) of the link with class `css` in `fragment`."""
    match = re.search(rf'<a class="{css}" href="([^"]+)"[^>]*>([^<]*)</a>', fragment)
    assert match, f"no {css} link"
    return unescape(match.group(1)), match.group(2)


def shown(client: Client, url: str) -> set[int]:
    response = client.get(url)
    assert response.status_code == 200, url
    return {t.pk for t in response.context["cl"].result_list}


def test_staff_with_view_task_see_every_type_with_its_numbers_and_a_chart(viewer: Client, tasks: dict) -> None:
    response = viewer.get(URL)
    assert response.status_code == 200
    html = response.content.decode()
    a, b = card(html, A), card(html, B)
    assert link(a, "tf-count-success")[1] == "2"
    assert link(a, "tf-count-failed")[1] == "2"
    assert link(a, "tf-count-pending")[1] == "1"
    assert link(a, "tf-in-flight")[1] == "1"
    assert link(a, "tf-completed")[1] == "2"
    assert link(a, "tf-failed-count")[1] == "1"  # the old failure is outside the hour
    assert link(a, "tf-rate")[1] == "66.7 %"
    assert unescape(link(a, "tf-oldest")[1]).replace("\xa0", " ") == "5 minutes"
    assert link(a, "tf-p50")[1].endswith("ms")
    assert "active" in a and "paused" in b and ">5</a>" in b  # B's limit
    assert a.count("<svg") == 1 and "<rect" in a
    assert "<script" not in html.split('id="content-main"')[1]  # the charts are SVG drawn by the server
    assert "<rect" not in b  # nothing finished
    assert 'href="http' not in html.split("<body")[1].split('id="content"')[1]  # no external asset or CDN


def test_each_number_links_to_the_list_of_the_tasks_it_counts(viewer: Client, tasks: dict) -> None:
    html = card(viewer.get(URL).content.decode(), A)
    ids = {name: t.pk for name, t in tasks.items()}
    assert shown(viewer, link(html, "tf-count-success")[0]) == {ids["ok1"], ids["ok2"]}
    assert shown(viewer, link(html, "tf-count-failed")[0]) == {ids["bad"], ids["old"]}
    assert shown(viewer, link(html, "tf-count-pending")[0]) == {ids["due"]}
    assert shown(viewer, link(html, "tf-in-flight")[0]) == {ids["running"]}
    assert shown(viewer, link(html, "tf-completed")[0]) == {ids["ok1"], ids["ok2"]}
    assert shown(viewer, link(html, "tf-failed-count")[0]) == {ids["bad"]}
    assert shown(viewer, link(html, "tf-rate")[0]) == {ids["ok1"], ids["ok2"], ids["bad"]}
    # A chart bar: the tasks finished in its minute, with its status.
    bars = {
        title: unescape(href)
        for href, title in re.findall(r'<a href="([^"]+)"><rect [^>]*><title>([^<]+)</title>', html)
    }
    assert len(bars) == 3, bars
    by_ids = {frozenset(shown(viewer, url)): title for title, url in bars.items()}
    assert set(by_ids) == {frozenset({ids["ok1"]}), frozenset({ids["bad"]}), frozenset({ids["ok2"]})}
    assert by_ids[frozenset({ids["bad"]})].endswith("1 failed")


def test_the_page_reads_only_the_rollup(viewer: Client, tasks: dict) -> None:
    with CaptureQueriesContext(connection) as queries:
        assert viewer.get(URL).status_code == 200
    table = Task._meta.db_table
    assert not [q["sql"] for q in queries.captured_queries if re.search(rf"\b{table}\b[`\"]", q["sql"])]


def test_old_numbers_say_so(viewer: Client, tasks: dict) -> None:
    assert "tf-stale" not in viewer.get(URL).content.decode()
    TaskStats.objects.update(refreshed_at=timezone.now() - timedelta(minutes=10))
    assert "is a <code>manage.py taskwatch</code> running?" in viewer.get(URL).content.decode()


def test_who_may_see_it(tasks: dict) -> None:
    assert staff("sol", "view_schedulecfg").get(URL).status_code == 403  # staff without view_task
    anonymous = Client().get(URL)
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    user = User.objects.create_user("nat", password="pw")  # not staff
    client = Client()
    client.force_login(user)
    assert client.get(URL).status_code == 302


def test_linked_from_the_index_and_the_task_list(viewer: Client) -> None:
    assert f'href="{URL}"' in viewer.get("/admin/").content.decode()
    assert f'href="{URL}"' in viewer.get("/admin/taskflow/").content.decode()
    assert f'href="{URL}"' in viewer.get("/admin/taskflow/task/").content.decode()
    other = staff("otto", "view_schedulecfg")
    assert URL not in other.get("/admin/").content.decode()


def test_a_fresh_install_shows_an_empty_dashboard(viewer: Client) -> None:
    response = viewer.get(URL)
    assert response.status_code == 200
    assert "No task types yet" in response.content.decode()

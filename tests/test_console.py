"""The operator console (Django admin): lists, the task page, actions and who may do what."""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape
from urllib.parse import urlencode

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import taskflow
from taskflow.admin import listing
from taskflow.engine import workers
from taskflow.engine.attempts import Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.models import ScheduleCfg, Status, Task, TaskEvent
from tests.conftest import staff

pytestmark = pytest.mark.django_db

T = "test.noop"
OTHER = "test.record"
LIST = "/admin/taskflow/task/"
OPERATOR_PERMS = ["view_task", "operate_task", "view_taskevent", "view_schedulecfg", "view_workerprocess"]




@pytest.fixture
def operator() -> Client:
    return staff("olga", *OPERATOR_PERMS)


@pytest.fixture
def viewer() -> Client:
    """Staff who may look at tasks but not act on them."""
    return staff("victor", "view_task", "view_taskevent", "view_schedulecfg", "view_workerprocess")


def claim(task_type: str = T, worker_id: str = "host-a:1:w") -> list:
    return claim_batch(configs.get(task_type), 100, worker_id)


def finish(task: Task, outcome: Outcome, error: str = "") -> None:
    """Run one attempt of `task` that ends with `outcome` (other due tasks of its type are handed back)."""
    held = claim(task.task_type)
    reports = [Report(t, outcome if t.id == task.id else Outcome.HANDBACK, error=error) for t in held]
    assert task.id in {r.task.id for r in finish_attempts(reports)}


def shown(response) -> set[int]:  # noqa: ANN001
    return {t.pk for t in response.context["cl"].result_list}


def operate_url(action: str, *ids: int, **extra: str) -> str:
    query = [("_selected_action", i) for i in ids] + list(extra.items())
    return f"/admin/taskflow/task/operate/{action}/?{urlencode(query)}"


def confirm(client: Client, action: str, ids: list[int] | None = None, *, filters: str = "", **form: str):  # noqa: ANN201
    """POST the confirmation page of `action` for these ids (or every task matching `filters`)."""
    data: dict[str, object] = {"select_across": "0" if ids is not None else "1", "_changelist_filters": filters}
    if ids is not None:
        data["_selected_action"] = ids
    return client.post(f"/admin/taskflow/task/operate/{action}/", {**data, **form, "_confirm": "1"})


def messages_of(client: Client, response) -> list[str]:  # noqa: ANN001
    page = client.get(response["Location"])
    return [str(m) for m in page.context["messages"]]


def events(task: Task) -> list[tuple[str, str, str]]:
    return list(TaskEvent.objects.filter(task_id=task.pk).order_by("id").values_list("action", "actor", "reason"))


# -- who may do what ------------------------------------------------------------------------------------


def test_staff_without_operate_task_see_no_actions_and_get_403_on_every_forged_action(viewer: Client) -> None:
    task = taskflow.enqueue(T, {})
    listing_page = viewer.get(LIST)
    assert listing_page.status_code == 200 and shown(listing_page) == {task.pk}
    assert listing_page.context["action_form"] is None
    assert b"action-checkbox" not in listing_page.content
    page = viewer.get(f"{LIST}{task.pk}/change/")
    assert page.status_code == 200 and b"tf-action" not in page.content

    for action, value in [
        ("terminate", {}),
        ("retry_now", {}),
        ("reschedule", {"delay": "60"}),
        ("set_priority", {"priority": "5"}),
        ("set_max_retries", {"max_retries": "1"}),
    ]:
        assert viewer.get(operate_url(action, task.pk)).status_code == 403
        assert confirm(viewer, action, [task.pk], reason="forged", **value).status_code == 403
        forged = viewer.post(LIST, {"action": action, "index": "0", "_selected_action": [task.pk]})
        assert forged.status_code == 403
    task.refresh_from_db()
    assert (task.status, task.priority, task.max_retries) == (Status.PENDING, 0, None)
    assert not TaskEvent.objects.exists()


def test_staff_without_view_task_cannot_see_tasks_or_act() -> None:
    task = taskflow.enqueue(T, {})
    nobody = staff("nina", "operate_task")
    assert nobody.get(LIST).status_code == 403
    assert nobody.get(f"{LIST}{task.pk}/change/").status_code == 403
    assert confirm(nobody, "terminate", [task.pk], reason="r").status_code == 403
    assert Task.objects.get(pk=task.pk).status == Status.PENDING


def test_anonymous_users_are_sent_to_the_login_page() -> None:
    task = taskflow.enqueue(T, {})
    response = Client().post("/admin/taskflow/task/operate/terminate/", {"_selected_action": [task.pk]})
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert Task.objects.get(pk=task.pk).status == Status.PENDING


def test_every_action_form_needs_its_csrf_token() -> None:
    task = taskflow.enqueue(T, {})
    client = Client(enforce_csrf_checks=True)
    user = User.objects.create_superuser("root", "r@example.com", "pw")
    client.force_login(user)
    page = client.get(operate_url("terminate", task.pk))
    assert b"csrfmiddlewaretoken" in page.content
    assert confirm(client, "terminate", [task.pk], reason="no token").status_code == 403
    listing_post = client.post(LIST, {"action": "terminate", "index": "0", "_selected_action": [task.pk]})
    assert listing_post.status_code == 403
    assert Task.objects.get(pk=task.pk).status == Status.PENDING

    token = client.get(LIST).cookies["csrftoken"].value
    ok = client.post(
        "/admin/taskflow/task/operate/terminate/",
        {"_selected_action": [task.pk], "select_across": "0", "reason": "with token", "_confirm": "1"},
        headers={"X-CSRFToken": token},
    )
    assert ok.status_code == 302 and Task.objects.get(pk=task.pk).status == Status.STOPPED


def test_editing_and_pausing_types_needs_change_schedulecfg(viewer: Client) -> None:
    configs.get(T)
    page = viewer.get("/admin/taskflow/schedulecfg/")
    assert page.status_code == 200 and page.context["action_form"] is None
    assert (
        viewer.post(
            "/admin/taskflow/schedulecfg/", {"action": "pause", "index": "0", "_selected_action": [T]}
        ).status_code
        == 403
    )
    assert viewer.post(f"/admin/taskflow/schedulecfg/{T}/change/", {"paused": "on"}).status_code == 403
    assert not ScheduleCfg.objects.get(pk=T).paused


# -- the task list --------------------------------------------------------------------------------------


def test_the_list_shows_each_task_with_a_coloured_status_badge() -> None:
    client = staff("sam", "view_task")
    taskflow.enqueue(T, {}, key="doc-1", version=3, stage="index", priority=7, run_after=600)
    failed = taskflow.enqueue(OTHER, {}, max_retries=0)
    finish(failed, Outcome.ERROR, "boom")

    page = client.get(LIST).content.decode().replace("\xa0", " ")  # timesince's non-breaking spaces
    assert '<span class="tf-badge tf-pending">pending</span>' in page
    assert '<span class="tf-badge tf-failed">failed</span>' in page
    assert "doc-1 @v3" in page and "index" in page and "in 9 minutes" in page
    assert "taskflow/console.css" in page


@pytest.fixture
def mix() -> dict[str, Task]:
    """Tasks that differ in every filtered column."""
    now = timezone.now()
    tasks = {
        "plain": taskflow.enqueue(T, {}),
        "staged": taskflow.enqueue(T, {}, stage="index"),
        "urgent": taskflow.enqueue(OTHER, {}, priority=50),
        "low": taskflow.enqueue(OTHER, {}, priority=-20),
        "keyed": taskflow.enqueue(T, {}, key="order-7", trace_id="trace-abc", user_id="4242"),
    }
    done = taskflow.enqueue("test.fail", {}, max_retries=0)
    finish(done, Outcome.ERROR, "boom")
    tasks["failed"] = done
    running = taskflow.enqueue("test.slow", {})
    claim("test.slow", "host-b:7:w")
    tasks["running"] = running
    old = taskflow.enqueue(T, {})
    Task.objects.filter(pk=old.pk).update(created_at=now - timedelta(days=3))
    tasks["old"] = old
    return tasks


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"status__exact": "failed"}, {"failed"}),
        ({"status__exact": "pending", "task_type": OTHER}, {"urgent", "low"}),
        ({"task_type": "test.fail"}, {"failed"}),
        ({"stage": "index"}, {"staged"}),
        ({"priority_min": "1"}, {"urgent"}),
        ({"priority_max": "-1"}, {"low"}),
        ({"priority_min": "-20", "priority_max": "0", "task_type": OTHER}, {"low"}),
        ({"created_to": "{two_days_ago}"}, {"old"}),
        ({"created_from": "{two_days_ago}", "task_type": "test.slow"}, {"running"}),
        ({"finished_from": "{two_days_ago}"}, {"failed"}),
        ({"worker": "host-b:7:w"}, {"running"}),
        ({"worker": "host-a:1:w"}, set()),
        ({"q": "order-7"}, {"keyed"}),
        ({"q": "trace-abc"}, {"keyed"}),
        ({"q": "4242"}, {"keyed"}),
        ({"q": "{failed_id}"}, {"failed"}),
        ({"q": "nothing-like-this"}, set()),
    ],
)
def test_filters_and_search_select_the_matching_tasks(
    operator: Client, mix: dict[str, Task], query: dict[str, str], expected: set[str]
) -> None:
    two_days_ago = (timezone.now() - timedelta(days=2)).strftime("%Y-%m-%dT%H:%M")
    values = {k: v.format(two_days_ago=two_days_ago, failed_id=mix["failed"].pk) for k, v in query.items()}
    response = operator.get(LIST, values)
    assert response.status_code == 200, response.get("Location")
    assert shown(response) == {mix[name].pk for name in expected}


def test_a_malformed_filter_value_changes_nothing_and_shows_the_whole_list_again(operator: Client) -> None:
    taskflow.enqueue(T, {})
    for bad in ({"priority_min": "high"}, {"created_from": "yesterday"}):
        response = operator.get(LIST, bad)
        assert response.status_code == 302 and response["Location"].endswith("?e=1")


def test_no_list_page_counts_the_whole_table_or_scans_for_distinct_values(operator: Client, mix: dict) -> None:
    pages = [
        {},
        {"status__exact": "pending", "task_type": T},
        {"q": "order-7"},
        {"stage": "index", "priority_min": "1"},
    ]
    for query in pages:
        with CaptureQueriesContext(connection) as queries:
            assert operator.get(LIST, query).status_code == 200
        statements = [q["sql"].upper() for q in queries.captured_queries]
        assert not any("DISTINCT" in s for s in statements)
        counts = [s for s in statements if "COUNT(" in s]
        assert counts and all(f"LIMIT {listing.CAP + 1}" in s for s in counts), counts


def test_a_count_past_the_cap_is_shown_as_a_lower_bound(operator: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listing, "CAP", 3)
    taskflow.enqueue_many([{"task_type": T, "payload": {"n": i}} for i in range(5)])
    page = operator.get(LIST, {"status__exact": "pending"}).content.decode()
    assert "3+" in page and "Select all 3+ tasks matching the filter" in page
    assert "5 tasks" not in page
    few = operator.get(LIST, {"task_type": OTHER}).content.decode()
    assert '<span class="tf-count">0</span>' in few


def test_the_list_reads_no_json_column(operator: Client) -> None:
    taskflow.enqueue(T, {"big": "x" * 1000})
    with CaptureQueriesContext(connection) as queries:
        operator.get(LIST)
    task_table = connection.ops.quote_name(Task._meta.db_table)
    [page_query] = [
        q["sql"] for q in queries.captured_queries if f"FROM {task_table}" in q["sql"] and "COUNT(" not in q["sql"]
    ]
    assert "payload" not in page_query and "schedule_log" not in page_query


# -- the task page --------------------------------------------------------------------------------------


def test_the_task_page_shows_data_attempts_other_versions_and_history(operator: Client) -> None:
    old = taskflow.enqueue(T, {"doc": 1}, key="doc", version=1)
    task = taskflow.enqueue(T, {"doc": 1, "title": "Été"}, key="doc", version=2, context={"step": 2})
    finish(task, Outcome.ERROR, "ValueError: first try")
    taskflow.set_priority([task.pk], priority=9, by="olga", reason="customer waiting")

    page = operator.get(f"{LIST}{task.pk}/change/")
    html = unescape(page.content.decode())
    assert page.status_code == 200
    assert '"title": "Été"' in html and '"step": 2' in html  # readable JSON
    assert "attempt 1 failed, retry in" in html and "ValueError: first try" in html
    attempts = html[html.index('id="tf-attempts"') :]
    assert "host-a:1:w" in attempts and ">error<" in attempts
    versions = html[html.index('id="tf-versions"') :]
    assert f'href="/admin/taskflow/task/{old.pk}/change/"' in versions and "v1" in versions
    history = html[html.index('id="tf-events"') :]
    assert "customer waiting" in history and "olga" in history and "priority: 0 → 9" in history


@pytest.mark.parametrize(
    ("state", "offered"),
    [
        ("due", ["terminate", "reschedule", "set_priority", "set_max_retries"]),
        ("delayed", ["terminate", "retry_now", "reschedule", "set_priority", "set_max_retries"]),
        ("running", ["terminate", "set_priority", "set_max_retries"]),
        ("failed", ["retry_now", "reschedule", "set_priority", "set_max_retries"]),
        ("success", []),
    ],
)
def test_the_task_page_offers_the_actions_that_apply_to_its_status(
    operator: Client, state: str, offered: list[str]
) -> None:
    task = taskflow.enqueue(T, {}, run_after=3600 if state == "delayed" else None, max_retries=0)
    if state == "running":
        claim()
    elif state in ("failed", "success"):
        finish(task, Outcome.ERROR if state == "failed" else Outcome.SUCCESS)
    html = operator.get(f"{LIST}{task.pk}/change/").content.decode()
    assert re.findall(r"tf-action tf-action-(\w+)", html) == offered


# -- actions --------------------------------------------------------------------------------------------

ACTIONS = [
    # action, how the task starts, the new value typed in, what the task looks like afterwards
    ("terminate", "due", {}, lambda t: t.status == Status.STOPPED),
    ("retry_now", "failed", {}, lambda t: t.status == Status.PENDING and t.attempts == 0),
    ("reschedule", "due", {"delay": "3600"}, lambda t: t.run_after > timezone.now() + timedelta(minutes=59)),
    ("set_priority", "due", {"priority": "42"}, lambda t: t.priority == 42),
    ("set_max_retries", "due", {"max_retries": "7"}, lambda t: t.max_retries == 7),
]


def prepared(state: str) -> Task:
    task = taskflow.enqueue(T, {}, max_retries=0)
    if state == "failed":
        finish(task, Outcome.ERROR, "boom")
    return task


@pytest.mark.parametrize(("action", "state", "value", "done"), ACTIONS)
def test_each_action_from_the_task_page_goes_through_its_confirmation(
    operator: Client, action: str, state: str, value: dict, done
) -> None:  # noqa: ANN001
    task = prepared(state)
    page = operator.get(f"{LIST}{task.pk}/change/").content.decode()
    [link] = re.findall(rf'href="([^"]+)" class="tf-action tf-action-{action}"', page)
    confirmation = operator.get(link.replace("&amp;", "&"))
    assert confirmation.status_code == 200
    if not value:
        assert confirmation.context["preview"].changed == 1  # the dry run, before anything changes
    before = Task.objects.filter(pk=task.pk).values().get()

    no_reason = confirm(operator, action, [task.pk], _from_task="1", **value)
    assert no_reason.status_code == 200 and "reason" in no_reason.context["form"].errors
    assert no_reason.context["preview"].changed == 1
    assert Task.objects.filter(pk=task.pk).values().get() == before and not events(task)

    response = confirm(operator, action, [task.pk], _from_task="1", reason="ticket 12", **value)
    assert response.status_code == 302 and response["Location"] == f"{LIST}{task.pk}/change/"
    assert messages_of(operator, response)[0].endswith(": 1 task changed.")
    task.refresh_from_db()
    assert done(task)
    assert events(task) == [(action, "olga", "ticket 12")]


@pytest.mark.parametrize(("action", "state", "value", "done"), ACTIONS)
def test_each_action_on_all_tasks_matching_the_filter(
    operator: Client, action: str, state: str, value: dict, done
) -> None:  # noqa: ANN001
    matching = [prepared(state) for _ in range(3)]
    other_type = taskflow.enqueue(OTHER, {}, max_retries=0)
    if state == "failed":
        finish(other_type, Outcome.ERROR, "boom")
    filters = urlencode({"task_type": T, "status__exact": "failed" if state == "failed" else "pending"})

    # "Select all" on the filtered list posts select_across; the action shows the confirmation page.
    page = operator.post(
        f"{LIST}?{filters}",
        {"action": action, "index": "0", "select_across": "1", "_selected_action": [matching[0].pk]},
    )
    assert page.status_code == 200 and page.context["selected_label"] == "all 3 tasks matching the filter"
    assert ("_changelist_filters", filters) in page.context["hidden_fields"]
    assert ("select_across", "1") in page.context["hidden_fields"]

    response = confirm(operator, action, filters=filters, reason="bulk fix", **value)
    assert response.status_code == 302 and response["Location"] == f"{LIST}?{filters}"
    assert messages_of(operator, response)[0].endswith(": 3 tasks changed.")
    for task in matching:
        task.refresh_from_db()
        assert done(task) and events(task) == [(action, "olga", "bulk fix")]
    assert not events(other_type)


def test_an_action_on_the_selected_rows_touches_only_those(operator: Client) -> None:
    chosen, other = taskflow.enqueue(T, {}), taskflow.enqueue(T, {})
    page = operator.post(
        LIST, {"action": "terminate", "index": "0", "select_across": "0", "_selected_action": [chosen.pk]}
    )
    assert page.status_code == 200 and page.context["selected_label"] == "1 selected task"
    assert page.context["preview"].changed == 1

    response = confirm(operator, "terminate", [chosen.pk], reason="only this one")
    assert response.status_code == 302 and response["Location"] == LIST
    assert Task.objects.get(pk=chosen.pk).status == Status.STOPPED
    assert Task.objects.get(pk=other.pk).status == Status.PENDING


def test_skipped_tasks_are_reported_with_their_reason(operator: Client) -> None:
    pending, done = taskflow.enqueue(T, {}), taskflow.enqueue(T, {})
    finish(done, Outcome.SUCCESS)
    preview = operator.get(operate_url("terminate", pending.pk, done.pk)).context["preview"]
    assert (preview.changed, preview.skipped) == (1, {"already finished": 1})

    response = confirm(operator, "terminate", [pending.pk, done.pk], reason="cleanup")
    assert messages_of(operator, response) == ["Terminate: 1 task changed.", "1 task skipped (already finished: 1)."]


def test_retrying_every_task_of_a_type_leaves_its_running_ones_running(operator: Client) -> None:
    [broken] = [taskflow.enqueue(T, {}, max_retries=0)]
    finish(broken, Outcome.ERROR, "boom")
    running = taskflow.enqueue(T, {})
    [held] = claim()

    response = confirm(operator, "retry_now", filters=urlencode({"task_type": T}), reason="rerun the type")

    assert messages_of(operator, response) == ["Retry now: 1 task changed.", "1 task skipped (running: 1)."]
    assert Task.objects.get(pk=broken.pk).status == Status.PENDING
    running.refresh_from_db()
    assert (running.status, running.lease_token) == (Status.PROCESSING, held.lease_token)


def test_reschedule_takes_a_time_or_a_number_of_seconds(operator: Client) -> None:
    task = taskflow.enqueue(T, {})
    when = timezone.localtime() + timedelta(days=1)
    response = confirm(operator, "reschedule", [task.pk], reason="tomorrow", run_at=when.strftime("%Y-%m-%dT%H:%M:%S"))
    assert response.status_code == 302
    task.refresh_from_db()
    assert abs(task.run_after - when.replace(microsecond=0)) < timedelta(seconds=1)

    for value in (
        {},
        {"run_at": when.strftime("%Y-%m-%dT%H:%M:%S"), "delay": "5"},
        {"delay": "-5"},
        {"delay": "1e300"},
    ):
        refused = confirm(operator, "reschedule", [task.pk], reason="r", **value)
        assert refused.status_code == 200 and refused.context["form"].errors, value
    assert Task.objects.get(pk=task.pk).run_after == task.run_after


@pytest.mark.parametrize(
    ("action", "value", "message"),
    [
        ("set_priority", {"priority": "500"}, "priority must be an integer from -100 to 100"),
        ("set_max_retries", {"max_retries": "-1"}, "max_retries must be an integer from 0"),
        ("set_priority", {"priority": "high"}, "Enter a whole number"),
    ],
)
def test_a_value_the_engine_refuses_is_shown_on_the_form_and_changes_nothing(
    operator: Client, action: str, value: dict, message: str
) -> None:
    task = taskflow.enqueue(T, {})
    before = Task.objects.filter(pk=task.pk).values().get()
    response = confirm(operator, action, [task.pk], reason="typo", **value)
    assert response.status_code == 200 and message in response.content.decode()
    assert Task.objects.filter(pk=task.pk).values().get() == before and not events(task)


def test_preview_shows_the_dry_run_for_the_value_typed_in(operator: Client) -> None:
    same, other = taskflow.enqueue(T, {}, priority=5), taskflow.enqueue(T, {})
    first = operator.get(operate_url("set_priority", same.pk, other.pk))
    assert first.context["preview"] is None and first.context["selected_label"] == "2 selected tasks"
    preview = operator.post(
        "/admin/taskflow/task/operate/set_priority/",
        {"_selected_action": [same.pk, other.pk], "select_across": "0", "priority": "5", "_preview": "1"},
    )
    assert preview.status_code == 200 and not preview.context["form"].errors.keys() - {"reason"}
    assert (preview.context["preview"].changed, preview.context["preview"].skipped) == (1, {"unchanged": 1})
    assert {t.priority for t in Task.objects.all()} == {5, 0}


def test_a_forged_selection_is_a_bad_request(operator: Client) -> None:
    assert operator.get("/admin/taskflow/task/operate/terminate/").status_code == 400
    assert operator.get(operate_url("terminate", "abc")).status_code == 400  # type: ignore[arg-type]
    assert operator.get("/admin/taskflow/task/operate/delete_everything/?_selected_action=1").status_code == 404


# -- task types, workers, events ------------------------------------------------------------------------


def test_types_are_paused_and_resumed_and_link_to_their_tasks() -> None:
    client = staff("tom", "view_schedulecfg", "change_schedulecfg", "view_task")
    taskflow.enqueue(T, {})
    running = taskflow.enqueue(OTHER, {})
    claim(OTHER)
    page = client.get("/admin/taskflow/schedulecfg/").content.decode()
    assert f"/admin/taskflow/task/?task_type={OTHER}&amp;status__exact=processing" in page
    assert f"/admin/taskflow/task/?task_type={T}&amp;status__exact=failed" in page
    row = page[page.index(f">{OTHER}<") :]
    assert re.search(r"status__exact=processing\">1</a>", row)

    response = client.post(
        "/admin/taskflow/schedulecfg/", {"action": "pause", "index": "0", "_selected_action": [T, OTHER]}
    )
    assert response.status_code == 302
    assert set(ScheduleCfg.objects.filter(paused=True).values_list("pk", flat=True)) == {T, OTHER}
    client.post("/admin/taskflow/schedulecfg/", {"action": "resume", "index": "0", "_selected_action": [OTHER]})
    assert set(ScheduleCfg.objects.filter(paused=True).values_list("pk", flat=True)) == {T}
    configs.clear()
    assert configs.get(T).paused and not configs.get(OTHER).paused
    assert Task.objects.get(pk=running.pk).status == Status.PROCESSING  # pausing stops claims, not attempts


def test_a_type_with_tasks_keeps_its_config_row() -> None:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "r@example.com", "pw"))
    taskflow.enqueue(T, {})
    configs.get("test.unused")
    assert client.post(f"/admin/taskflow/schedulecfg/{T}/delete/", {"post": "yes"}).status_code == 403
    assert client.post("/admin/taskflow/schedulecfg/test.unused/delete/", {"post": "yes"}).status_code == 302
    assert set(ScheduleCfg.objects.values_list("pk", flat=True)) == {T}


def test_the_workers_page_shows_which_machine_runs_what(operator: Client) -> None:
    workers.beat("host-a:1:w", "host-a", [T], 8, pid=1)
    workers.beat("host-b:2:w", "host-b", [OTHER], 4, pid=2)
    task = taskflow.enqueue(T, {})
    claim(T, "host-a:1:w")
    page = operator.get("/admin/taskflow/workerprocess/").content.decode()
    table = page[page.index('id="result_list"') :]
    row_a = table[table.index("host-a") : table.index("host-b")]
    assert f'href="/admin/taskflow/task/{task.pk}/change/"' in row_a
    assert "/admin/taskflow/task/?worker=host-a%3A1%3Aw" in row_a and "(all 1)" in row_a
    assert "icon-yes" in row_a
    listed = operator.get(LIST, {"worker": "host-a:1:w"})
    assert shown(listed) == {task.pk}


def test_the_event_list_is_read_only_and_filters_by_action_actor_and_task(operator: Client) -> None:
    a, b = taskflow.enqueue(T, {}), taskflow.enqueue(T, {})
    taskflow.set_priority([a.pk], priority=3, by="olga", reason="r1")
    taskflow.terminate([a.pk, b.pk], by="cron", reason="r2")
    url = "/admin/taskflow/taskevent/"

    def ids(query: dict) -> list[tuple[int, str]]:
        response = operator.get(url, query)
        assert response.status_code == 200
        return sorted((e.task_id, e.action) for e in response.context["cl"].result_list)

    assert ids({"action": "set_priority"}) == [(a.pk, "set_priority")]
    assert ids({"actor": "cron"}) == sorted([(a.pk, "terminate"), (b.pk, "terminate")])
    assert ids({"q": str(b.pk)}) == [(b.pk, "terminate")]
    assert ids({"q": "not-an-id"}) == []
    event = TaskEvent.objects.first()
    assert operator.post(f"{url}{event.pk}/change/", {"reason": "rewritten"}).status_code == 403
    assert operator.post(f"{url}{event.pk}/delete/", {"post": "yes"}).status_code == 403
    assert operator.get(f"{url}add/").status_code == 403

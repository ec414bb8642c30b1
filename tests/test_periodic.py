"""Periodic tasks in one process: tick arithmetic, declarations and their sync, firing and catch-up, the console."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.contrib.auth.models import Permission, User
from django.test import override_settings
from django.urls import reverse

from taskflow.conf import setting_problems
from taskflow.engine import periodic
from taskflow.engine.periodic import (
    create_schedule,
    edit_schedule,
    fire_periodic_tasks,
    fire_schedule,
    next_tick,
    run_now,
    schedule_key,
    set_enabled,
    sync_schedules,
    ticks_through,
)
from taskflow.exceptions import InvalidSchedule
from taskflow.models import PeriodicTask, Status, Task

T0 = 1_700_000_000  # 2023-11-14 22:13:20 UTC, a multiple of 10 and of 20


def make(name: str = "beat", *, now: int = T0, **fields: object) -> PeriodicTask:
    fields.setdefault("task_type", "test.noop")
    if "cron" not in fields:
        fields.setdefault("every", 10)
    return create_schedule(PeriodicTask(name=name, **fields), now=now)


def versions(name: str = "beat") -> list[int]:
    return sorted(Task.objects.filter(key=schedule_key(name)).values_list("version", flat=True))


class _Every:
    cron, timezone = "", "UTC"

    def __init__(self, every: int) -> None:
        self.every = every


class _Cron:
    every = None

    def __init__(self, cron: str, timezone: str = "UTC") -> None:
        self.cron, self.timezone = cron, timezone


# --- ticks -------------------------------------------------------------------------------------


def test_every_ticks_at_multiples_of_its_interval_since_the_epoch():
    assert ticks_through(_Every(7), now=100, after=80, limit=10) == [98, 91, 84]
    assert ticks_through(_Every(7), now=100, after=80, limit=2) == [98, 91]
    assert ticks_through(_Every(7), now=98, after=98, limit=10) == []
    assert next_tick(_Every(7), 98) == 105
    assert next_tick(_Every(7), 99) == 105


def test_cron_ticks_include_now_and_exclude_after():
    at = int(datetime(2026, 1, 1, 12, 10, tzinfo=UTC).timestamp())
    assert ticks_through(_Cron("*/5 * * * *"), now=at, after=at - 600, limit=10) == [
        at,
        at - 300,
    ]
    assert next_tick(_Cron("*/5 * * * *"), at) == at + 300


def test_cron_reads_its_time_zone_across_a_daylight_saving_change():
    # 03:00 in Paris is 02:00 UTC in winter and 01:00 UTC in summer (the clocks went forward on 29 March 2026).
    after = int(datetime(2026, 3, 28, 12, tzinfo=UTC).timestamp())
    first = next_tick(_Cron("0 3 * * *", "Europe/Paris"), after)
    second = next_tick(_Cron("0 3 * * *", "Europe/Paris"), first)
    assert datetime.fromtimestamp(first, UTC) == datetime(2026, 3, 29, 1, tzinfo=UTC)
    assert datetime.fromtimestamp(second, UTC) == datetime(2026, 3, 30, 1, tzinfo=UTC)
    assert second - first == 86400


# --- declarations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "wanted"),
    [
        ({"task_type": "x", "cron": "61 * * * *"}, "Not a valid cron expression"),
        ({"task_type": "x", "cron": "* * *"}, "Not a valid cron expression"),
        ({"task_type": "x", "every": 5, "timezone": "Mars/Olympus"}, "Unknown time zone 'Mars/Olympus'"),
        ({"task_type": "x"}, 'Give a cron expression or "every"'),
        ({"task_type": "x", "every": 5, "cron": "* * * * *"}, "not both"),
        ({"task_type": "x", "every": 0}, "every must be a whole number of seconds"),
        ({"task_type": "x", "every": 1.5}, "every must be a whole number of seconds"),
        ({"task_type": "x", "every": 5, "catch_up": -1}, "catch_up must be"),
        ({"task_type": "x", "every": 5, "priority": 1000}, "priority must be"),
        ({"task_type": "x", "every": 5, "payload": {1, 2}}, "JSON"),
        ({"task_type": "x", "every": 5, "when": "now"}, "unknown option(s): when"),
        ({"every": 5}, "needs a task_type"),
        ("every 5", "must be a dict"),
    ],
)
def test_a_bad_declaration_in_settings_is_named_by_the_checks(spec, wanted):
    problems = setting_problems({"PERIODIC": {"nightly": spec}})
    assert len(problems) == 1
    assert problems[0].key == "PERIODIC"
    assert "schedule 'nightly'" in problems[0].message
    assert wanted in problems[0].message


def test_a_bad_schedule_name_and_a_non_dict_are_refused():
    assert "A schedule name is" in setting_problems({"PERIODIC": {"a b": {"task_type": "x", "every": 1}}})[0].message
    assert "must be a dict" in setting_problems({"PERIODIC": ["x"]})[0].message
    assert (
        setting_problems({"PERIODIC": {"ok": {"task_type": "x", "cron": "0 3 * * *", "timezone": "Asia/Tokyo"}}}) == []
    )


PERIODIC = {
    "nightly": {"task_type": "test.noop", "cron": "0 3 * * *", "timezone": "Europe/Paris", "payload": {"n": 1}},
    "often": {"task_type": "test.record", "every": 30, "priority": 5, "catch_up": 3},
}


def _with_periodic(periodic_setting: dict):
    from django.conf import settings

    return override_settings(TASKFLOW={**settings.TASKFLOW, "PERIODIC": periodic_setting})


@pytest.mark.django_db
def test_sync_creates_declared_rows_and_then_leaves_them_alone():
    with _with_periodic(PERIODIC):
        assert sync_schedules(T0) == 2
        nightly, often = PeriodicTask.objects.get(pk="nightly"), PeriodicTask.objects.get(pk="often")
        assert (nightly.source, nightly.cron, nightly.timezone, nightly.payload) == (
            "settings",
            "0 3 * * *",
            "Europe/Paris",
            {"n": 1},
        )
        assert (often.every, often.priority, often.catch_up, often.enabled) == (30, 5, 3, True)
        # The first tick is the first one after the sync.
        assert often.next_run_at == datetime.fromtimestamp(T0 + 10, UTC)  # T0 + 10 is a multiple of 30
        assert sync_schedules(T0 + 100) == 0


@pytest.mark.django_db
def test_console_edits_stand_until_the_declaration_changes_which_then_wins():
    with _with_periodic(PERIODIC):
        sync_schedules(T0)
        edit_schedule("often", {"enabled": False, "every": 60}, now=T0 + 5)
        assert sync_schedules(T0 + 10) == 0
        often = PeriodicTask.objects.get(pk="often")
        assert (often.enabled, often.every, often.next_run_at) == (False, 60, None)

    changed = {**PERIODIC, "often": {**PERIODIC["often"], "every": 45}}
    with _with_periodic(changed):
        assert sync_schedules(T0 + 20) == 1
        often = PeriodicTask.objects.get(pk="often")
        # Every declared field follows the new declaration, enabled included; past ticks are settled.
        assert (often.enabled, often.every, often.priority) == (True, 45, 5)
        assert often.settled_until == T0 + 20
        assert often.next_run_at == datetime.fromtimestamp(next_tick(often, T0 + 20), UTC)


@pytest.mark.django_db
def test_a_schedule_removed_from_the_declarations_is_deleted_but_console_rows_stay():
    make("handmade")
    with _with_periodic(PERIODIC):
        sync_schedules(T0)
    with _with_periodic({"nightly": PERIODIC["nightly"]}):
        assert sync_schedules(T0 + 1) == 1
    assert sorted(PeriodicTask.objects.values_list("name", flat=True)) == ["handmade", "nightly"]


@pytest.mark.django_db
def test_a_console_row_is_taken_over_by_a_declaration_of_the_same_name():
    make("often", every=5)
    with _with_periodic(PERIODIC):
        sync_schedules(T0)
    often = PeriodicTask.objects.get(pk="often")
    assert (often.source, often.every) == ("settings", 30)


@pytest.mark.django_db
def test_schedules_declared_in_code_sync_like_settings_and_may_not_clash_with_them(monkeypatch):
    monkeypatch.setattr(periodic, "_code_declarations", {})
    decl = periodic.periodic("cleanup", task_type="test.noop", every=3600, payload={"days": 7})
    assert periodic.periodic("cleanup", task_type="test.noop", every=3600, payload={"days": 7}) == decl
    with pytest.raises(InvalidSchedule, match="already declared in code"):
        periodic.periodic("cleanup", task_type="test.noop", every=60)
    with pytest.raises(InvalidSchedule, match="Not a valid cron"):
        periodic.periodic("broken", task_type="test.noop", cron="every day")
    with _with_periodic(PERIODIC):
        with pytest.raises(InvalidSchedule, match="already declared in TASKFLOW"):
            periodic.periodic("nightly", task_type="test.noop", every=60)
        assert sync_schedules(T0) == 3
    assert PeriodicTask.objects.get(pk="cleanup").source == "code"


# --- firing ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_each_tick_is_fired_once_with_the_schedule_key_and_the_tick_as_version():
    make(payload={"a": 1}, priority=7)
    assert fire_schedule("beat", T0 + 9) == []  # not due yet
    [task] = fire_schedule("beat", T0 + 10)
    assert (task.task_type, task.key, task.version, task.payload, task.priority) == (
        "test.noop",
        "periodic:beat",
        T0 + 10,
        {"a": 1},
        7,
    )
    assert task.run_after == datetime.fromtimestamp(T0 + 10, UTC)
    assert fire_schedule("beat", T0 + 15) == []  # the same tick again: settled
    row = PeriodicTask.objects.get(pk="beat")
    assert (row.last_task_id, row.last_run_at) == (task.pk, datetime.fromtimestamp(T0 + 10, UTC))
    assert row.next_run_at == datetime.fromtimestamp(T0 + 20, UTC)


@pytest.mark.django_db
def test_a_tick_fired_again_returns_its_task_and_an_older_tick_is_refused(caplog):
    make(every=1)
    [first] = fire_schedule("beat", T0 + 2)
    second = periodic.enqueue("test.noop", key=schedule_key("beat"), version=T0 + 2)
    assert (second.pk, second.enqueue_outcome) == (first.pk, "existing")
    # A row set back (say, restored from a backup) tries the older ticks again: identity refuses them.
    PeriodicTask.objects.filter(pk="beat").update(
        settled_until=T0, next_run_at=datetime.fromtimestamp(T0 + 1, UTC), catch_up=2, last_task_id=None
    )
    assert fire_schedule("beat", T0 + 2) == []
    assert f"tick {T0 + 1} refused" in caplog.text
    [again] = fire_schedule("beat", T0 + 2)
    assert (again.pk, again.enqueue_outcome) == (first.pk, "existing")
    assert versions() == [T0 + 2]


@pytest.mark.django_db
def test_a_failed_tick_is_not_run_again_by_a_later_pass():
    make()
    [task] = fire_schedule("beat", T0 + 10)
    Task.objects.filter(pk=task.pk).update(status=Status.FAILED)
    assert fire_schedule("beat", T0 + 19) == []
    assert Task.objects.get(pk=task.pk).status == Status.FAILED


@pytest.mark.django_db
def test_without_catch_up_the_latest_due_tick_fires_and_supersedes_a_waiting_one():
    make(every=1)
    assert fire_periodic_tasks(T0 + 1) == 1
    assert fire_periodic_tasks(T0 + 1) == 0
    assert fire_periodic_tasks(T0 + 4) == 1  # a slow pass or a hand-over: T0+2 and T0+3 are skipped
    assert versions() == [T0 + 1, T0 + 4]
    older = Task.objects.get(key=schedule_key("beat"), version=T0 + 1)
    assert (older.status, older.status_msg) == (Status.STOPPED, f"superseded by version {T0 + 4}")


@pytest.mark.django_db
@pytest.mark.parametrize("catch_up", [0, 1])
def test_after_downtime_the_default_skips_to_the_latest_tick(catch_up):
    make(catch_up=catch_up)
    assert fire_periodic_tasks(T0 + 105) == 1
    assert versions() == [T0 + 100]
    assert PeriodicTask.objects.get(pk="beat").next_run_at == datetime.fromtimestamp(T0 + 110, UTC)


@pytest.mark.django_db
def test_catch_up_runs_the_latest_n_missed_ticks_one_after_another():
    make(catch_up=3)
    assert fire_periodic_tasks(T0 + 105) == 1
    assert versions() == [T0 + 80]  # the oldest of the latest three; T0+10 ... T0+70 are skipped
    assert fire_periodic_tasks(T0 + 106) == 0  # the next waits while T0+80's task is unfinished
    for expected in ([T0 + 80, T0 + 90], [T0 + 80, T0 + 90, T0 + 100]):
        Task.objects.filter(key=schedule_key("beat")).update(status=Status.SUCCESS)
        assert fire_periodic_tasks(T0 + 107) == 1
        assert versions() == expected
    Task.objects.filter(key=schedule_key("beat")).update(status=Status.SUCCESS)
    assert fire_periodic_tasks(T0 + 108) == 0  # caught up: the next tick is T0+110
    row = PeriodicTask.objects.get(pk="beat")
    assert (row.settled_until, row.next_run_at) == (T0 + 100, datetime.fromtimestamp(T0 + 110, UTC))
    assert not Task.objects.filter(status=Status.STOPPED).exists()  # none superseded another


@pytest.mark.django_db
def test_a_broken_row_is_logged_and_does_not_stop_the_other_schedules(caplog):
    make("broken")
    make("fine")
    PeriodicTask.objects.filter(pk="broken").update(every=None, cron="0 3 * * *", timezone="Nowhere/Land")
    assert fire_periodic_tasks(T0 + 10) == 1
    assert versions("fine") == [T0 + 10]
    assert "periodic broken could not fire" in caplog.text


@pytest.mark.django_db
def test_disabled_schedules_do_not_fire_and_enabling_does_not_fire_the_ticks_missed_meanwhile():
    make(catch_up=5)
    assert set_enabled(["beat"], False, now=T0 + 1) == ["beat"]
    assert set_enabled(["beat"], False, now=T0 + 1) == []
    assert fire_periodic_tasks(T0 + 50) == 0
    assert set_enabled(["beat"], True, now=T0 + 55) == ["beat"]
    assert PeriodicTask.objects.get(pk="beat").next_run_at == datetime.fromtimestamp(T0 + 60, UTC)
    assert fire_periodic_tasks(T0 + 61) == 1
    assert versions() == [T0 + 60]


@pytest.mark.django_db
def test_changing_the_timing_settles_past_ticks_and_other_edits_keep_them():
    make()
    edit_schedule("beat", {"payload": {"v": 2}}, now=T0 + 15)
    assert PeriodicTask.objects.get(pk="beat").settled_until == T0
    edit_schedule("beat", {"every": 20}, now=T0 + 35)
    row = PeriodicTask.objects.get(pk="beat")
    assert (row.settled_until, row.next_run_at) == (T0 + 35, datetime.fromtimestamp(T0 + 40, UTC))
    with pytest.raises(InvalidSchedule):
        edit_schedule("beat", {"settled_until": 0})
    with pytest.raises(InvalidSchedule, match="Unknown time zone") as raised:
        edit_schedule("beat", {"timezone": "Nowhere/Land"})
    assert raised.value.field == "timezone"
    assert PeriodicTask.objects.get(pk="beat").timezone == "UTC"
    assert not edit_schedule("nothing", {"every": 5})


@pytest.mark.django_db
def test_create_schedule_refuses_a_malformed_row():
    with pytest.raises(InvalidSchedule, match="Not a valid cron expression") as raised:
        create_schedule(PeriodicTask(name="bad", task_type="test.noop", cron="*/0 * * * *"))
    assert raised.value.field == "cron"
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
def test_manage_py_check_names_a_bad_schedule():
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    bad = {"nightly": {"task_type": "test.noop", "cron": "0 25 * * *"}}
    with _with_periodic(bad), pytest.raises(SystemCheckError, match=r"taskflow.E004.*schedule 'nightly'.*Bad hour"):
        call_command("check")


@pytest.mark.django_db
def test_run_now_adds_one_run_under_its_own_key_without_touching_the_ticks():
    make()
    first = run_now("beat", now=T0 + 3)
    again = run_now("beat", now=T0 + 3)
    later = run_now("beat", now=T0 + 4)
    assert (first.key, first.version) == ("periodic:beat:manual", T0 + 3)
    assert (again.pk, again.enqueue_outcome) == (first.pk, "existing")
    assert later.pk != first.pk
    row = PeriodicTask.objects.get(pk="beat")
    assert (row.settled_until, row.last_task_id) == (T0, None)
    assert [t.version for t in fire_schedule("beat", T0 + 10)] == [T0 + 10]
    assert periodic.schedule_of(first) == row == periodic.schedule_of(Task.objects.get(version=T0 + 10))


# --- the console -------------------------------------------------------------------------------


SCHEDULE_PERMISSIONS = ("view_periodictask", "change_periodictask", "add_periodictask", "delete_periodictask")


@pytest.fixture
def staff(db, client):
    # add_task too: a schedule's type and payload decide which tasks get made (docs/periodic.md).
    user = User.objects.create_user("op", password="x", is_staff=True)
    for codename in (*SCHEDULE_PERMISSIONS, "add_task"):
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(user)
    return user


def _grant_operate(user: User) -> None:
    user.user_permissions.add(Permission.objects.get(codename="operate_task"))


FORM = {
    "name": "report",
    "enabled": "on",
    "task_type": "test.noop",
    "payload": '{"k": 1}',
    "priority": "0",
    "cron": "*/5 * * * *",
    "every": "",
    "timezone": "Europe/Paris",
    "catch_up": "0",
}


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"cron": "*/5 * *"}, "cron", "Not a valid cron expression"),
        ({"cron": "0 25 * * *"}, "cron", "Not a valid cron expression"),
        ({"timezone": "Europe/Atlantis"}, "timezone", "Unknown time zone"),
        ({"every": "60"}, "cron", "not both"),
        ({"cron": ""}, "every", 'Give a cron expression or "every"'),
        ({"name": "no spaces"}, "name", "A schedule name is"),
        ({"task_type": "1bad"}, "task_type", "task_type must be"),
        ({"priority": "500"}, "priority", "priority must be"),
    ],
)
def test_the_add_form_refuses_a_bad_schedule_with_a_form_error(client, staff, change, field, message):
    response = client.post(reverse("admin:taskflow_periodictask_add"), {**FORM, **change})
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert message in " ".join(errors.get(field, [])), errors
    assert not PeriodicTask.objects.exists()


def test_the_console_adds_edits_enables_and_disables_a_schedule(client, staff):
    response = client.post(reverse("admin:taskflow_periodictask_add"), FORM)
    assert response.status_code == 302, response.content
    row = PeriodicTask.objects.get(pk="report")
    assert (row.source, row.payload, row.enabled) == ("console", {"k": 1}, True)
    assert row.next_run_at is not None

    change = reverse("admin:taskflow_periodictask_change", args=["report"])
    response = client.post(change, {**FORM, "cron": "0 4 * * *"})
    assert response.status_code == 302
    row = PeriodicTask.objects.get(pk="report")
    assert row.cron == "0 4 * * *"
    assert row.next_run_at == datetime.fromtimestamp(next_tick(row, row.settled_until), UTC)
    assert row.next_run_at.astimezone(row.next_run_at.tzinfo).minute == 0

    response = client.post(change, {**FORM, "timezone": "Nowhere/Land"})
    assert "Unknown time zone" in " ".join(response.context["adminform"].form.errors["timezone"])
    assert PeriodicTask.objects.get(pk="report").timezone == "Europe/Paris"

    changelist = reverse("admin:taskflow_periodictask_changelist")
    client.post(changelist, {"action": "disable", "_selected_action": ["report"]})
    assert PeriodicTask.objects.get(pk="report").enabled is False
    assert PeriodicTask.objects.get(pk="report").next_run_at is None
    client.post(changelist, {"action": "enable", "_selected_action": ["report"]})
    assert PeriodicTask.objects.get(pk="report").enabled is True

    page = client.get(changelist)
    assert page.status_code == 200
    assert b"*/5" not in page.content and b"0 4 * * * (Europe/Paris)" in page.content


def test_an_edit_leaves_the_leaders_record_of_fired_ticks_alone(client, staff):
    make("report", every=10)
    change = reverse("admin:taskflow_periodictask_change", args=["report"])
    form = client.get(change).context["adminform"].form
    # The leader fires while the operator has the form open.
    fire_schedule("report", T0 + 10)
    data = {**FORM, "cron": "", "every": "10", "timezone": "UTC", "payload": '{"k": 2}'}
    assert form.initial["every"] == 10
    assert client.post(change, data).status_code == 302
    row = PeriodicTask.objects.get(pk="report")
    assert (row.payload, row.settled_until, row.last_run_at) == (
        {"k": 2},
        T0 + 10,
        datetime.fromtimestamp(T0 + 10, UTC),
    )


def test_what_a_schedule_runs_is_set_only_with_the_right_to_create_tasks(client, db):
    """Adding a schedule, or changing its task type or payload, needs taskflow.add_task; its timing does not."""
    user = User.objects.create_user("scheduler", password="x", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=SCHEDULE_PERMISSIONS))
    client.force_login(user)
    make("report", payload={"k": 1}, task_type="test.noop")
    before = PeriodicTask.objects.values().get(pk="report")

    assert client.get(reverse("admin:taskflow_periodictask_add")).status_code == 403
    assert client.post(reverse("admin:taskflow_periodictask_add"), {**FORM, "name": "other"}).status_code == 403
    assert list(PeriodicTask.objects.values_list("name", flat=True)) == ["report"]

    change = reverse("admin:taskflow_periodictask_change", args=["report"])
    data = {**FORM, "cron": "", "every": "60", "timezone": "UTC", "payload": '{"k": 1}'}
    for field, value in (("task_type", "test.record"), ("payload", '{"k": "chosen by me"}')):
        response = client.post(change, {**data, field: value})
        assert response.status_code == 200
        assert "taskflow.add_task" in " ".join(response.context["adminform"].form.errors[field])
        assert PeriodicTask.objects.values().get(pk="report") == before

    # The schedule's timing is not what it runs: changed with change_periodictask alone.
    response = client.post(change, data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    row = PeriodicTask.objects.get(pk="report")
    assert (row.every, row.task_type, row.payload) == (60, "test.noop", {"k": 1})

    user.user_permissions.add(Permission.objects.get(codename="add_task"))
    assert client.post(change, {**data, "payload": '{"k": 2}'}).status_code == 302
    assert PeriodicTask.objects.get(pk="report").payload == {"k": 2}


def test_run_now_needs_the_operate_permission_and_a_post(client, staff):
    make("report")
    url = reverse("admin:taskflow_periodictask_run_now", args=["report"])
    assert client.post(url).status_code == 403
    assert not Task.objects.exists()
    _grant_operate(staff)
    assert client.get(url).status_code == 405
    page = client.get(reverse("admin:taskflow_periodictask_change", args=["report"]))
    assert b"Run now" in page.content
    response = client.post(url, follow=True)
    [task] = Task.objects.all()
    assert task.key == "periodic:report:manual"
    assert (
        f'enqueued task <a href="{reverse("admin:taskflow_task_change", args=[task.pk])}"' in response.content.decode()
    )


def test_the_schedule_links_its_tasks_and_a_task_page_shows_its_schedule(client, staff, admin_client):
    make("report", payload={"x": 1})
    [task] = fire_schedule("report", T0 + 10)
    page = admin_client.get(reverse("admin:taskflow_periodictask_change", args=["report"])).content.decode()
    assert "q=periodic%3Areport" in page
    assert reverse("admin:taskflow_task_change", args=[task.pk]) in page  # the last run
    listing = admin_client.get(reverse("admin:taskflow_task_changelist"), {"q": "periodic:report"})
    assert [t.pk for t in listing.context["cl"].result_list] == [task.pk]
    task_page = admin_client.get(reverse("admin:taskflow_task_change", args=[task.pk])).content.decode()
    assert 'id="tf-periodic"' in task_page
    assert reverse("admin:taskflow_periodictask_change", args=["report"]) in task_page


def test_a_declared_schedule_cannot_be_deleted_in_the_console(admin_client):
    with _with_periodic(PERIODIC):
        sync_schedules(T0)
    make("handmade")
    assert (
        admin_client.post(reverse("admin:taskflow_periodictask_delete", args=["nightly"]), {"post": "yes"}).status_code
        == 403
    )
    response = admin_client.post(reverse("admin:taskflow_periodictask_delete", args=["handmade"]), {"post": "yes"})
    assert response.status_code == 302
    assert sorted(PeriodicTask.objects.values_list("name", flat=True)) == ["nightly", "often"]


# --- a split brain: two leaders firing the same tick at once ------------------------------------


def test_two_processes_firing_the_same_tick_at_once_make_one_task(transactional_db):
    import threading

    from django.db import connection

    make("race", every=10)
    results: list[list[Task]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def fire() -> None:
        try:
            start.wait()
            results.append(fire_schedule("race", T0 + 10))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=fire) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    fired = [task for tasks in results for task in tasks]
    # The row lock (SQLite: the write lock) lets one firing through; the others find the tick settled.
    assert [t.enqueue_outcome for t in fired] == ["created"]
    assert versions("race") == [T0 + 10]

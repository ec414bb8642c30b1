"""Table rolling: moves into history tables, table limits, retention, get_task, identity, retry_now, schema sync."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from django.utils import timezone

import taskflow
from taskflow.engine import rolling, sql
from taskflow.exceptions import StaleVersion
from taskflow.models import SchedulePos, Status, Task, TaskEvent

T = "test.noop"
pytestmark = pytest.mark.django_db(transaction=True)
DAY = timedelta(days=1)


def roll_settings(**values: object) -> override_settings:
    return override_settings(TASKFLOW={**get_settings_dict(), **values})


def get_settings_dict() -> dict:
    from django.conf import settings

    return dict(settings.TASKFLOW)


def finished(count: int, *, ago: timedelta = 2 * DAY, status: str = Status.SUCCESS, **options: object) -> list[Task]:
    """`count` tasks that finished `ago` (the state a worker's report leaves; set directly for speed)."""
    tasks = [taskflow.enqueue(T, {"n": i}, **options) for i in range(count)]
    when = timezone.now() - ago
    Task.objects.filter(pk__in=[t.pk for t in tasks]).update(status=status, finished_at=when, attempts=1)
    return tasks


def tables() -> set[str]:
    with connection.cursor() as cursor:
        return {t for t in connection.introspection.table_names(cursor) if t.startswith(sql.task_table() + "_")}


def history_ids(position: int) -> set[int]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM {sql.quote(rolling.history_table(position))}")
        return {row[0] for row in cursor.fetchall()}


def where(task_id: int) -> list[str]:
    """Every table holding `task_id` (exactly one, unless something went wrong)."""
    out = [sql.task_table()] if Task.objects.filter(pk=task_id).exists() else []
    return out + [rolling.history_table(p.position) for p in rolling.kept() if task_id in history_ids(p.position)]


@pytest.fixture(autouse=True)
def _no_history_tables() -> None:
    """History tables are not Django's: a flush between tests leaves them; drop them instead."""
    yield
    for table in tables():
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TABLE {sql.quote(table)}")


def test_roll_moves_only_old_finished_tasks_and_records_the_table() -> None:
    old = finished(3)
    old_failed = finished(2, status=Status.FAILED)
    recent = finished(2, ago=timedelta(hours=1))
    live = [taskflow.enqueue(T, {}), taskflow.enqueue(T, {}, run_after=-3 * 86400)]

    result = rolling.roll(pause=0)

    assert (result.moved, result.started, result.dropped) == (5, [rolling.history_table(1)], [])
    assert history_ids(1) == {t.id for t in old + old_failed}
    assert set(Task.objects.values_list("id", flat=True)) == {t.id for t in recent + live}
    [pos] = SchedulePos.objects.all()
    moved = [t.id for t in old + old_failed]
    assert (pos.position, pos.row_count, pos.min_id, pos.max_id) == (1, 5, min(moved), max(moved))
    assert pos.newest_finished_at is not None and pos.dropped_at is None
    assert rolling.roll(pause=0).moved == 0  # nothing left to move, and no table started for nothing
    assert SchedulePos.objects.count() == 1


def test_get_task_finds_a_task_wherever_it_lives_and_refuses_to_save_a_history_copy() -> None:
    [gone] = finished(1)
    [hot] = finished(1, ago=timedelta(minutes=1))
    rolling.roll(pause=0)

    found = taskflow.get_task(gone.id)
    assert (found.id, found.payload, found.status, found.history_position) == (gone.id, {"n": 0}, "success", 1)
    assert not hasattr(taskflow.get_task(hot.id), "history_position")
    with pytest.raises(ValueError, match="read-only"):
        found.save()
    assert where(gone.id) == [rolling.history_table(1)]
    for missing in (hot.id + 1, 12345, "nope"):
        with pytest.raises(Task.DoesNotExist):
            taskflow.get_task(missing)


def test_a_table_never_holds_more_than_roll_max_rows() -> None:
    tasks = finished(7)
    with roll_settings(ROLL_MAX_ROWS=3, ROLL_BATCH=2):
        result = rolling.roll(pause=0)
    assert result.moved == 7
    assert [(p.position, p.row_count) for p in rolling.kept()] == [(1, 3), (2, 3), (3, 1)]
    assert set().union(*(history_ids(p) for p in (1, 2, 3))) == {t.id for t in tasks}
    for task in tasks:
        assert len(where(task.id)) == 1 and taskflow.get_task(task.id).id == task.id


def test_an_old_table_is_closed_and_the_next_one_started() -> None:
    finished(2)
    rolling.roll(pause=0)
    finished(1)
    rolling.roll(now=timezone.now() + timedelta(hours=25), pause=0)
    assert [(p.position, p.row_count) for p in rolling.kept()] == [(1, 2), (2, 1)]


def test_retention_drops_whole_tables_and_their_tasks_are_gone() -> None:
    first = finished(2, ago=40 * DAY)
    second = finished(1, ago=5 * DAY)
    with roll_settings(ROLL_MAX_ROWS=2):
        rolling.roll(now=timezone.now() - 15 * DAY, pause=0)  # only the first two were old enough then
    assert tables() == {rolling.history_table(1)} and history_ids(1) == {t.id for t in first}

    result = rolling.roll(pause=0)  # ROLL_RETENTION_DAYS is 30: table 1's newest task finished 40 days ago

    assert (result.dropped, result.started, result.moved) == ([rolling.history_table(1)], [rolling.history_table(2)], 1)
    assert tables() == {rolling.history_table(2)}
    assert SchedulePos.objects.get(position=1).dropped_at is not None  # kept, so position 1 is never reused
    with pytest.raises(Task.DoesNotExist):
        taskflow.get_task(first[0].id)
    assert taskflow.get_task(second[0].id).history_position == 2
    # A later table gets a new number.
    finished(1)
    with roll_settings(ROLL_MAX_ROWS=1):
        assert rolling.roll(pause=0).started == [rolling.history_table(3)]


def test_a_drop_interrupted_after_marking_is_finished_by_the_next_run() -> None:
    finished(1, ago=40 * DAY)
    rolling.roll(pause=0)
    SchedulePos.objects.filter(position=1).update(dropped_at=timezone.now())  # the crash: marked, not dropped
    assert rolling.history_table(1) in tables()
    assert rolling.roll(pause=0).dropped == [rolling.history_table(1)]
    assert tables() == set()


def test_a_table_recorded_but_not_created_is_created_by_the_next_run() -> None:
    now = timezone.now()
    SchedulePos.objects.create(position=1, started_at=now, updated_at=now)  # the crash: recorded, no table
    tasks = finished(2)
    assert rolling.roll(pause=0).moved == 2
    assert history_ids(1) == {t.id for t in tasks}


def test_a_batch_failing_between_copy_and_delete_leaves_every_task_in_one_table(monkeypatch) -> None:  # noqa: ANN001
    tasks = finished(3)

    def broken(table: str, ids: list[int]) -> int:
        raise RuntimeError("killed between copy and delete")

    monkeypatch.setattr(sql, "delete_tasks", broken)
    with pytest.raises(RuntimeError):
        rolling.roll(pause=0)
    monkeypatch.undo()
    assert all(where(t.id) == [sql.task_table()] for t in tasks)
    assert SchedulePos.objects.get(position=1).row_count == 0
    assert rolling.roll(pause=0).moved == 3
    assert all(where(t.id) == [rolling.history_table(1)] for t in tasks)


def test_dry_run_reports_and_changes_nothing() -> None:
    finished(5)
    with roll_settings(ROLL_MAX_ROWS=2):
        rolling.roll(pause=0, batch=2)  # tables 1 and 2 full, table 3 holds 1
    finished(3)
    SchedulePos.objects.filter(position=1).update(newest_finished_at=timezone.now() - 40 * DAY)
    before = (
        list(Task.objects.order_by("id").values()),
        list(SchedulePos.objects.order_by("position").values()),
        tables(),
        {p: history_ids(p) for p in (1, 2, 3)},
    )
    out = StringIO()
    with roll_settings(ROLL_MAX_ROWS=2):
        call_command("taskroll", "--dry-run", stdout=out)
    after = (
        list(Task.objects.order_by("id").values()),
        list(SchedulePos.objects.order_by("position").values()),
        tables(),
        {p: history_ids(p) for p in (1, 2, 3)},
    )
    assert after == before
    t = rolling.history_table
    assert out.getvalue().strip() == f"would move 3 task(s); would start {t(4)}; would drop {t(1)}"
    with roll_settings(ROLL_MAX_ROWS=2):
        result = rolling.roll(pause=0)
    assert (result.moved, result.started, result.dropped) == (3, [t(4)], [t(1)])


def test_identity_holds_across_the_task_table_and_history() -> None:
    [failed] = finished(1, status=Status.FAILED, key="doc", version=3)
    [done] = finished(1, key="report", version=1)
    rolling.roll(pause=0)
    assert where(failed.id) == where(done.id) == [rolling.history_table(1)]

    # A stale version is refused, whether the newer one is live or rolled.
    with pytest.raises(StaleVersion):
        taskflow.enqueue(T, {}, key="doc", version=2)
    # The same version of a success in history is that task, left where it is.
    same = taskflow.enqueue(T, {}, key="report", version=1)
    assert (same.id, same.enqueue_outcome, same.history_position) == (done.id, "existing", 1)
    assert where(done.id) == [rolling.history_table(1)]
    # The same version of a failure in history comes back as a fresh task with its id: no second row.
    again = taskflow.enqueue(T, {"v": 3}, key="doc", version=3)
    assert (again.id, again.enqueue_outcome, again.status) == (failed.id, "replaced", Status.PENDING)
    assert where(failed.id) == [sql.task_table()]
    assert SchedulePos.objects.get(position=1).row_count == 1
    # A newer version is a new task.
    newer = taskflow.enqueue(T, {}, key="report", version=2)
    assert newer.enqueue_outcome == "created" and newer.id != done.id


def test_retry_now_brings_a_history_task_back_live() -> None:
    [failed] = finished(1, status=Status.FAILED)
    [success] = finished(1)
    rolling.roll(pause=0)

    dry = taskflow.retry_now([failed.id, success.id], by="ops", dry_run=True)
    assert (dry.changed, dry.skipped) == (1, {"succeeded": 1})
    assert where(failed.id) == [rolling.history_table(1)]

    result = taskflow.retry_now([failed.id, success.id, 999], by="ops", reason="rolled")

    assert (result.changed, result.skipped) == (1, {"succeeded": 1, "not found": 1})
    task = taskflow.get_task(failed.id)
    assert (task.status, task.attempts, task.finished_at) == (Status.PENDING, 0, None)
    assert not hasattr(task, "history_position") and where(failed.id) == [sql.task_table()]
    assert TaskEvent.objects.get(task_id=failed.id).action == "retry_now"
    # Only the task changed comes back: the success it skipped stays in history.
    assert SchedulePos.objects.get(position=1).row_count == 1 and where(success.id) == [rolling.history_table(1)]


def test_retry_now_from_the_newer_of_two_tables_whose_id_ranges_overlap() -> None:
    """Tables fill by finishing time, not by id: a later table's ids can fall inside an older one's range."""
    first, middle, last = [taskflow.enqueue(T, {"n": i}) for i in range(3)]
    old = timezone.now() - 2 * DAY
    Task.objects.filter(pk__in=[first.id, last.id]).update(status=Status.FAILED, finished_at=old, attempts=1)
    with roll_settings(ROLL_MAX_ROWS=2):
        rolling.roll(pause=0)  # table 1: first and last, so its range covers middle's id
        Task.objects.filter(pk=middle.id).update(status=Status.FAILED, finished_at=old, attempts=1)
        rolling.roll(pause=0)  # table 2: middle
    assert where(middle.id) == [rolling.history_table(2)]

    assert taskflow.retry_now([middle.id], by="ops").changed == 1
    assert where(middle.id) == [sql.task_table()] and taskflow.get_task(middle.id).status == Status.PENDING


def test_migrate_gives_history_tables_the_task_tables_columns() -> None:
    finished(2)
    rolling.roll(pause=0)
    table = rolling.history_table(1)
    with connection.schema_editor() as editor:
        # As if table 1 was made before a migration added superseded_by and after one removed `legacy`.
        editor.execute(f"ALTER TABLE {editor.quote_name(table)} ADD COLUMN {editor.quote_name('legacy')} integer NULL")
        editor.execute(
            editor.sql_delete_column % {"table": editor.quote_name(table), "column": editor.quote_name("superseded_by")}
        )
    assert rolling.schema_drift() == [
        f"history table {table} lacks columns ['superseded_by'] and has extra columns ['legacy']"
    ]
    call_command("migrate", verbosity=0)
    assert rolling.schema_drift() == []
    finished(1)
    assert rolling.roll(pause=0).moved == 1
    assert len(history_ids(1)) == 3


def test_the_watcher_rolls_only_when_enabled() -> None:
    finished(2)
    rolling._next_roll = 0.0
    assert rolling.roll_when_due() == 0  # ROLL_INTERVAL 0: off
    with roll_settings(ROLL_INTERVAL=60):
        assert rolling.roll_when_due() == 2
        finished(1)
        assert rolling.roll_when_due() == 0  # not due again for a minute
    rolling._next_roll = 0.0


def test_a_real_migration_operation_reaches_history_tables_through_post_migrate() -> None:
    from django.db import migrations, models
    from django.db.migrations.loader import MigrationLoader

    finished(2)
    rolling.roll(pause=0)
    table = rolling.history_table(1)
    before = MigrationLoader(connection).project_state()
    after = before.clone()
    add = migrations.AddField("task", "note", models.TextField(default="", blank=True))
    add.state_forwards("taskflow", after)

    def columns() -> set[str]:
        with connection.cursor() as cursor:
            return {c.name for c in connection.introspection.get_table_description(cursor, table)}

    try:
        with connection.schema_editor() as editor:
            add.database_forwards("taskflow", editor, before, after)
        rolling.sync_after_migrate(apps=after.apps)  # what `migrate` sends when it is done
        assert "note" in columns()
        assert len(history_ids(1)) == 2  # the rows stayed
    finally:
        with connection.schema_editor() as editor:
            add.database_backwards("taskflow", editor, after, before)
        rolling.sync_after_migrate(apps=before.apps)  # migrating back removes it again
    assert "note" not in columns()
    assert rolling.schema_drift() == []


def test_a_table_rolling_did_not_make_is_never_written_into_and_the_command_says_so() -> None:
    from django.core.management.base import CommandError

    tasks = finished(2)
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {sql.quote(rolling.history_table(1))} (x integer)")
    with pytest.raises(CommandError, match="exists but SchedulePos does not record it"):
        call_command("taskroll")
    assert all(where(t.id) == [sql.task_table()] for t in tasks) and not SchedulePos.objects.exists()


def test_the_api_and_django_tasks_results_find_a_rolled_task() -> None:
    """Every reader of one task goes through get_task: the API's GET and a django.tasks result."""
    from django.tasks import TaskResultStatus

    from tests.apiclients import Api, api_as, user_with
    from tests.taskapp import djtasks

    result = djtasks.echo.enqueue(7, word="seven")
    Task.objects.filter(pk=int(result.id)).update(
        status=Status.SUCCESS,
        result={"args": [7], "kwargs": {"word": "seven"}},
        finished_at=timezone.now() - 2 * DAY,
        attempts=1,
    )
    rolling.roll(pause=0)
    assert where(int(result.id)) == [rolling.history_table(1)]

    status, body = api_as("producer").get(f"/api/tasks/{result.id}/")
    assert status == 200 and (body["task_id"], body["status"]) == (result.id, "success")

    again = djtasks.echo.get_result(result.id)
    assert again.status == TaskResultStatus.SUCCESSFUL and again.return_value == {
        "args": [7],
        "kwargs": {"word": "seven"},
    }
    assert rolling.drop_expired(timezone.now() + timedelta(days=400)) == [rolling.history_table(1)]
    status, body = Api(user_with("reader", "view_task")).get(f"/api/tasks/{result.id}/")
    assert status == 404 and body["error"] == "not_found"

"""Where rolling meets the other features: every rule finds a task in the hot table or any kept
history table, a dropped table takes its edges and events, a roll never breaks a concurrent lookup;
and two seams of dependencies and operator actions (a released task's due time, the attempts log
across a retry)."""

from __future__ import annotations

from datetime import timedelta
from html import unescape

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings
from django.utils import timezone

import taskflow
from demo.models import Document
from demo.views import task_status
from taskflow.admin.tasks import attempts_log
from taskflow.engine import dependencies, expiry, operations, rolling, sql
from taskflow.engine.attempts import Outcome
from taskflow.engine.configs import configs
from taskflow.engine.dependencies import neighbours
from taskflow.exceptions import InvalidTask
from taskflow.models import ScheduleCfg, SchedulePos, Status, Task, TaskDependency, TaskEvent
from tests.conftest import drop_history_tables, staff
from tests.test_dependencies import finish

T = "test.noop"
pytestmark = pytest.mark.django_db(transaction=True)


def roll_settings(**values: object) -> override_settings:
    return override_settings(TASKFLOW={**settings.TASKFLOW, **values})


@pytest.fixture(autouse=True)
def _no_history_tables() -> None:
    yield
    drop_history_tables()


def age(*tasks: Task, days: float = 2) -> None:
    Task.objects.filter(pk__in=[t.pk for t in tasks]).update(finished_at=timezone.now() - timedelta(days=days))


def roll(*tasks: Task, days: float = 2) -> None:
    """Move these finished tasks (only they are old enough) into a history table."""
    age(*tasks, days=days)
    assert rolling.roll(pause=0).moved == len(tasks)
    assert not Task.objects.filter(pk__in=[t.pk for t in tasks]).exists()


def succeed_without_release(task: Task) -> None:
    """The state a crash between a task's final write and its release leaves: success, edges still open."""
    Task.objects.filter(pk=task.pk).update(status=Status.SUCCESS, finished_at=timezone.now(), attempts=1)


def status(task: Task) -> str:
    return taskflow.get_task(task.pk).status


# -- dependencies find rolled tasks ----------------------------------------------------------------------


def test_a_task_may_depend_on_a_rolled_success() -> None:
    a = taskflow.enqueue(T, {"n": "a"})
    finish(a)
    roll(a)

    b = taskflow.enqueue(T, {"n": "b"}, depends_on=[a.id])

    assert b.status == Status.PENDING
    assert TaskDependency.objects.get(task_id=b.id).outcome == Status.SUCCESS
    with pytest.raises(InvalidTask, match="unknown task id"):  # still refused: a task found nowhere
        taskflow.enqueue(T, {}, depends_on=[a.id + 10**9])


def test_a_failed_dependent_whose_dependency_rolled_can_be_retried() -> None:
    a = taskflow.enqueue(T, {"n": "a"})
    b = taskflow.enqueue(T, {"n": "b"}, depends_on=[a.id])
    finish(a)
    finish(b, Outcome.FAIL)
    roll(a)

    assert operations.retry_now([b.id], by="ops", dry_run=True).changed == 1
    result = operations.retry_now([b.id], by="ops")

    assert (result.changed, result.skipped) == (1, {})
    assert status(b) == Status.PENDING


def test_the_repair_reads_a_rolled_dependency_as_it_finished() -> None:
    a = taskflow.enqueue(T, {"n": "a"})
    b = taskflow.enqueue(T, {"n": "b"}, depends_on=[a.id])
    succeed_without_release(a)
    roll(a)

    assert dependencies.repair_waiting() == 1

    assert status(b) == Status.PENDING
    assert TaskDependency.objects.get(task_id=b.id).outcome == Status.SUCCESS


def test_a_release_reads_a_rolled_dependency_as_it_finished() -> None:
    first, second = taskflow.enqueue(T, {"n": 1}), taskflow.enqueue(T, {"n": 2})
    b = taskflow.enqueue(T, {"n": "b"}, depends_on=[first.id, second.id])
    succeed_without_release(first)
    roll(first)

    finish(second)  # its release decides b, reading `first`'s open edge too

    assert status(b) == Status.PENDING


def test_the_console_shows_a_rolled_dependency_with_its_status() -> None:
    a = taskflow.enqueue(T, {"n": "a"})
    b = taskflow.enqueue(T, {"n": "b"}, depends_on=[a.id])
    finish(a)
    roll(a)

    [shown] = neighbours(b.id)["dependencies"]

    assert (shown["id"], shown["status"], shown["task_type"]) == (a.id, Status.SUCCESS, T)


# -- operator operations and the example pages find rolled tasks -----------------------------------------


def test_every_operation_finds_a_rolled_task_and_brings_back_only_what_it_changes() -> None:
    failed = [taskflow.enqueue(T, {"n": i}) for i in range(3)]
    done = taskflow.enqueue(T, {"n": "done"})
    for task in failed:
        finish(task, Outcome.FAIL)
    finish(done)
    roll(*failed, done)

    skipped = operations.terminate([failed[0].id, done.id], by="ops")
    assert (skipped.changed, skipped.skipped) == (0, {"already finished": 2})
    assert operations.reschedule([failed[0].id], run_after=60, by="ops", dry_run=True).changed == 1
    assert operations.reschedule([failed[0].id], run_after=60, by="ops").changed == 1
    assert operations.set_max_retries([failed[1].id, done.id], max_retries=7, by="ops").skipped == {"succeeded": 1}
    assert operations.set_priority([failed[2].id], priority=5, by="ops").changed == 1

    hot = {t.id: t for t in Task.objects.filter(pk__in=[t.pk for t in failed])}
    assert hot[failed[0].id].status == Status.PENDING and hot[failed[0].id].run_after > timezone.now()
    assert (hot[failed[1].id].status, hot[failed[1].id].max_retries) == (Status.FAILED, 7)
    assert hot[failed[2].id].priority == 5
    assert getattr(taskflow.get_task(done.id), "history_position", None) == 1  # skipped: left in history
    assert TaskEvent.objects.filter(task_id__in=[t.id for t in failed]).count() == 3


def test_the_example_page_shows_a_rolled_task() -> None:
    document = Document.objects.create(name="Rolled", pages=1)
    task = taskflow.enqueue(T, {"document": document.pk})
    Document.objects.filter(pk=document.pk).update(task_id=task.id)
    finish(task)
    roll(task)

    shown = task_status(Document.objects.get(pk=document.pk))

    assert (shown["status"], shown["id"], shown["done"]) == (Status.SUCCESS, str(task.id), True)


# -- a dropped history table takes its edges and events --------------------------------------------------


def test_dropping_a_history_table_takes_its_tasks_edges_and_events() -> None:
    a = taskflow.enqueue(T, {"n": "a"})
    b = taskflow.enqueue(T, {"n": "b"}, depends_on=[a.id])
    keep = taskflow.enqueue(T, {"n": "keep"})
    keeps_edge = taskflow.enqueue(T, {"n": "other"}, depends_on=[keep.id])
    finish(a)
    finish(b, Outcome.FAIL)
    operations.set_max_retries([b.id], max_retries=3, by="ops")
    with roll_settings(ROLL_MAX_ROWS=2):
        roll(a, b, days=40)
    assert TaskEvent.objects.filter(task_id=b.id).exists()

    with roll_settings(ROLL_RETENTION_DAYS=30):
        assert rolling.drop_expired() == [rolling.history_table(1)]

    assert not TaskDependency.objects.filter(task_id__in=[a.id, b.id]).exists()
    assert not TaskEvent.objects.filter(task_id__in=[a.id, b.id]).exists()
    assert TaskDependency.objects.filter(task_id=keeps_edge.id).exists()  # other tasks' edges stay


def test_a_dependent_of_a_task_in_a_dropped_table_is_settled_first_then_its_edge_goes() -> None:
    """Its edge is resolved before the drop (the repair's job, done then); then it goes with the table."""
    a, other = taskflow.enqueue(T, {"n": "a"}), taskflow.enqueue(T, {"n": "other"})
    b = taskflow.enqueue(T, {"n": "b"}, depends_on=[a.id, other.id])
    succeed_without_release(a)  # and the repair never ran since
    roll(a, days=40)

    with roll_settings(ROLL_RETENTION_DAYS=30):
        assert rolling.drop_expired() == [rolling.history_table(1)]

    assert not TaskDependency.objects.filter(depends_on_id=a.id).exists()
    assert status(b) == Status.WAITING  # for `other`: `a` succeeded, settled before the drop
    finish(other)
    assert status(b) == Status.PENDING
    finish(b, Outcome.FAIL)
    assert operations.retry_now([b.id], by="ops").changed == 1  # `a` is gone, and holds nothing back


# -- a roll never breaks a concurrent lookup -------------------------------------------------------------


def test_a_keyed_enqueue_between_recording_a_new_table_and_creating_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A roll records the next table in SchedulePos before it creates it; a lookup in between must not see it."""
    first = taskflow.enqueue(T, {}, key="report", version=1)
    finish(first)
    roll(first)
    second = taskflow.enqueue(T, {"n": 2})
    finish(second)
    age(second)
    seen = []
    create_table = rolling.sync_table

    def enqueue_then_create(position: int, *args: object) -> list[str]:
        if position == 2:  # recorded, not created yet: what a concurrent enqueue can meet
            assert SchedulePos.objects.filter(position=2).exists()
            seen.append(taskflow.enqueue(T, {}, key="report", version=1))
            seen.append(rolling.versions_in_history(T, "report", 10))
            seen.append(taskflow.enqueue(T, {}, key="report", version=2))
        return create_table(position, *args)

    monkeypatch.setattr(rolling, "sync_table", enqueue_then_create)
    with roll_settings(ROLL_MAX_ROWS=1):
        assert rolling.roll(pause=0).started == [rolling.history_table(2)]

    same, versions, newer = seen
    assert newer.enqueue_outcome == "created" and newer.version == 2
    assert (same.id, same.enqueue_outcome) == (first.id, "existing")
    assert [v.id for v in versions] == [first.id]


def test_a_table_dropped_under_a_readers_snapshot_is_left_out() -> None:
    """A reader whose snapshot predates the drop's mark (MySQL's repeatable read) still lists the table."""
    first = taskflow.enqueue(T, {}, key="report", version=1)
    finish(first)
    roll(first)
    with connection.cursor() as cursor:  # dropped, while SchedulePos still says kept to this reader
        cursor.execute(f"DROP TABLE {sql.quote(rolling.history_table(1))}")

    newer = taskflow.enqueue(T, {}, key="report", version=2)

    assert newer.enqueue_outcome == "created"
    assert rolling.versions_in_history(T, "report", 10) == []
    with pytest.raises(Task.DoesNotExist):
        taskflow.get_task(first.id)


# -- a released task is due from its release ------------------------------------------------------------


def test_a_released_dependent_is_due_and_times_out_from_its_release() -> None:
    configs.get(T), configs.get("test.record")
    ScheduleCfg.objects.filter(task_type="test.record").update(pending_timeout=60, priority_aging=1.0)
    configs.clear()
    a = taskflow.enqueue(T, {})
    b = taskflow.enqueue("test.record", {}, depends_on=[a.id], priority=10)
    later = taskflow.enqueue("test.record", {}, depends_on=[a.id], run_after=3600)
    back = timezone.now() - timedelta(seconds=120)  # b has waited two minutes, longer than its pending timeout
    Task.objects.filter(pk=b.pk).update(run_after=back, order_time=back, created_at=back)
    released_at = timezone.now()

    finish(a)
    expiry.fail_stale_pending()  # taskwatch's next pass

    row = Task.objects.get(pk=b.pk)
    assert row.status == Status.PENDING, row.status_msg
    assert row.run_after >= released_at
    assert row.order_time == row.run_after - timedelta(seconds=10)  # priority aging counts from the release too
    kept = Task.objects.get(pk=later.pk)
    assert kept.status == Status.PENDING and kept.run_after > timezone.now() + timedelta(minutes=59)


# -- the attempts log across a retry ---------------------------------------------------------------------


def test_the_attempts_log_marks_where_an_operator_retried_the_task() -> None:
    task = taskflow.enqueue(T, {}, max_retries=0)
    finish(task, Outcome.ERROR, "first run")
    operations.retry_now([task.id], by="olga", reason="fixed the config")
    finish(task, Outcome.ERROR, "second run")

    rows = attempts_log(Task.objects.get(pk=task.pk))

    assert [(r["kind"], r.get("attempt"), r.get("error")) for r in rows] == [
        ("attempt", 1, "second run"),
        ("revival", None, None),
        ("attempt", 1, "first run"),
    ]
    assert (rows[1]["by"], rows[1]["was"], rows[1]["reason"]) == ("olga", Status.FAILED, "fixed the config")
    page = staff("victor", "view_task", "view_taskevent").get(f"/admin/taskflow/task/{task.pk}/change/")
    html = unescape(page.content.decode())
    start = html.index('id="tf-attempts"')
    attempts = html[start : html.index("</fieldset>", start)]
    assert "retry now by olga" in attempts and "(was failed): fixed the config" in attempts
    assert attempts.index("second run") < attempts.index("retry now by olga") < attempts.index("first run")

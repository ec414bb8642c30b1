"""The operator's command line (`manage.py taskflow`): reads against real rows, operations against the engine's own."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

import taskflow
from taskflow.engine import operations, pausing, stats, workers
from taskflow.engine.attempts import Outcome, Report
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.management.commands.taskflow import Command
from taskflow.models import ScheduleCfg, Status, Task, TaskEvent, WorkerProcess
from tests.conftest import REPO, staff

pytestmark = pytest.mark.django_db

T = "test.noop"
OTHER = "test.record"


def cli(*args: str) -> tuple[int, str, str]:
    """Run `manage.py taskflow <args>` in this process: (exit status, stdout, stderr or the error's one line)."""
    out, err = StringIO(), StringIO()
    command = Command()
    try:
        call_command(command, *args, stdout=out, stderr=err)
    except CommandError as exc:
        return exc.returncode, out.getvalue(), str(exc)
    return command.exit_status, out.getvalue(), err.getvalue()


def cli_json(*args: str) -> Any:
    status, out, err = cli(*args, "--json")
    assert status in (0, 1), err
    return json.loads(out)


def claim(task_type: str, worker_id: str = "host-a:1:w") -> list:
    return claim_batch(configs.get(task_type), 100, worker_id)


def finish(task: Task, outcome: Outcome, error: str = "") -> None:
    """Run one attempt of `task` that ends with `outcome` (other due tasks of its type are handed back)."""
    held = claim(task.task_type)
    reports = [Report(t, outcome if t.id == task.id else Outcome.HANDBACK, error=error) for t in held]
    assert task.id in {r.task.id for r in finish_attempts(reports)}


def scene(task_type: str) -> dict[str, int]:
    """One task of `task_type` in each status an operation treats differently, by name -> id."""
    running = taskflow.enqueue(task_type, {"n": "running"})
    claim(task_type, "host-a:1:w")
    failed = taskflow.enqueue(task_type, {"n": "failed"}, max_retries=0)
    finish(failed, Outcome.FAIL, error="boom")
    succeeded = taskflow.enqueue(task_type, {"n": "succeeded"})
    finish(succeeded, Outcome.SUCCESS)
    stopped = taskflow.enqueue(task_type, {"n": "stopped"})
    operations.terminate([stopped.id], by="setup")
    pending = taskflow.enqueue(task_type, {"n": "pending"}, key="k-pending", priority=3)
    delayed = taskflow.enqueue(task_type, {"n": "delayed"}, run_after=3600, priority=-2)
    waiting = taskflow.enqueue(task_type, {"n": "waiting"}, depends_on=[delayed.id])
    return {
        "running": running.id,
        "failed": failed.id,
        "succeeded": succeeded.id,
        "stopped": stopped.id,
        "pending": pending.id,
        "delayed": delayed.id,
        "waiting": waiting.id,
    }


# -- list --------------------------------------------------------------------------------------------


def test_list_shows_matching_tasks_newest_first_as_a_table_and_as_json() -> None:
    ids = scene(T)
    other = taskflow.enqueue(OTHER, {"n": 1}, key="k-other")

    rows = cli_json("list")
    assert [r["id"] for r in rows] == sorted([*ids.values(), other.id], reverse=True)
    row = next(r for r in rows if r["id"] == ids["pending"])
    assert (row["task_type"], row["key"], row["version"], row["status"], row["priority"]) == (
        T,
        "k-pending",
        0,
        "pending",
        3,
    )
    assert "payload" not in row  # the list never reads the JSON columns

    status, out, _ = cli("list", "--type", T, "--status", "failed,stopped")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "TYPE", "KEY", "STATUS", "STAGE", "PRIORITY", "ATTEMPTS", "DUE", "WORKER", "AGE"]
    assert [int(line.split()[0]) for line in lines[1:]] == [ids["stopped"], ids["failed"]]
    assert lines[1].split()[1:4] == [T, "-", "stopped"]
    # Columns line up: every row starts its TYPE where the header does.
    assert {line.index(T) for line in lines[1:]} == {lines[0].index("TYPE")}

    assert [r["id"] for r in cli_json("list", "--key", "k-pending")] == [ids["pending"]]
    assert [r["id"] for r in cli_json("list", "--search", "k-other")] == [other.id]
    assert [r["id"] for r in cli_json("list", "--priority-max", "-1")] == [ids["delayed"]]
    assert [r["id"] for r in cli_json("list", "--worker", "host-a:1:w")] == [ids["running"]]
    assert [r["id"] for r in cli_json("list", "--finished-from", "1h", "--type", T)] == sorted(
        [ids["failed"], ids["succeeded"], ids["stopped"]], reverse=True
    )
    assert cli_json("list", "--created-to", "1d") == []
    assert [r["id"] for r in cli_json("list", str(ids["waiting"]), str(other.id), "--type", T)] == [ids["waiting"]]
    oldest = cli_json("list", "--order", "oldest", "--limit", "2")
    assert [r["id"] for r in oldest] == sorted(ids.values())[:2]

    status, out, _ = cli("list", "--limit", "3")
    assert status == 0 and "more match" in out.splitlines()[-1]


def test_list_matches_what_the_console_lists_for_the_same_filter() -> None:
    scene(T)
    scene(OTHER)
    client = staff("olga", "view_task")
    for query, args in (
        ({"task_type": OTHER, "status__exact": "pending"}, ["--type", OTHER, "--status", "pending"]),
        ({"priority_min": "1"}, ["--priority-min", "1"]),
        (
            {"finished_from": (timezone.localtime() - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")},
            ["--finished-from", "1h"],
        ),
        ({"q": "k-pending"}, ["--search", "k-pending"]),
        ({"worker": "host-a:1:w"}, ["--worker", "host-a:1:w"]),
    ):
        console = client.get("/admin/taskflow/task/", query).context["cl"].result_list
        assert [r["id"] for r in cli_json("list", *args)] == [t.pk for t in console], query


def test_search_by_payload_value_as_the_console_does(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = scene(T)
    scene(OTHER)
    typed = taskflow.enqueue(T, {"n": 42})
    quoted = taskflow.enqueue(T, {"n": "42"})
    assert [r["id"] for r in cli_json("list", "--type", T, "--search", 'payload.n = "pending"')] == [ids["pending"]]
    # The JSON type counts, as in the console: 42 is not "42".
    assert [r["id"] for r in cli_json("list", "--search", "payload.n = 42")] == [typed.id]
    assert [r["id"] for r in cli_json("list", "--search", 'payload.n = "42"')] == [quoted.id]
    client = staff("pia", "view_task")
    console = client.get("/admin/taskflow/task/", {"q": "payload.n = pending"}).context["cl"].result_list
    assert [r["id"] for r in cli_json("list", "--search", "payload.n = pending")] == [t.pk for t in console]

    # An operation selects by it too, and changes only what it matched.
    status, out, _ = cli("terminate", "--search", "payload.n = delayed", "--type", T, "--reason", "by payload")
    assert status == 0, out
    assert Task.objects.get(pk=ids["delayed"]).status == Status.STOPPED
    assert Task.objects.filter(task_type=OTHER, status=Status.STOPPED).count() == 1  # its own scene's only

    # The bound is said on stderr, so --json stays one document.
    monkeypatch.setattr("taskflow.engine.payload_search.SCAN_LIMIT", 2)
    status, out, err = cli("list", "--search", "payload.n = pending", "--json")
    assert (status, json.loads(out)) == (1, [])  # the pending task is older than the newest two
    assert f"ids from {typed.id}" in err and "newest 2 tasks" in err  # the newest two: typed, quoted


def test_a_malformed_payload_search_is_one_line_and_exit_2() -> None:
    scene(T)
    before = sorted(Task.objects.values_list("id", "status"))
    for term in ("payload.n", "payload.a__b = 1", "payload. = 1", "payload.n = [1]"):
        status, out, err = cli("terminate", "--search", term)
        assert status == 2 and out == "" and "\n" not in err.strip() and "--search:" in err, (term, err)
    assert sorted(Task.objects.values_list("id", "status")) == before


def test_list_says_when_nothing_matches_with_status_1() -> None:
    scene(T)
    assert cli("list", "--status", "processing", "--type", OTHER)[0] == 2  # unknown type: OTHER has no config yet
    status, out, _ = cli("list", "--status", "waiting", "--priority-min", "50")
    assert (status, out.strip()) == (1, "no task matches")
    assert cli_json("list", "--stage", "nope") == []


# -- status ------------------------------------------------------------------------------------------


def test_status_counts_each_type_and_shows_the_fleet() -> None:
    ids = scene(T)
    taskflow.enqueue(OTHER, {})
    ScheduleCfg.objects.filter(task_type=T).update(concurrency_limit=4)
    pausing.pause([OTHER], by="setup")
    workers.beat("host-a:1:w", "host-a", [T], 8)
    workers.beat("host-b:2:w", "host-b", [T, OTHER], 2)
    WorkerProcess.objects.filter(worker_id="host-b:2:w").update(heartbeat_at=timezone.now() - timedelta(hours=1))
    stats.refresh()

    report = cli_json("status", "--minutes", "10")
    mine = report["types"][T]
    assert mine["counts"] == {
        "waiting": 1,
        "pending": 2,
        "processing": 1,
        "success": 1,
        "failed": 1,
        "stopped": 1,
    }
    assert (mine["in_flight"], mine["limit"], mine["paused"]) == (1, 4, False)
    assert mine["oldest_pending_age_s"] is not None
    assert mine["throughput"] == {"minutes": 10, "completed": 1, "failed": 1, "completed_per_minute": 0.1}
    assert report["types"][OTHER]["paused"] is True
    fleet = report["fleet"]
    assert (fleet["alive"], fleet["silent"], fleet["hosts"], fleet["concurrency"]) == (1, 1, ["host-a"], 8)
    by_id = {w["worker_id"]: w for w in fleet["workers"]}
    assert by_id["host-a:1:w"]["running"] == 1 and by_id["host-a:1:w"]["alive"] is True
    assert by_id["host-b:2:w"]["alive"] is False

    status, out, _ = cli("status")
    assert status == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("TYPE"))
    assert header.split()[:8] == ["TYPE", "STATE", "WAITING", "PENDING", "PROCESSING", "SUCCESS", "FAILED", "STOPPED"]
    row = next(line for line in lines if line.startswith(T + " "))
    assert row.split()[:9] == [T, "active", "1", "2", "1", "1", "1", "1", "1/4"]
    assert next(line for line in lines if line.startswith(OTHER + " ")).split()[1] == "paused"
    assert "Workers: 1 alive on 1 host(s), 8 threads; 1 silent" in out
    assert any(line.startswith("host-a ") and "host-a:1:w" in line for line in lines)
    assert ids  # the scene's tasks are what was counted


# -- show --------------------------------------------------------------------------------------------


def test_show_prints_the_task_page() -> None:
    ids = scene(T)
    failed = Task.objects.get(pk=ids["failed"])
    operations.set_priority([failed.id], priority=9, by="olga", reason="urgent")

    page = cli_json("show", str(failed.id))
    assert page["task"]["id"] == failed.id and page["task"]["payload"] == {"n": "failed"}
    assert page["effective"]["max_retries"] == {"value": 0, "source": "task"}
    assert page["effective"]["timeout"]["source"] == "type default"
    assert page["attempts"][-1]["outcome"] == "fail" and page["attempts"][-1]["error"] == "boom"
    assert page["events"][0]["actor"] == "olga" and page["events"][0]["changes"] == {"priority": [0, 9]}
    assert page["applicable"] == ["retry_now", "reschedule", "set_priority", "set_max_retries"]

    status, out, _ = cli("show", str(failed.id))
    assert status == 0
    assert out.splitlines()[0] == f"Task {failed.id}  {T}  [failed]"
    assert "max retries    0\n" in out
    cfg = ScheduleCfg.objects.get(task_type=T)
    assert f"timeout        {cfg.max_processing_time} s (type default)" in out
    assert "Attempts (newest first)" in out and "boom" in out
    assert "olga" in out and "urgent" in out and '{"priority":[0,9]}' in out
    assert 'Payload\n  {\n    "n": "failed"\n  }' in out

    waiting = cli_json("show", str(ids["waiting"]))
    assert [(d["id"], d["status"]) for d in waiting["dependencies"]] == [(ids["delayed"], "pending")]
    assert "Depends on" in cli("show", str(ids["waiting"]))[1]
    assert cli_json("show", str(ids["delayed"]))["dependents"][0]["id"] == ids["waiting"]

    assert cli("show", "999999") == (1, "", "no task 999999\n")


# -- operations --------------------------------------------------------------------------------------

OPERATIONS = [
    ("terminate", operations.terminate, [], {}),
    ("retry", operations.retry_now, [], {}),
    ("reschedule", operations.reschedule, ["--in", "600"], {"run_after": 600.0}),
    ("priority", operations.set_priority, ["--to", "7"], {"priority": 7}),
    ("max-retries", operations.set_max_retries, ["--to", "5"], {"max_retries": 5}),
]


def state(ids: dict[str, int]) -> dict[str, tuple]:
    """What an operation may change of each task of a scene, by name (times rounded to the minute)."""
    out = {}
    for name, task_id in ids.items():
        t = Task.objects.get(pk=task_id)
        run_after = round((t.run_after - timezone.now()).total_seconds() / 60)
        out[name] = (t.status, t.priority, t.max_retries, t.attempts, t.status_msg, run_after, t.lease_token)
    return out


def audit(ids: dict[str, int]) -> dict[str, list[tuple]]:
    """The TaskEvents of each task of a scene, by name, without times."""
    by_id = {v: k for k, v in ids.items()}
    out: dict[str, list[tuple]] = {name: [] for name in ids}
    for e in TaskEvent.objects.filter(task_id__in=ids.values()).order_by("id"):
        changes = {k: v for k, v in e.changes.items() if k not in ("finished_at", "run_after")}
        out[by_id[e.task_id]].append((e.actor, e.action, e.reason, json.dumps(changes, sort_keys=True)))
    return out


@pytest.mark.parametrize(("name", "engine_function", "value_args", "value"), OPERATIONS)
def test_each_operation_changes_what_the_engine_operation_does_with_the_same_actor_and_audit(
    name: str, engine_function: Any, value_args: list[str], value: dict[str, Any]
) -> None:
    by_engine = scene(T)
    by_cli = scene(OTHER)

    before = (state(by_cli), audit(by_cli))
    status, out, _ = cli(
        name, *map(str, by_cli.values()), *value_args, "--reason", "drill", "--actor", "olga", "--dry-run"
    )
    expected = engine_function(list(by_engine.values()), by="cli:olga", reason="drill", dry_run=True, **value)
    assert out.strip() == f"{expected} (dry run: nothing changed)"
    assert (state(by_cli), audit(by_cli)) == before  # the dry run changed nothing
    assert status == (0 if not expected.skipped else 1)

    result = engine_function(list(by_engine.values()), by="cli:olga", reason="drill", **value)
    status, out, _ = cli(
        name, *map(str, by_cli.values()), *value_args, "--reason", "drill", "--actor", "olga", "--json"
    )
    assert json.loads(out) == {
        "action": engine_function.__name__,
        "dry_run": False,
        "changed": result.changed,
        "skipped": result.skipped,
        "total": 7,
        "actor": "cli:olga",
        "reason": "drill",
    }
    assert result.changed and status == (1 if result.skipped else 0)
    assert state(by_cli) == state(by_engine)
    assert audit(by_cli) == audit(by_engine)
    assert any(actor == "cli:olga" for events in audit(by_cli).values() for actor, *_ in events)


def test_operations_by_filter_and_the_default_actor_is_the_os_user(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = scene(T)
    others = scene(OTHER)
    monkeypatch.setattr("getpass.getuser", lambda: "ops")
    status, out, _ = cli("retry", "--type", T, "--status", "failed,stopped")
    assert (status, out.strip()) == (0, "retry_now: changed 2")
    assert {Task.objects.get(pk=ids[n]).status for n in ("failed", "stopped")} == {Status.PENDING}
    assert Task.objects.get(pk=others["failed"]).status == Status.FAILED  # another type: untouched
    event = TaskEvent.objects.filter(task_id=ids["failed"]).latest("id")
    assert (event.actor, event.action) == ("cli:ops", "retry_now")

    status, out, _ = cli("terminate", "--status", "processing")
    assert status == 0 and out.strip() == "terminate: changed 2"
    assert Task.objects.filter(status=Status.PROCESSING).count() == 0

    # --all: every task (the two pending ones already have priority 3).
    status, out, _ = cli("priority", "--all", "--to", "3", "--dry-run")
    assert (status, out.strip()) == (1, "set_priority: would change 12; skipped 2 unchanged (dry run: nothing changed)")


def test_pause_and_resume_change_what_the_console_changes() -> None:
    taskflow.enqueue(T, {})
    taskflow.enqueue(OTHER, {})
    console = staff("olga", "view_schedulecfg", "change_schedulecfg")

    status, out, _ = cli("pause", T, "--reason", "maintenance", "--actor", "olga", "--dry-run")
    assert (status, out.strip()) == (0, "pause: would change 1 (dry run: nothing changed)")
    assert not ScheduleCfg.objects.get(pk=T).paused and not TaskEvent.objects.exists()

    assert cli("pause", T, "--reason", "maintenance", "--actor", "olga") == (0, "pause: changed 1\n", "")
    console.post("/admin/taskflow/schedulecfg/", {"action": "pause", "index": "0", "_selected_action": [OTHER]})
    assert set(ScheduleCfg.objects.filter(paused=True).values_list("pk", flat=True)) == {T, OTHER}
    events = list(TaskEvent.objects.order_by("id").values_list("task_id", "actor", "action", "reason", "changes"))
    assert events == [
        (None, "cli:olga", "pause", "maintenance", {"task_type": T, "paused": [False, True]}),
        (None, "olga", "pause", "", {"task_type": OTHER, "paused": [False, True]}),
    ]

    status, out, _ = cli("pause", T, OTHER, "--json")
    assert status == 1 and json.loads(out)["skipped"] == {"already paused": 2}
    assert cli("resume", OTHER, "--actor", "olga") == (0, "resume: changed 1\n", "")
    assert not ScheduleCfg.objects.get(pk=OTHER).paused and ScheduleCfg.objects.get(pk=T).paused


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["terminate", "12x"], "not a task id: '12x'"),
        (["terminate", "--status", "done"], "unknown status 'done'"),
        (["terminate", "--type", "nope"], "unknown task type 'nope'"),
        (["terminate", "--created-from", "yesterday"], "not a date and time: 'yesterday'"),
        (["terminate"], "give task ids, a filter (see --help), or --all"),
        (["reschedule", "--all"], "one of the arguments --at --in is required"),
        (["reschedule", "--all", "--at", "2026-13-01"], "not a date and time"),
        (["priority", "--all", "--to", "500"], "priority must be"),
        (["max-retries", "--all", "--to", "-1"], "max_retries must be"),
        (["pause", "nope"], "unknown task type: 'nope'"),
        (["show", "0"], "not a task id: '0'"),
        (["list", "--limit", "0"], "must be 1 or more"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_with_status_2_and_changes_nothing(args: list[str], message: str) -> None:
    ids = scene(T)
    before = state(ids), TaskEvent.objects.count(), list(ScheduleCfg.objects.values_list("pk", "paused"))
    status, out, err = cli(*args)
    assert status == 2 and out == ""
    assert message in err and "\n" not in err.strip()
    assert (state(ids), TaskEvent.objects.count(), list(ScheduleCfg.objects.values_list("pk", "paused"))) == before


@pytest.mark.processes
def test_as_a_process_bad_input_is_one_line_on_stderr_and_status_2(process_env: dict[str, str]) -> None:
    taskflow.enqueue(T, {})

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(REPO / "manage.py"), "taskflow", *args],
            cwd=REPO,
            env=process_env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    for args in (["list", "--status", "done"], ["list", "--type", "nope"], ["terminate", "x"], ["nope"]):
        done = run(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)
    done = run("list", "--status", "stopped")
    assert (done.returncode, done.stdout.strip()) == (1, "no task matches")
    done = run("list", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)[0]["task_type"] == T
    assert run("show", "12345").returncode == 1

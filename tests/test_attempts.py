"""Attempts: the state machine of a finished attempt, heartbeats, and fenced (stale-proof) reports."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.db.models import F
from django.utils import timezone

import taskflow
from taskflow.engine.attempts import ClaimedTask, LeaseLost, Outcome, Report, heartbeat
from taskflow.engine.claiming import claim_batch
from taskflow.engine.configs import configs
from taskflow.engine.finishing import finish_attempts
from taskflow.engine.transitions import MAX_MESSAGE, row_changes
from taskflow.exceptions import NextStage
from taskflow.models import RetryStrategy, ScheduleCfg, Status, Task
from taskflow.runtime.context import TaskContext

T = "test.noop"
NOW = timezone.now()


def policy_cfg(**fields: Any) -> ScheduleCfg:
    """An unsaved config with a fixed 5 s retry delay and no jitter, so delays are exact."""
    values = {
        "task_type": T,
        "retry_strategy": RetryStrategy.FIXED,
        "retry_interval": 5.0,
        "max_retry_interval": 60.0,
        "retry_jitter": 0.0,
        "priority_aging": 2.0,
        **fields,
    }
    return ScheduleCfg(**values)


def attempt(**fields: Any) -> ClaimedTask:
    """A ClaimedTask as claim_batch would hand it out, without the database."""
    values = {
        "id": 1,
        "task_type": T,
        "key": None,
        "version": 0,
        "priority": 3,
        "payload": {},
        "context": {"kept": True},
        "checkpoint": {"at": 4},
        "stage": "",
        "attempt": 2,
        "max_retries": 3,
        "timeout": 60,
        "lease_token": 7,
        "trace_id": "t",
        "schedule_log": [],
        "run_after": NOW - timedelta(minutes=1),
        "worker_id": "w1",
        "claimed_at": NOW - timedelta(seconds=2),
        "lease_expires_at": NOW + timedelta(seconds=58),
        **fields,
    }
    return ClaimedTask(**values)


# -- the state machine (no database) ---------------------------------------------------------------


def test_success_stores_the_result_and_finishes() -> None:
    changes = row_changes(Report(attempt(), Outcome.SUCCESS, result={"ok": 1}, cost_ms=12), policy_cfg(), NOW)
    assert changes["status"] == Status.SUCCESS
    assert (changes["result"], changes["status_msg"], changes["finished_at"]) == ({"ok": 1}, "", NOW)
    assert changes["lease_expires_at"] is None
    assert changes["schedule_log"][0] == {
        "attempt": 2,
        "worker": "w1",
        "started_at": (NOW - timedelta(seconds=2)).isoformat(),
        "cost_ms": 12,
        "outcome": "success",
        "error": "",
    }


def test_an_error_with_retries_left_requeues_after_the_policy_delay() -> None:
    report = Report(attempt(attempt=3, max_retries=3), Outcome.ERROR, error="RuntimeError: x", detail="Traceback...")
    changes = row_changes(report, policy_cfg(), NOW)
    assert changes["status"] == Status.PENDING
    assert changes["run_after"] == NOW + timedelta(seconds=5)
    assert changes["order_time"] == NOW + timedelta(seconds=5 - 3 * 2.0)
    assert "attempt 3 failed, retry in 5.0s: RuntimeError: x" in changes["status_msg"]
    assert "Traceback..." in changes["status_msg"]
    assert "attempts" not in changes  # the attempt stays counted


def test_the_error_after_the_last_retry_fails_the_task() -> None:
    report = Report(attempt(attempt=4, max_retries=3), Outcome.ERROR, error="RuntimeError: x", detail="tb")
    changes = row_changes(report, policy_cfg(), NOW)
    assert changes["status"] == Status.FAILED
    assert changes["status_msg"].startswith("failed after 4 attempts: RuntimeError: x")
    assert changes["finished_at"] == NOW
    no_retries = row_changes(Report(attempt(attempt=1, max_retries=0), Outcome.ERROR, error="e"), policy_cfg(), NOW)
    assert no_retries["status"] == Status.FAILED


def test_a_permanent_failure_ignores_the_retries_left() -> None:
    changes = row_changes(Report(attempt(attempt=1, max_retries=9), Outcome.FAIL, error="bad input"), policy_cfg(), NOW)
    assert (changes["status"], changes["status_msg"]) == (Status.FAILED, "bad input")


def test_a_snooze_gives_the_attempt_back() -> None:
    changes = row_changes(Report(attempt(attempt=2), Outcome.SNOOZE, delay=30, error="busy"), policy_cfg(), NOW)
    assert (changes["status"], changes["attempts"]) == (Status.PENDING, 1)
    assert changes["run_after"] == NOW + timedelta(seconds=30)
    assert changes["status_msg"] == "snoozed 30s busy"
    assert "checkpoint" not in changes  # progress survives the snooze


def test_next_stage_requeues_with_a_fresh_retry_budget() -> None:
    step = NextStage("ship", context={"box": 9}, delay=10, priority=-4)
    changes = row_changes(Report(attempt(attempt=3), Outcome.NEXT_STAGE, next_stage=step), policy_cfg(), NOW)
    assert (changes["status"], changes["stage"], changes["context"]) == (Status.PENDING, "ship", {"box": 9})
    assert (changes["attempts"], changes["checkpoint"], changes["priority"]) == (0, None, -4)
    assert changes["run_after"] == NOW + timedelta(seconds=10)
    assert changes["order_time"] == NOW + timedelta(seconds=10 + 4 * 2.0)
    keep = row_changes(Report(attempt(), Outcome.NEXT_STAGE, next_stage=NextStage("b")), policy_cfg(), NOW)
    assert "context" not in keep and keep["priority"] == 3


def test_a_handback_undoes_the_claim() -> None:
    log = [{"attempt": 1, "outcome": "error"}]
    changes = row_changes(Report(attempt(attempt=2, schedule_log=log), Outcome.HANDBACK), policy_cfg(), NOW)
    assert (changes["status"], changes["attempts"], changes["worker_id"]) == (Status.PENDING, 1, "")
    assert changes["schedule_log"] == log  # it never ran, so it is not history
    assert "run_after" not in changes


def test_the_schedule_log_keeps_the_newest_six_attempts() -> None:
    log = [{"attempt": n} for n in range(6, 0, -1)]
    changes = row_changes(Report(attempt(attempt=7, schedule_log=log), Outcome.SUCCESS), policy_cfg(), NOW)
    assert [e["attempt"] for e in changes["schedule_log"]] == [7, 6, 5, 4, 3, 2]


def test_long_errors_are_truncated() -> None:
    changes = row_changes(Report(attempt(), Outcome.FAIL, error="x" * 10_000, detail="y" * 10_000), policy_cfg(), NOW)
    assert len(changes["status_msg"]) == MAX_MESSAGE
    assert len(changes["schedule_log"][0]["error"]) == 500


# -- heartbeats and fenced reports (database) ------------------------------------------------------


def claim_one(**options: Any) -> ClaimedTask:
    task = taskflow.enqueue(T, {"p": 1}, **options)
    claimed = claim_batch(configs.get(T), 1, "w1")
    assert [c.id for c in claimed] == [task.pk]
    return claimed[0]


def take_away(task_id: int) -> None:
    """What the watcher's rescue does to an attempt it gives up on: back to pending, token bumped."""
    Task.objects.filter(pk=task_id).update(status=Status.PENDING, lease_token=F("lease_token") + 1, worker_id="")


def row(task_id: int) -> dict[str, Any]:
    return Task.objects.filter(pk=task_id).values().get()


@pytest.mark.django_db
def test_a_heartbeat_extends_the_deadline_and_can_save_a_checkpoint() -> None:
    held = claim_one(timeout=30)
    later = timezone.now() + timedelta(seconds=10)
    deadline = heartbeat(held, now=later)
    assert deadline == held.lease_expires_at == later + timedelta(seconds=30)
    assert (row(held.id)["lease_expires_at"], row(held.id)["heartbeat_at"]) == (deadline, later)
    assert row(held.id)["checkpoint"] is None

    ctx = TaskContext(held)
    ctx.save_checkpoint({"done": 40})
    assert row(held.id)["checkpoint"] == {"done": 40} and ctx.checkpoint == {"done": 40}
    ctx.heartbeat()
    assert row(held.id)["checkpoint"] == {"done": 40}  # a bare heartbeat keeps it


@pytest.mark.django_db
def test_a_heartbeat_from_an_attempt_that_was_taken_away_raises_lease_lost() -> None:
    held = claim_one()
    take_away(held.id)
    before = row(held.id)
    with pytest.raises(LeaseLost):
        heartbeat(held, checkpoint={"late": True})
    with pytest.raises(LeaseLost):
        TaskContext(held).save_checkpoint("late")
    assert row(held.id) == before


@pytest.mark.django_db
def test_a_report_from_an_attempt_that_was_taken_away_changes_nothing() -> None:
    cfgs = {T: configs.get(T)}
    old = claim_one()
    take_away(old.id)
    before = row(old.id)

    assert finish_attempts([Report(old, Outcome.SUCCESS, result={"late": True})], cfgs=cfgs) == []
    assert row(old.id) == before

    # Claimed again: the old attempt still cannot report, the new one can.
    [new] = claim_batch(cfgs[T], 1, "w2")
    assert new.lease_token == old.lease_token + 2
    claimed_row = row(old.id)
    assert finish_attempts([Report(old, Outcome.ERROR, error="late failure")], cfgs=cfgs) == []
    assert row(old.id) == claimed_row
    fresh = Report(new, Outcome.SUCCESS, result={"by": "w2"})
    assert finish_attempts([fresh], cfgs=cfgs) == [fresh]
    done = row(old.id)
    assert (done["status"], done["result"], done["attempts"]) == (Status.SUCCESS, {"by": "w2"}, 2)
    # A duplicate of an accepted report is refused too: the attempt is over.
    assert finish_attempts([fresh], cfgs=cfgs) == []


@pytest.mark.django_db
def test_a_batch_with_one_stale_report_applies_only_the_others() -> None:
    cfgs = {T: configs.get(T)}
    for i in range(3):
        taskflow.enqueue(T, {"i": i})
    a, b, c = claim_batch(cfgs[T], 3, "w1")
    assert a.lease_token == b.lease_token == c.lease_token  # one UPDATE group, so the fallback is exercised
    take_away(b.id)
    before_b = row(b.id)

    reports = [Report(t, Outcome.SUCCESS, result={"id": t.id}) for t in (a, b, c)]
    accepted = finish_attempts(reports, cfgs=cfgs)

    assert [r.task.id for r in accepted] == [a.id, c.id]
    assert row(b.id) == before_b
    assert [row(t.id)["status"] for t in (a, c)] == [Status.SUCCESS, Status.SUCCESS]


@pytest.mark.django_db
def test_one_batch_applies_different_outcomes_to_different_tasks() -> None:
    cfg = configs.get(T)
    cfg.retry_strategy, cfg.retry_interval, cfg.max_retry_interval, cfg.retry_jitter = "fixed", 30.0, 60.0, 0.0
    for i in range(5):
        taskflow.enqueue(T, {"i": i}, max_retries=2)
    held = claim_batch(cfg, 5, "w1")
    reports = [
        Report(held[0], Outcome.SUCCESS, result=[1]),
        Report(held[1], Outcome.SUCCESS, result=[2]),
        Report(held[2], Outcome.ERROR, error="E: x"),
        Report(held[3], Outcome.SNOOZE, delay=60),
        Report(held[4], Outcome.NEXT_STAGE, next_stage=NextStage("two", context={"n": 2})),
    ]
    assert len(finish_attempts(reports, cfgs={T: cfg})) == 5
    rows = [row(t.id) for t in held]
    assert [(r["status"], r["result"]) for r in rows[:2]] == [(Status.SUCCESS, [1]), (Status.SUCCESS, [2])]
    assert (rows[2]["status"], rows[2]["attempts"]) == (Status.PENDING, 1)
    assert rows[2]["run_after"] > timezone.now() + timedelta(seconds=25)
    assert (rows[3]["status"], rows[3]["attempts"]) == (Status.PENDING, 0)
    assert (rows[4]["stage"], rows[4]["context"], rows[4]["attempts"]) == ("two", {"n": 2}, 0)
    assert all(r["lease_expires_at"] is None for r in rows)
    assert finish_attempts([], cfgs={}) == []


@pytest.mark.django_db
@pytest.mark.parametrize("values", [[True, 1, 1.0], [False, 0, 0.0]])
def test_a_batch_of_results_stores_equal_but_differently_typed_values_exactly(values: list[Any]) -> None:
    cfgs = {T: configs.get(T)}
    for shape in (lambda v: v, lambda v: {"ok": v}, lambda v: [{"n": [v]}]):
        results = [shape(v) for v in values]  # equal by ==, so one batch would write them as one literal
        for i in range(len(results)):
            taskflow.enqueue(T, {"i": i})
        held = claim_batch(cfgs[T], len(results), "w1")
        assert len({t.lease_token for t in held}) == 1  # one UPDATE for the whole batch
        reports = [Report(t, Outcome.SUCCESS, result=r) for t, r in zip(held, results, strict=True)]
        assert len(finish_attempts(reports, cfgs=cfgs)) == len(results)
        for task, result in zip(held, results, strict=True):
            assert json.dumps(row(task.id)["result"]) == json.dumps(result)


def test_a_failed_attempt_asking_for_host_affinity_is_retried_on_its_first_host() -> None:
    cfg = policy_cfg()
    task = attempt(retry_same_host=30, worker_id="host-a:12:abc", attempt=1)
    changes = row_changes(Report(task, Outcome.ERROR, error="boom"), cfg, NOW)
    assert changes["status"] == Status.PENDING
    assert changes["prefer_host"] == "host-a"
    assert changes["prefer_host_until"] == NOW + timedelta(seconds=30)

    # The first host stays the preferred one on later retries, even if another host ran attempt 2.
    later = attempt(retry_same_host=30, worker_id="host-b:7:def", prefer_host="host-a", attempt=2)
    assert row_changes(Report(later, Outcome.RESCUED, error="lost"), cfg, NOW)["prefer_host"] == "host-a"

    anywhere = attempt(worker_id="host-a:12:abc", attempt=1)
    assert "prefer_host" not in row_changes(Report(anywhere, Outcome.ERROR, error="boom"), cfg, NOW)


def test_a_rescued_attempt_counts_as_a_failed_one() -> None:
    cfg = policy_cfg()
    retried = row_changes(Report(attempt(attempt=2), Outcome.RESCUED, error="rescued: dead worker"), cfg, NOW)
    assert retried["status"] == Status.PENDING and retried["schedule_log"][0]["outcome"] == "rescued"
    last = row_changes(Report(attempt(attempt=4), Outcome.RESCUED, error="rescued: deadline"), cfg, NOW)
    assert last["status"] == Status.FAILED and "failed after 4 attempts" in last["status_msg"]


@pytest.mark.django_db
def test_a_rescue_does_not_hand_back_uncounted_an_attempt_its_worker_started_after_the_rescue_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker silent for a while (a database outage) starts a reserved attempt between the rescue's read and
    its write: the attempt counts, so it is not handed back as unstarted; the next pass rescues it as started."""
    from taskflow.engine import rescue
    from taskflow.engine.claiming import start_reserved
    from taskflow.engine.workers import beat
    from taskflow.models import WorkerProcess

    task = taskflow.enqueue(T, {"p": 1}, max_retries=3)
    (held,) = claim_batch(configs.get(T), 0, "w1", reserve=1)
    assert row(task.pk)["started_at"] is None
    beat("w1", "host", [T], 1)
    WorkerProcess.objects.filter(worker_id="w1").update(heartbeat_at=timezone.now() - timedelta(minutes=5))

    real_finish = rescue.finish_attempts

    def worker_starts_it_first(reports: list[Report], **kwargs: Any) -> list[Report]:
        assert start_reserved([held]) == [held]  # the worker's start lands after the rescue read the row
        monkeypatch.setattr(rescue, "finish_attempts", real_finish)
        return real_finish(reports, **kwargs)

    monkeypatch.setattr(rescue, "finish_attempts", worker_starts_it_first)
    rescue.rescue_dead_workers()
    got = row(task.pk)
    assert (got["status"], got["attempts"], got["worker_id"]) == (Status.PROCESSING, 1, "w1")
    assert got["started_at"] is not None

    rescue.rescue_dead_workers()  # the next pass: a started attempt of a silent worker, counted
    got = row(task.pk)
    assert (got["status"], got["attempts"]) == (Status.PENDING, 1)
    later = timezone.now() + timedelta(hours=1)  # past its retry back-off
    (again,) = claim_batch(configs.get(T), 1, "w2", now=later)
    assert again.attempt == 2  # never a second "attempt 1"

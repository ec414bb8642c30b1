"""Periodic tasks fired by real taskwatch processes: one task per tick across kill -9 hand-overs and restarts."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from django.conf import settings

from taskflow.engine import locks
from taskflow.engine.periodic import create_schedule, schedule_key
from taskflow.models import PeriodicTask, Task
from taskflow.runtime.leadership import LEADER_LOCK

from .conftest import wait_until

pytestmark = pytest.mark.processes
FIRED = re.compile(r"periodic (\S+): fired (.*)")


def versions(name: str) -> list[int]:
    return sorted(Task.objects.filter(key=schedule_key(name)).values_list("version", flat=True))


def assert_one_after_another(name: str) -> None:
    """Each tick's task was enqueued only after the previous tick's task had finished (catch_up > 0)."""
    tasks = list(Task.objects.filter(key=schedule_key(name)).order_by("version"))
    for earlier, later in zip(tasks, tasks[1:], strict=False):
        assert earlier.status == "success", earlier
        assert later.created_at >= earlier.finished_at, (earlier, later)


def schedule(name: str, **fields: object) -> None:
    create_schedule(PeriodicTask(name=name, task_type="test.noop", every=1, **fields))


def fired_lines(proc) -> list[tuple[str, str]]:  # noqa: ANN001
    return [(m[1], m[2]) for m in FIRED.finditer(Path(proc.log_path).read_text())]


def stop(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proc.wait(timeout=30) in (0, -signal.SIGKILL), Path(proc.log_path).read_text()[-3000:]


def leader_of(procs: list, not_holder: str | None = None):  # noqa: ANN201
    holder = wait_until(
        lambda: (h := locks.holder(LEADER_LOCK)) and h != not_holder and any(f":{p.pid}:" in h for p in procs) and h,
        timeout=60,
        interval=0.02,
    )
    return holder, next(p for p in procs if f":{p.pid}:" in holder)


def test_three_taskwatch_processes_fire_one_task_per_tick_through_two_kill_9_hand_overs(spawn):
    schedule("skip")  # catch_up 0: a hand-over may leave a gap
    schedule("fill", catch_up=60)  # the ticks a hand-over delayed run one after another
    started = time.time()
    worker = spawn("taskworker", "--types", "test.noop")
    procs = [spawn("taskwatch") for _ in range(3)]
    everyone = list(procs)
    kills: list[float] = []
    holder = None
    for kill_at in (10, 20):  # seconds into the run
        holder, leader = leader_of(procs, holder)
        seen = len(versions("fill"))
        wait_until(lambda seen=seen: len(versions("fill")) >= seen + 4, timeout=60)
        time.sleep(max(0.0, started + kill_at - time.time()))
        leader.kill()
        leader.wait(timeout=10)
        kills.append(time.time())
        procs.remove(leader)
        procs.append(spawn("taskwatch"))  # the restarted process joins as a standby
        everyone.append(procs[-1])
    holder, _ = leader_of(procs, holder)
    wait_until(lambda: len([v for v in versions("fill") if v > kills[-1] + 1]) >= 4, timeout=60)
    time.sleep(max(0.0, started + 30 - time.time()))
    stop(procs)
    ended = time.time()
    wait_until(lambda: not Task.objects.filter(key=schedule_key("fill")).exclude(status="success").exists(), timeout=30)
    stop([worker])

    fill, skip = versions("fill"), versions("skip")
    # No tick twice (the identity constraint would refuse it; the log shows nobody even tried).
    assert len(fill) == len(set(fill)) and len(skip) == len(set(skip))
    logs = [line for proc in everyone for line in fired_lines(proc)]
    assert not [line for line in logs if "(existing)" in line[1]], logs
    # Ticks were fired by at least three processes: the first leader and the two that took over.
    assert len([proc for proc in everyone if fired_lines(proc)]) >= 3
    # catch_up covers the hand-overs: every tick from the first to the last, exactly once, each run
    # after the previous one finished.
    assert fill == list(range(fill[0], fill[-1] + 1)), _gaps(fill)
    assert fill[0] <= started + 15 and fill[-1] > kills[-1] + 1, (started, fill[0], fill[-1], kills)
    assert_one_after_another("fill")
    # Without catch_up, ticks go missing across a hand-over (at most LEADER_TTL + a pass or two), and
    # a single one at most when a pass comes late.
    ttl = settings.TASKFLOW["LEADER_TTL"]
    for before, after in _gaps(skip):
        assert after - before - 1 <= ttl + 4, (before, after, kills)
        assert after - before == 2 or any(before - 1 <= kill <= after for kill in kills), (before, after, kills)
    behind, at = ended - fill[-1], [round(k - started, 1) for k in kills]
    print(f"\n{len(fill)} ticks in {ended - started:.0f}s, kills at {at}s; catch_up 60 ended {behind:.1f}s behind")
    print(f"gaps without catch_up: {_gaps(skip)}")


def _gaps(ticks: list[int]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in zip(ticks, ticks[1:], strict=False) if b - a > 1]


def test_after_a_10_s_stop_a_schedule_skips_to_the_latest_tick_or_catches_up_at_most_n(spawn):
    schedule("skip")
    schedule("catch", catch_up=4)
    worker = spawn("taskworker", "--types", "test.noop")
    first = spawn("taskwatch")
    wait_until(lambda: len(versions("skip")) >= 3 and len(versions("catch")) >= 3, timeout=60)
    stop([first])
    skip_before, catch_before = versions("skip")[-1], versions("catch")[-1]
    time.sleep(10)
    second = spawn("taskwatch")
    wait_until(
        lambda: (
            len([v for v in versions("skip") if v > skip_before]) >= 3
            and len([v for v in versions("catch") if v > catch_before]) >= 6
        ),
        timeout=60,
    )
    stop([second])
    wait_until(
        lambda: not Task.objects.filter(key=schedule_key("catch")).exclude(status="success").exists(), timeout=30
    )
    stop([worker])

    skip = [v for v in versions("skip") if v > skip_before]
    catch = [v for v in versions("catch") if v > catch_before]
    resumed = skip[0]  # the restarted leader's first pass fired only the latest tick...
    assert resumed - skip_before >= 10
    # The same pass fired the oldest of the latest four missed ticks of "catch" and skipped the rest;
    # the next passes fired the other three and then kept up, each tick after the previous finished.
    assert catch[:4] == [resumed - 3, resumed - 2, resumed - 1, resumed]
    assert catch == list(range(catch[0], catch[-1] + 1))
    assert catch[0] - catch_before > 1
    assert_one_after_another("catch")
    restart_log = Path(second.log_path).read_text()
    assert f"periodic catch: fired tick {resumed - 3} " in restart_log
    assert "older due tick(s) skipped (catch_up 4)" in restart_log

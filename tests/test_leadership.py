"""Leader election: one lease holder acts, another takes over within one TTL when it dies."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from django.conf import settings

from taskflow.engine import locks
from taskflow.runtime.leadership import LEADER_LOCK, Leadership
from taskflow.runtime.watcher import Watcher

from .conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)
ACTED = re.compile(r"(\S+) acted from (\d+\.\d+) to (\d+\.\d+)")


def test_only_one_process_leads_until_it_resigns():
    a, b = Leadership(ttl=5), Leadership(ttl=5)
    assert a.renew() and a.active
    assert not b.renew() and not b.active
    assert a.renew()  # renewing our own lease
    assert a.holder() == a.owner
    a.resign()
    assert not a.active
    assert b.renew() and b.holder() == b.owner
    assert not a.renew()


def test_lease_expires_without_renewal_and_is_taken_over():
    a, b = Leadership(ttl=0.6), Leadership(ttl=0.6)
    assert a.renew()
    assert not b.renew()
    # The holder stops trusting its lease before it can expire for the others.
    wait_until(lambda: not a.active, timeout=5)
    assert not b.active
    wait_until(b.renew, timeout=5)
    assert not a.renew() and not a.active


def test_leader_that_lost_its_lease_stops_acting():
    a, b = Leadership(ttl=5), Leadership(ttl=5)
    assert a.renew()
    locks.release(a.name, a.owner)  # e.g. an operator removed it, or it expired during a stall
    assert b.renew()
    assert not a.renew()
    assert not a.active and not a.leading


def test_watcher_acts_only_as_leader_and_stops_mid_pass_when_its_lease_lapses():
    ran: list[str] = []

    def slow(now: object, keep_going: object) -> int:
        ran.append("slow")
        time.sleep(0.7)  # longer than the trusted part of a 0.5 s lease
        return 1

    def after(now: object, keep_going: object) -> int:
        ran.append("after")
        return 1

    other = Leadership(ttl=5)
    assert other.renew()
    assert Watcher(leadership=Leadership(ttl=5), duties=[("after", after)]).run_once() is None
    assert ran == []
    other.resign()

    watcher = Watcher(leadership=Leadership(ttl=0.5), duties=[("slow", slow), ("after", after)])
    assert watcher.run_once() == {"slow": 1}
    assert ran == ["slow"]


def _passes(path: str) -> list[tuple[str, float, float]]:
    return [(m[1], float(m[2]), float(m[3])) for m in ACTED.finditer(Path(path).read_text())]


@pytest.mark.processes
def test_two_taskwatch_processes_never_act_at_once_and_hand_over_when_the_leader_dies(spawn):
    debug = {"TASKFLOW_LOG_LEVEL": "DEBUG"}
    procs = [spawn("taskwatch", env=debug), spawn("taskwatch", env=debug)]
    holder = wait_until(lambda: locks.holder(LEADER_LOCK), timeout=60)
    leader = next(p for p in procs if f":{p.pid}:" in holder)
    standby = next(p for p in procs if p is not leader)
    wait_until(lambda: len(_passes(leader.log_path)) >= 5, timeout=30)
    assert _passes(standby.log_path) == []  # it tried, and did nothing

    leader.kill()
    leader.wait(timeout=10)
    killed_at, killed_wall = time.monotonic(), time.time()
    new_holder = wait_until(lambda: (h := locks.holder(LEADER_LOCK)) and h != holder and h, timeout=30, interval=0.02)
    handover = time.monotonic() - killed_at
    ttl, interval = settings.TASKFLOW["LEADER_TTL"], settings.TASKFLOW["WATCH_INTERVAL"]
    print(f"\nleader hand-over after kill -9: {handover:.2f}s (LEADER_TTL {ttl}s, WATCH_INTERVAL {interval}s)")
    assert f":{standby.pid}:" in new_holder
    assert handover < ttl + interval + 3
    wait_until(lambda: len([p for p in _passes(standby.log_path) if p[1] > killed_wall]) >= 3, timeout=30)

    passes = sorted(_passes(leader.log_path) + _passes(standby.log_path), key=lambda p: p[1])
    for earlier, later in zip(passes, passes[1:], strict=False):
        assert earlier[2] <= later[1], f"{earlier} overlaps {later}"
    assert {p[0] for p in passes} == {holder, new_holder}


@pytest.mark.processes
def test_taskwatch_exits_cleanly_on_sigterm_and_gives_the_lease_up(spawn):
    proc = spawn("taskwatch", "--interval", "0.2")
    wait_until(lambda: locks.holder(LEADER_LOCK), timeout=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, Path(proc.log_path).read_text()
    assert locks.holder(LEADER_LOCK) is None
    assert "resigned" in Path(proc.log_path).read_text()

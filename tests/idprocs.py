"""Programs the id tests run as real processes: `python -m tests.idprocs <scenario> [args]`.

Each prints JSON lines on stdout. A forced node (`--node N`) makes the node stores try node N first
(they start their search at random.randint), so a test can aim a process at a node another holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

import django


def emit(**data: object) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def enqueue_some(count: int) -> list[int]:
    """Enqueue `count` unkeyed tasks, single and bulk, and return their ids."""
    import taskflow

    got = [taskflow.enqueue("test.noop").id]
    while len(got) < count:
        got += [t.id for t in taskflow.enqueue_many([{"task_type": "test.noop"}] * min(100, count - len(got)))]
    return got


def fork_children(children: int, per_child: int, out: str) -> None:
    """The parent enqueues, then forks children that enqueue at the same moment (a pre-fork server)."""
    from django.db import connections

    parent = enqueue_some(1)
    connections.close_all()  # each process needs its own connection; the id node is not tied to one
    gate_r, gate_w = os.pipe()
    pids = []
    for i in range(children):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(gate_w)
                os.read(gate_r, 1)  # returns when the parent closes the gate: all children start together
                with open(os.path.join(out, f"child-{i}.json"), "w") as f:
                    json.dump(enqueue_some(per_child), f)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(gate_w)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    emit(parent=parent, codes=codes)


def prepare_to_fork() -> None:
    """Load what a server loads before forking (minting nothing), then drop the database connection."""
    import gc

    from django.db import connections

    from taskflow.engine.configs import configs
    from taskflow.engine.redis import get_redis

    get_redis(), configs.get_many(["test.noop"])
    connections.close_all()
    gc.freeze()  # as pre-fork servers do: the children's exits then skip collecting the parent's objects


def sequential_children(count: int) -> None:
    """Fork `count` children one after another; each enqueues one task and exits the normal way."""
    prepare_to_fork()
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            emit(pid=os.getpid(), ids=enqueue_some(1))
            sys.exit(0)  # unwinds to the interpreter's exit: exit hooks run, as in any process that ends
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code:
            emit(error=f"child exited {code}")


def crash_then_reuse(node: int, ttl: float, ahead: float) -> None:
    """A child whose clock runs `ahead` s fast mints under `node` and dies without exit hooks; then
    one child right away, and one once the dead child's lease has run out."""
    from django.db import connection, connections

    from taskflow.engine import nodes
    from taskflow.models import IdNode

    nodes.NODE_LEASE_TTL = ttl
    prepare_to_fork()

    def child(name: str, clean_exit: bool, skew: float = 0.0) -> None:
        pid = os.fork()
        if pid == 0:
            if skew:
                real_time = time.time
                time.time = lambda: real_time() + skew  # this host's clock runs fast, then gets corrected
            emit(child=name, ids=enqueue_some(50))
            if clean_exit:
                sys.exit(0)
            os._exit(0)  # like SIGKILL: no exit hooks, the lease is left to run out
        os.waitpid(pid, 0)

    child("crashed", clean_exit=False, skew=ahead)
    child("at-once", clean_exit=True)
    if connection.vendor != "sqlite":
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and IdNode.objects.filter(node=node, expires_at__gt=nodes.DatabaseNow()):
            time.sleep(0.1)
        connections.close_all()
    child("after-ttl", clean_exit=True)


def pool(workers: int, jobs: int) -> None:
    """A multiprocessing pool forked after the parent enqueued; each worker process runs one job and exits."""
    import multiprocessing

    from django.db import connections

    parent = enqueue_some(1)
    connections.close_all()
    with multiprocessing.get_context("fork").Pool(workers, maxtasksperchild=1) as p:
        results = p.map(_pool_job, range(jobs))
        p.close()
        p.join()
    emit(parent=parent, results=results)


def _pool_job(_: int) -> tuple[int, list[int]]:
    return os.getpid(), enqueue_some(20)


def hold(count: int) -> None:
    """Mint one id, wait for a line on stdin (the test acts meanwhile), then mint `count` more."""
    emit(pid=os.getpid(), ids=enqueue_some(1))
    sys.stdin.readline()
    emit(pid=os.getpid(), ids=enqueue_some(count))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("args", nargs="*")
    parser.add_argument("--node", type=int)
    options = parser.parse_args()
    if options.node is not None:
        random.randint = lambda a, b: options.node
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    scenarios = {
        "fork": lambda children, per_child, out: fork_children(int(children), int(per_child), out),
        "sequential": lambda count: sequential_children(int(count)),
        "crash": lambda ttl, ahead: crash_then_reuse(options.node, float(ttl), float(ahead)),
        "pool": lambda workers, jobs: pool(int(workers), int(jobs)),
        "hold": lambda count: hold(int(count)),
        "mint": lambda count: emit(pid=os.getpid(), ids=enqueue_some(int(count))),
    }
    scenarios[options.scenario](*options.args)


if __name__ == "__main__":
    main()

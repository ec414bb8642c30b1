"""The operation subcommands: the console's actions and pause/resume, run through the same engine functions.

Who acts is recorded as "cli:<name>" (the OS user, or --actor), in the same TaskEvent audit trail
the console writes with its user's name, so the history tells the two apart.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine import operations, pausing
from ..engine.operations import OperationResult

ACTOR_PREFIX = "cli:"


@dataclass(frozen=True)
class Operation:
    """One subcommand: the engine function it calls and what it does, for --help."""

    function: Callable[..., OperationResult]
    help: str


# The task operations, by subcommand (the console's: engine/operations.py).
TASK_OPERATIONS = {
    "retry": Operation(
        operations.retry_now, "run failed or stopped tasks again now (fresh retry budget); delayed ones now"
    ),
    "terminate": Operation(
        operations.terminate, "stop pending, waiting and running tasks (a running attempt is fenced)"
    ),
    "reschedule": Operation(
        operations.reschedule, "move tasks' due time; failed and stopped ones become pending at it"
    ),
    "priority": Operation(operations.set_priority, "set tasks' priority (-100..100, higher first)"),
    "max-retries": Operation(operations.set_max_retries, "set how many retries tasks get (0 or more)"),
}
TYPE_OPERATIONS = {
    "pause": Operation(pausing.pause, "pause task types: workers stop claiming their tasks"),
    "resume": Operation(pausing.resume, "resume paused task types"),
}


def actor(name: str | None) -> str:
    """Who acts, as recorded: "cli:" and --actor, else the OS user running the command."""
    if not name:
        try:
            name = getpass.getuser()
        except (OSError, KeyError):  # no login name and no passwd entry (a bare container)
            name = f"uid{os.getuid()}"
    return ACTOR_PREFIX + name.strip()


def result_data(result: OperationResult, actor: str, reason: str) -> dict[str, Any]:
    return {
        "action": result.action,
        "dry_run": result.dry_run,
        "changed": result.changed,
        "skipped": result.skipped,
        "total": result.total,
        "actor": actor,
        "reason": reason,
    }


def result_text(result: OperationResult) -> str:
    text = str(result)
    if result.dry_run:
        text += " (dry run: nothing changed)"
    elif not result.total:
        text += " (nothing matched)"
    return text

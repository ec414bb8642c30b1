"""CPU time of the processes on this machine (Linux /proc): what bounds a drain once every core is busy.

A drain that keeps every core busy runs at most cores / (CPU per task of everything it needs: workers,
API server, database server), whatever the settings; these readings put a figure on each part.
"""

from __future__ import annotations

import os
from pathlib import Path

DATABASE_SERVERS = {"mysql": ("mariadbd", "mysqld"), "postgresql": ("postgres",)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process so far (0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes_cpu(pids: list[int]) -> float:
    """CPU seconds so far of these running processes, together."""
    return sum(cpu_seconds(pid) for pid in pids)


def database_server_cpu() -> float | None:
    """CPU time so far of the database server's processes on this machine (None: SQLite, or none visible)."""
    from django.db import connection

    names = DATABASE_SERVERS.get(connection.vendor)
    if not names:
        return None
    total, seen = 0.0, False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() not in names:
                continue
        except OSError:
            continue
        total += cpu_seconds(int(entry.name))
        seen = True
    return total if seen else None


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)

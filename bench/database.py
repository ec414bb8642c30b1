"""The benchmark's own database: created if missing, migrated, and emptied between measurements."""

from __future__ import annotations

import re
from pathlib import Path

import dj_database_url

_SAFE_NAME = re.compile(r"[A-Za-z0-9_]+")


def ensure_database(url: str, *, fresh: bool) -> str:
    """Create the database named by `url` (dropping it first if `fresh`); returns its name.

    Refuses names without "bench" in them, because the benchmark empties and drops it. A fresh
    database is the default because a migration edited in place would otherwise go unnoticed.
    """
    cfg = dj_database_url.parse(url)
    engine, name = cfg["ENGINE"], str(cfg["NAME"])
    if "bench" not in Path(name).name:
        raise SystemExit(f"refusing to benchmark on {name!r}: the database name must contain 'bench'")
    if engine.endswith("sqlite3"):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            for suffix in ("", "-wal", "-shm"):
                Path(name + suffix).unlink(missing_ok=True)
        return name
    if not _SAFE_NAME.fullmatch(name):
        raise SystemExit(f"unsupported database name {name!r} (letters, digits and _ only)")
    if engine.endswith("mysql"):
        import MySQLdb

        conn = MySQLdb.connect(
            host=cfg.get("HOST") or "127.0.0.1",
            port=int(cfg.get("PORT") or 3306),
            user=cfg.get("USER") or "root",
            passwd=cfg.get("PASSWORD") or "",
        )
        try:
            if fresh:
                conn.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
            conn.cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4")
        finally:
            conn.close()
    elif engine.endswith("postgresql"):
        import psycopg
        from psycopg import sql

        with psycopg.connect(
            host=cfg.get("HOST") or "127.0.0.1",
            port=int(cfg.get("PORT") or 5432),
            user=cfg.get("USER") or "postgres",
            password=cfg.get("PASSWORD") or None,
            dbname="postgres",
            autocommit=True,
        ) as conn:
            if fresh:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    else:
        raise SystemExit(f"unsupported database engine {engine}")
    return name


def migrate() -> None:
    """Bring the benchmark database's schema up to date."""
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)


def reset_tables() -> None:
    """Empty the task, identity and worker tables, so each measurement starts from nothing."""
    from django.db import connection

    from taskflow.models import Task, TaskKey, WorkerProcess

    with connection.cursor() as cursor:
        for model in (Task, TaskKey, WorkerProcess):
            table = connection.ops.quote_name(model._meta.db_table)
            # TRUNCATE is much cheaper than DELETE for 50,000 rows; SQLite has no TRUNCATE.
            verb = "DELETE FROM" if connection.vendor == "sqlite" else "TRUNCATE TABLE"
            cursor.execute(f"{verb} {table}")


def reset_schedule_configs(prefix: str) -> None:
    """Drop the ScheduleCfg rows of the bench types, so they are recreated from the engine defaults."""
    from taskflow.engine.configs import configs
    from taskflow.models import ScheduleCfg

    ScheduleCfg.objects.filter(task_type__startswith=prefix).delete()
    configs.clear()


def describe() -> str:
    """The database vendor and server version, for the report header."""
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("SELECT sqlite_version()")
        elif connection.vendor == "postgresql":
            cursor.execute("SHOW server_version")
        else:
            cursor.execute("SELECT version()")
        version = cursor.fetchone()[0]
    return f"{connection.vendor} {version} (database {connection.settings_dict['NAME']})"


class RawInserts:
    """The limits enqueueing is measured against: plain INSERTs, no engine.

    Both go through the same Django connection (and its driver) as the engine does. `narrow` is the
    row of the peers harness's raw queue (../shared/bench-peers: id, status, payload, worker, one
    index), the "raw INSERT" of issue 16; `task_row` is the full task row, every column a parameter,
    into a copy of the task table (the same columns and indexes; on SQLite without its indexes), one
    autocommitted row at a time; `task_rows` sends the task row in multi-row INSERTs, as bulk enqueue does.
    """

    NARROW = "bench_raw_narrow"
    TASK_ROW = "bench_raw_task"

    def __init__(self) -> None:
        from django.db import connection
        from django.utils import timezone

        from taskflow.models import Task

        qn = connection.ops.quote_name
        self.drop()
        task_table = qn(Task._meta.db_table)
        vendor = connection.vendor
        key = {
            "mysql": "BIGINT AUTO_INCREMENT PRIMARY KEY",
            "postgresql": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
        }.get(vendor, "INTEGER PRIMARY KEY AUTOINCREMENT")
        with connection.cursor() as cursor:
            cursor.execute(
                f"CREATE TABLE {self.NARROW} (id {key}, status SMALLINT NOT NULL DEFAULT 0, "
                "payload VARCHAR(255) NOT NULL, worker VARCHAR(64) NULL)"
            )
            cursor.execute(f"CREATE INDEX {self.NARROW}_status_id ON {self.NARROW} (status, id)")
            if vendor == "mysql":
                cursor.execute(f"CREATE TABLE {self.TASK_ROW} LIKE {task_table}")
            elif vendor == "postgresql":
                cursor.execute(f"CREATE TABLE {self.TASK_ROW} (LIKE {task_table} INCLUDING ALL)")
            else:
                cursor.execute(f"CREATE TABLE {self.TASK_ROW} AS SELECT * FROM {task_table} WHERE 0 = 1")
        # One new task's column values, prepared by the ORM once: the loop only sends them.
        fields = Task._meta.concrete_fields
        now = timezone.now()
        times = {name: now for name in ("run_after", "order_time", "created_at", "updated_at")}
        task = Task(task_type="bench.noop", payload={"i": 0}, trace_id="0" * 32, **times)
        self.task_values = [f.get_db_prep_save(getattr(task, f.attname), connection) for f in fields]
        self.id_index = [f.attname for f in fields].index("id")
        self.trace_index = [f.attname for f in fields].index("trace_id")
        self.task_sql = (
            f"INSERT INTO {self.TASK_ROW} ({', '.join(qn(f.column) for f in fields)}) "
            f"VALUES ({', '.join(['%s'] * len(fields))})"
        )

    def narrow(self, n: int) -> float:
        """Seconds for n single-row INSERTs of the narrow row."""
        import time

        from django.db import connection

        sql = f"INSERT INTO {self.NARROW} (payload) VALUES (%s)"
        started = time.perf_counter()
        with connection.cursor() as cursor:
            for i in range(n):
                cursor.execute(sql, [f'{{"i": {i}}}'])
        return time.perf_counter() - started

    def task_row(self, n: int, first_id: int) -> float:
        """Seconds for n single-row INSERTs of the task row (ids from first_id)."""
        import time

        from django.db import connection

        values, at = list(self.task_values), self.id_index
        started = time.perf_counter()
        with connection.cursor() as cursor:
            for i in range(first_id, first_id + n):
                values[at] = i
                cursor.execute(self.task_sql, values)
        return time.perf_counter() - started

    def task_rows(self, total: int, size: int, first_id: int) -> float:
        """Seconds for `total` task rows in multi-row INSERTs of `size` rows (the driver's executemany), a
        transaction each, ids from `first_id`; each row with its own trace id, as enqueue_many writes them."""
        import os
        import time

        from django.db import connection, transaction

        at, trace = self.id_index, self.trace_index
        end = first_id + total
        started = time.perf_counter()
        with connection.cursor() as cursor:
            for start in range(first_id, end, size):
                rows = []
                for i in range(start, min(start + size, end)):
                    values = list(self.task_values)
                    values[at], values[trace] = i, os.urandom(16).hex()
                    rows.append(values)
                with transaction.atomic():
                    cursor.executemany(self.task_sql, rows)
        return time.perf_counter() - started

    def __enter__(self) -> RawInserts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()

    def drop(self) -> None:
        from django.db import connection

        with connection.cursor() as cursor:
            for table in (self.NARROW, self.TASK_ROW):
                cursor.execute(f"DROP TABLE IF EXISTS {table}")

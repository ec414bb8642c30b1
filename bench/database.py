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

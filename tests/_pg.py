"""Throwaway PostgreSQL databases for the tests of the shared store.

The server: ``$SPARKTUNE_TEST_PG`` (an admin URL), else the local one at 127.0.0.1:5432 as user
postgres (trust authentication; ``.ci/run`` starts it). Where no server answers, or psycopg is
not installed, the tests that need it are skipped with the reason -- except on CI (``$CI`` is
true) where a server is installed or named: there they fail, so that a server that did not
start can never pass for one that is absent. Each test gets a database of
its own, named with a prefix unique to the test session, and drops it afterwards; databases
left behind by a session whose process is gone are dropped on first use.
"""

from __future__ import annotations

import functools
import glob
import itertools
import os
import secrets
import shutil

import pytest

ENV_PG = "SPARKTUNE_TEST_PG"
DEFAULT_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
PREFIX = f"sparktune_test_{os.getpid()}_{secrets.token_hex(3)}"
_counter = itertools.count()


def admin_url() -> str:
    return os.environ.get(ENV_PG) or DEFAULT_ADMIN


def _libpq(url: str) -> dict:
    from sqlalchemy.engine import make_url

    u = make_url(url)
    out = {"host": u.host or "127.0.0.1", "port": u.port or 5432, "user": u.username or "postgres",
           "dbname": u.database or "postgres", "connect_timeout": 3}
    if u.password:
        out["password"] = u.password
    return out


def _connect(dbname: str | None = None):
    import psycopg

    params = _libpq(admin_url())
    if dbname:
        params["dbname"] = dbname
    return psycopg.connect(autocommit=True, **params)


@functools.cache
def unavailable() -> str:
    """Why the tests cannot use a PostgreSQL server ("" when they can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    try:
        with _connect() as conn:
            conn.execute("SELECT 1")
            _drop_orphans(conn)
    except Exception as exc:  # noqa: BLE001
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"no PostgreSQL server answers at {_libpq(admin_url())['host']}:{_libpq(admin_url())['port']} ({first})"
    return ""


def required() -> str:
    """Why the PostgreSQL tests must run here rather than skip ("" when they may skip): on CI
    (``$CI`` true), a server named by ``$SPARKTUNE_TEST_PG`` or installed on this machine."""
    if os.environ.get("CI", "").strip().lower() not in ("true", "1", "yes"):
        return ""
    if os.environ.get(ENV_PG):
        return f"${ENV_PG} names a server"
    if shutil.which("pg_ctlcluster") or glob.glob("/usr/lib/postgresql/*/bin/postgres"):
        return "a PostgreSQL server is installed on this machine"
    return ""


def _drop_orphans(conn) -> None:
    rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'sparktune\\_test\\_%'").fetchall()
    for (name,) in rows:
        parts = name.split("_")
        try:
            pid = int(parts[2])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
            continue  # a live session's database
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def create_database() -> tuple[str, str]:
    """(name, SQLAlchemy URL) of a new, empty database."""
    reason = unavailable()
    if reason:
        must = required()
        if must:
            pytest.fail(f"{reason}; on CI, {must}: the PostgreSQL tests must run, not skip", pytrace=False)
        pytest.skip(reason)
    name = f"{PREFIX}_{next(_counter)}"
    with _connect() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    from sqlalchemy.engine import make_url

    url = make_url(admin_url()).set(database=name, drivername="postgresql+psycopg")
    return name, url.render_as_string(hide_password=False)


def drop_database(name: str) -> None:
    with _connect() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def with_password(url: str, password: str) -> str:
    """The URL with a password (trust authentication ignores it): to show it is never printed."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(password=password).render_as_string(hide_password=False)


def terminate_connections(dbname: str, *, application_name: str | None = None) -> int:
    """End the server processes of the connections to ``dbname`` (all, or one application's),
    as a server restart would; returns how many."""
    with _connect() as conn:
        sql = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
        params: list = [dbname]
        if application_name is not None:
            sql += " AND application_name = %s"
            params.append(application_name)
        return int(conn.execute(sql, params).fetchone()[0])


@pytest.fixture
def pg_url():
    """The URL of a throwaway PostgreSQL database (skipped without a server)."""
    name, url = create_database()
    try:
        yield url
    finally:
        drop_database(name)

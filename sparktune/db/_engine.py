"""Where the store lives and how to connect to it.

Everything that depends on the SQL dialect is in this module: the SQLite pragmas (WAL,
busy timeout), explicit ``BEGIN IMMEDIATE`` for SQLite write transactions, and the lock
that serialises schema changes on PostgreSQL. The store and the schema code above it use
portable SQLAlchemy only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url

__all__ = [
    "ENV_DB",
    "default_path",
    "lock_for_schema_change",
    "make_engine",
    "resolve_url",
    "safe_url",
    "sqlite_file",
    "write_connection",
]

#: environment variable naming the store (any SQLAlchemy URL)
ENV_DB = "SPARKTUNE_DB"

_FILE_NAME = "tuning.sqlite3"


def _cache_dir() -> Path:
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "sparktune" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "sparktune"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sparktune"


def default_path() -> Path:
    """The default store: a SQLite file in the user's cache directory."""
    return _cache_dir() / _FILE_NAME


def resolve_url(url: str | os.PathLike[str] | URL | None = None) -> URL:
    """``url`` if given, else ``$SPARKTUNE_DB``, else the default SQLite file. A bare path
    (no ``://``) is taken as a SQLite file."""
    text = url if url is not None else os.environ.get(ENV_DB) or None
    if text is None:
        return make_url(f"sqlite:///{default_path()}")
    if isinstance(text, URL):
        return text
    text = os.fspath(text)
    if "://" not in text:
        return make_url(f"sqlite:///{Path(text).expanduser().resolve()}")
    return make_url(text)


def safe_url(url: str | os.PathLike[str] | URL | None) -> str:
    """The URL as text with any password hidden (safe for logs, errors and JSON)."""
    try:
        u = resolve_url(url)
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as a placeholder
        return "<unparsable database URL>"
    return u.render_as_string(hide_password=True)


def sqlite_file(url: URL) -> Path | None:
    """The file of a SQLite URL (None for other dialects and in-memory databases)."""
    if url.get_backend_name() != "sqlite":
        return None
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db)


def make_engine(url: URL, *, timeout: float = 30.0, create_dir: bool = True) -> Engine:
    """An engine for ``url``. ``timeout`` is SQLite's busy timeout and the connect timeout of
    network databases, in seconds."""
    backend = url.get_backend_name()
    kwargs: dict[str, Any] = {}
    if backend == "sqlite":
        path = sqlite_file(url)
        if path is not None and create_dir:
            path.parent.mkdir(parents=True, exist_ok=True)
        if path is None:
            kwargs["poolclass"] = sa.pool.StaticPool
            kwargs["connect_args"] = {"check_same_thread": False}
        engine = sa.create_engine(url, **kwargs)
        _setup_sqlite(engine, timeout)
        return engine
    if backend == "postgresql":
        kwargs["pool_pre_ping"] = True
        kwargs["connect_args"] = {"connect_timeout": max(1, int(timeout))}
    return sa.create_engine(url, **kwargs)


def _setup_sqlite(engine: Engine, timeout: float) -> None:
    busy_ms = int(timeout * 1000)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # The driver's own transaction handling would start transactions lazily and could
        # not take the write lock up front; we emit BEGIN ourselves (see _on_begin).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {busy_ms}")
            try:
                cur.execute("PRAGMA journal_mode = WAL")
            except Exception as exc:  # a read-only database is read in the mode it has
                if "readonly" not in str(exc).replace("-", "").lower():
                    raise
            cur.execute("PRAGMA synchronous = NORMAL")
        finally:
            cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # A writer takes the write lock when its transaction starts, so that the busy timeout
        # applies; a deferred transaction that later needs to write fails at once instead.
        if conn.get_execution_options().get("sparktune_write"):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


def write_connection(engine: Engine) -> Connection:
    """A connection whose transactions are write transactions (``with c.begin(): ...``)."""
    return engine.connect().execution_options(sparktune_write=True)


def lock_for_schema_change(conn: Connection) -> None:
    """Serialise schema creation and upgrades between processes, inside the current
    transaction. SQLite's write transaction is already exclusive between writers."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": 0x5350524B})  # "SPRK"

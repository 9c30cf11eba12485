"""Where the store lives and how to connect to it.

Everything that depends on the SQL dialect is in this module: the SQLite pragmas (WAL,
busy timeout), explicit ``BEGIN IMMEDIATE`` for SQLite write transactions, PostgreSQL's
connection settings (connect timeout, TCP keepalives, statement timeout), the server's clock,
the lock that serialises schema changes on PostgreSQL, and which errors mean "the database
went away for a moment". The store and the code above it use portable SQLAlchemy only.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url

__all__ = [
    "ENV_DB",
    "cache_dir",
    "default_path",
    "insert_ignore",
    "is_transient_error",
    "is_network",
    "lock_for_schema_change",
    "make_engine",
    "render_safe",
    "resolve_url",
    "safe_url",
    "scrub",
    "server_time",
    "sqlite_file",
    "write_connection",
]

#: environment variable naming the store (any SQLAlchemy URL)
ENV_DB = "SPARKTUNE_DB"

_FILE_NAME = "tuning.sqlite3"


def cache_dir() -> Path:
    """sparktune's directory in the user's cache (the default store, dispatch snapshots)."""
    return _cache_dir()


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
    return _default_driver(make_url(text))


def _default_driver(url: URL) -> URL:
    """``postgresql://`` means psycopg2 to SQLAlchemy; where only psycopg 3 is installed (the
    ``postgres`` extra), use that instead of failing on the import."""
    if url.drivername == "postgresql" and importlib.util.find_spec("psycopg2") is None:
        if importlib.util.find_spec("psycopg") is not None:
            return url.set(drivername="postgresql+psycopg")
    return url


def is_network(url: URL) -> bool:
    """Whether the store is a server (as opposed to a SQLite file or memory)."""
    return url.get_backend_name() != "sqlite"


#: query parameters of a URL whose values are secrets (libpq's ``password``, ``sslpassword``...)
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token", re.IGNORECASE)
_HIDDEN = "sparktune-hidden-value"


def _secret_params(url: URL) -> list[str]:
    return [k for k in url.query if _SECRET_PARAM.search(k)]


def render_safe(url: URL) -> str:
    """``url`` as text with its password, and the values of query parameters that carry one
    (``?password=...``), shown as ``***``."""
    secret = _secret_params(url)
    if secret:
        url = url.set(query={**url.query, **dict.fromkeys(secret, _HIDDEN)})
    return url.render_as_string(hide_password=True).replace(_HIDDEN, "***")


def safe_url(url: str | os.PathLike[str] | URL | None) -> str:
    """The URL as text with any password hidden (safe for logs, errors and JSON)."""
    try:
        u = resolve_url(url)
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as a placeholder
        return "<unparsable database URL>"
    return render_safe(u)


def _secrets(url: object) -> list[str]:
    """The secrets of ``url``: its password and the values of its secret query parameters;
    for a URL that cannot be parsed, whatever stands where a password would."""
    try:
        u = resolve_url(url)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001
        m = re.match(r"^[^:/?#]+://[^:/?#@]*:(.*)@", os.fspath(url) if isinstance(url, (str, os.PathLike)) else "")
        return [m.group(1)] if m and m.group(1) else []
    found = [str(u.password)] if u.password else []
    for key in _secret_params(u):
        value = u.query[key]
        found.extend(str(v) for v in (value if isinstance(value, tuple) else (value,)) if v)
    return found


def scrub(text: str, *urls: object) -> str:
    """``text`` with the secrets of each URL (its password and secret query parameters, as
    given and percent-encoded) replaced by ``***``: for messages that come from drivers and
    libraries, which may quote a URL."""
    from urllib.parse import quote, quote_plus

    for url in urls:
        for secret in _secrets(url):
            for form in sorted({secret, quote(secret, safe=""), quote_plus(secret)}, key=len, reverse=True):
                text = text.replace(form, "***")
    return text


def sqlite_file(url: URL) -> Path | None:
    """The file of a SQLite URL (None for other dialects and in-memory databases)."""
    if url.get_backend_name() != "sqlite":
        return None
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db)


def make_engine(
    url: URL, *, timeout: float = 30.0, create_dir: bool = True, statement_timeout: float | None = None
) -> Engine:
    """An engine for ``url``. ``timeout`` is SQLite's busy timeout and the connect timeout of
    network databases, in seconds. ``statement_timeout`` (PostgreSQL) bounds every statement
    and lock wait, for readers that must never hang on the database."""
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
        # a server restarted under us: pooled connections are tested before use
        kwargs["pool_pre_ping"] = True
        kwargs["connect_args"] = postgres_connect_args(url, timeout=timeout, statement_timeout=statement_timeout)
    return sa.create_engine(url, **kwargs)


def postgres_connect_args(url: URL, *, timeout: float, statement_timeout: float | None = None) -> dict[str, Any]:
    """libpq settings: a bounded connect, TCP keepalives (a server that vanished is noticed in
    seconds, not hours) and, when asked, a statement and lock timeout."""
    args: dict[str, Any] = {"connect_timeout": max(1, math.ceil(timeout))}
    if url.get_driver_name() in ("psycopg", "psycopg2", "psycopg2cffi"):
        args.update(keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3)
        if statement_timeout is not None:
            ms = max(1, int(statement_timeout * 1000))
            options = str(url.query.get("options", ""))
            args["options"] = f"{options} -c statement_timeout={ms} -c lock_timeout={ms}".strip()
    return args


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


def server_time(conn: Connection) -> float:
    """The database server's clock in seconds since the epoch. Leases are compared against it,
    so the clocks of the worker hosts do not matter. (SQLite's server is this machine.)"""
    name = conn.dialect.name
    if name == "postgresql":
        return float(conn.execute(sa.text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())
    if name == "sqlite":
        return float(conn.execute(sa.text("SELECT (julianday('now') - 2440587.5) * 86400.0")).scalar_one())
    return time.time()


def is_transient_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) means the database was away or
    busy for a moment -- a dropped connection, a server restarting or refusing connections,
    a lock -- so that the same work can be retried once it answers again."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, sa.exc.DBAPIError) and e.connection_invalidated:
            return True
        if isinstance(e, (sa.exc.OperationalError, sa.exc.InterfaceError)):
            text = str(getattr(e, "orig", e)).lower()
            if "sqlite" in type(getattr(e, "orig", e)).__module__:
                return "locked" in text or "busy" in text
            return True
        if type(e).__module__.startswith("psycopg") and type(e).__name__ in (
            "OperationalError", "InterfaceError", "AdminShutdown", "CannotConnectNow", "ConnectionTimeout",
        ):
            return True
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        e = e.__cause__ or e.__context__
    return False


def insert_ignore(conn: Connection, table: sa.Table, values: dict[str, Any], key: str) -> bool:
    """INSERT a row unless one with the same ``key`` exists; True when it was inserted. One
    statement (``ON CONFLICT DO NOTHING``) on PostgreSQL and SQLite: two workers claiming the
    same row never see an error, one of them simply gets nothing."""
    name = conn.dialect.name
    if name in ("postgresql", "sqlite"):
        if name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        stmt = insert(table).values(**values).on_conflict_do_nothing(index_elements=[key])
        return conn.execute(stmt).rowcount == 1
    exists = conn.execute(sa.select(table.c[key]).where(table.c[key] == values[key])).first()
    if exists is not None:
        return False
    conn.execute(sa.insert(table).values(**values))
    return True

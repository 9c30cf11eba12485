"""The tuning store: records in and out of a SQL database through SQLAlchemy."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timezone
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, OperationalError

from ..problem import DeviceInfo, Problem
from ._engine import make_engine, resolve_url, safe_url, sqlite_file, write_connection
from ._models import Measurement
from ._records import Record, RecordError
from ._schema import KEY_COLUMNS, SCHEMA_VERSION, ensure_schema, record_columns, stored_version

__all__ = ["RowError", "Store", "StoreMissingError", "open_error_text", "with_retry"]

T = TypeVar("T")

_PROBLEM_COLUMNS = ("op", "dtype", "batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim",
                    "causal", "allow_fp16_accum", *KEY_COLUMNS)


#: the oldest schema whose records table this code reads as it is (schema 3 added a table)
READABLE_FROM = 2


class StoreMissingError(FileNotFoundError):
    """The store does not exist and was not to be created."""


@dataclass(frozen=True)
class RowError:
    """A stored row that is not a valid record (written by hand, or damaged)."""

    row: int
    uid: str
    message: str

    def __str__(self) -> str:
        return f"row id {self.row} (uid {self.uid}): {self.message}"


def _is_transient(exc: BaseException) -> bool:
    """A lock or busy error that is worth retrying (SQLite's busy timeout already waited)."""
    text = str(getattr(exc, "orig", exc)).lower()
    return "locked" in text or "busy" in text


def with_retry(fn: Callable[[], T], deadline_s: float) -> T:
    """``fn()``, called again (with a growing pause) while it fails because the database is
    locked or busy, for up to ``deadline_s`` seconds."""
    deadline = time.monotonic() + deadline_s
    delay = 0.01
    while True:
        try:
            return fn()
        except OperationalError as e:
            if not _is_transient(e) or time.monotonic() > deadline:
                raise
        time.sleep(delay * (1 + random.random()))
        delay = min(delay * 2, 0.5)


def _row_values(r: Record) -> dict[str, Any]:
    p, d = r.problem, r.device
    values: dict[str, Any] = {c: getattr(p, c) for c in _PROBLEM_COLUMNS}
    values.update(
        uid=r.uid,
        device_name=d.name,
        cc_major=d.capability[0],
        cc_minor=d.capability[1],
        sm_count=d.sm_count,
        driver=d.driver,
        cuda=d.cuda,
        build_id=r.build_id,
        backend=r.backend,
        config=r.config,
        status=r.status,
        median_ms=r.median_ms,
        min_ms=r.min_ms,
        max_ms=r.max_ms,
        q1_ms=r.q1_ms,
        q3_ms=r.q3_ms,
        floor_ms=r.floor_ms,
        runs=r.runs,
        tflops=r.tflops,
        error=r.error,
        error_limit=r.error_limit,
        message=r.message,
        host=r.host,
        measured_at=r.measured_at,
        version=r.version,
        torch_version=r.torch_version,
    )
    return values


def _to_record(m: Any, source: str) -> Record:
    """A record from a result row (attribute access by column name)."""
    when = m.measured_at
    if when.tzinfo is None:  # SQLite keeps no zone; we always write UTC
        when = when.replace(tzinfo=timezone.utc)
    return Record(
        # a store read as schema < 5 (< 6) has no feature (decode) columns: its rows are "off"
        problem=Problem(**{c: getattr(m, c, KEY_COLUMNS.get(c)) for c in _PROBLEM_COLUMNS}),
        device=DeviceInfo(
            name=m.device_name,
            capability=(m.cc_major, m.cc_minor),
            sm_count=m.sm_count,
            driver=m.driver,
            cuda=m.cuda,
        ),
        build_id=m.build_id,
        backend=m.backend,
        config=m.config,
        status=m.status,
        median_ms=m.median_ms,
        min_ms=m.min_ms,
        max_ms=m.max_ms,
        q1_ms=m.q1_ms,
        q3_ms=m.q3_ms,
        floor_ms=getattr(m, "floor_ms", None),  # absent from a store read as schema 2 or 3
        runs=m.runs,
        tflops=m.tflops,
        error=m.error,
        error_limit=m.error_limit,
        message=m.message,
        host=m.host,
        measured_at=when,
        version=m.version,
        torch_version=m.torch_version,
        uid=m.uid,
        source=source,
    )


class Store:
    """A tuning store at ``url`` (None: ``$SPARKTUNE_DB`` or the default SQLite file).

    ``create``: make the tables when the database has none (and the SQLite file when it does
    not exist); ``upgrade``: bring an older schema up to date; ``readonly``: change nothing,
    only read (a source of ``db merge``). ``timeout`` (seconds) bounds waiting for locks and
    connections; ``statement_timeout`` (PostgreSQL) bounds every statement.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | URL | None = None,
        *,
        create: bool = True,
        upgrade: bool = True,
        timeout: float = 30.0,
        statement_timeout: float | None = None,
        readonly: bool = False,
    ) -> None:
        self.url = resolve_url(url)
        self.display_url = safe_url(self.url)
        self.timeout = timeout
        path = sqlite_file(self.url)
        if path is not None and not create and not path.exists():
            raise StoreMissingError(f"no tuning database at {path}")
        self.engine = make_engine(self.url, timeout=timeout, create_dir=create, statement_timeout=statement_timeout)
        try:
            if readonly:
                self.version = with_retry(lambda: self._readable_version(), timeout)
            else:
                self.version = with_retry(
                    lambda: ensure_schema(self.engine, where=self.display_url, create=create, upgrade=upgrade),
                    timeout,
                )
        except BaseException:
            self.engine.dispose()
            raise

    def _readable_version(self) -> int | None:
        """The schema version of a store opened read-only: never changed; refused when its
        records cannot be read by this code (older than :data:`READABLE_FROM`, or newer)."""
        from ._schema import SchemaOutdatedError, _check_not_newer

        with self.engine.connect() as conn, conn.begin():
            version = stored_version(conn)
        _check_not_newer(version, self.display_url)
        if version is not None and version < READABLE_FROM:
            raise SchemaOutdatedError(
                f"{self.display_url} has tuning-store schema version {version}; it is read without "
                f"changes here, which needs version {READABLE_FROM} or later: run `sparktune db upgrade` on it"
            )
        return version

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.display_url!r}, schema={self.version})"

    @property
    def exists(self) -> bool:
        """Whether the database has sparktune tables."""
        return self.version is not None

    # ------------------------------------------------------------------ writing

    def add(self, records: Iterable[Record]) -> int:
        """Insert records in one transaction; records whose uid is already stored are
        skipped. Returns how many were inserted."""
        records = list(records)
        if not records or self.version is None:
            if records:
                raise StoreMissingError(f"{self.display_url} has no sparktune tables")
            return 0

        def run() -> int:
            with write_connection(self.engine) as conn, conn.begin():
                return self.insert(conn, records)

        return with_retry(run, self.timeout)

    def insert(self, conn: sa.Connection, records: Iterable[Record]) -> int:
        """Insert records inside the caller's write transaction (see :meth:`add`)."""
        rows = [_row_values(r) for r in records]
        existing = self._existing_uids(conn, [r["uid"] for r in rows])
        fresh: dict[str, dict[str, Any]] = {}
        for r in rows:
            if r["uid"] not in existing:
                fresh.setdefault(r["uid"], r)
        if fresh:
            conn.execute(sa.insert(Measurement), list(fresh.values()))
        return len(fresh)

    @staticmethod
    def _existing_uids(conn: sa.Connection, uids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for i in range(0, len(uids), 500):
            chunk = uids[i : i + 500]
            found.update(conn.execute(sa.select(Measurement.uid).where(Measurement.uid.in_(chunk))).scalars())
        return found

    # ------------------------------------------------------------------ reading

    def records(
        self,
        *,
        problem: Problem | None = None,
        device: DeviceInfo | None = None,
        build_id: str | None = None,
        status: str | None = None,
        where: dict[str, Any] | None = None,
        errors: list[RowError] | None = None,
    ) -> list[Record]:
        """Stored records, oldest first. ``device`` matches the GPU model (name, compute
        capability, SM count), not the driver; ``where`` maps column names to values.

        A row that is not a valid record (e.g. heads that do not divide, an unknown status)
        raises :class:`RecordError` naming its row; with ``errors``, such rows are left out and
        reported there instead, and the valid ones are returned."""
        if self.version is None:
            return []
        columns = record_columns(self.version)
        stmt = sa.select(*columns)
        if problem is not None:
            present = {c.name for c in columns}
            for c in _PROBLEM_COLUMNS:
                if c in present:
                    stmt = stmt.where(getattr(Measurement, c) == getattr(problem, c))
                elif getattr(problem, c) != KEY_COLUMNS[c]:
                    return []  # a store without the feature columns has no such record
        if device is not None:
            stmt = stmt.where(
                Measurement.device_name == device.name,
                Measurement.cc_major == device.capability[0],
                Measurement.cc_minor == device.capability[1],
                Measurement.sm_count == device.sm_count,
            )
        if build_id is not None:
            stmt = stmt.where(Measurement.build_id == build_id)
        if status is not None:
            stmt = stmt.where(Measurement.status == status)
        for col, value in (where or {}).items():
            if col not in Measurement.__table__.c:
                raise KeyError(f"no column {col!r} in the tuning store")
            stmt = stmt.where(Measurement.__table__.c[col] == value)
        stmt = stmt.order_by(Measurement.measured_at, Measurement.id)

        def run() -> tuple[list[Record], list[RowError]]:
            good: list[Record] = []
            bad: list[RowError] = []
            with self.engine.connect() as conn, conn.begin():
                for row in conn.execute(stmt):
                    try:
                        good.append(_to_record(row, self.display_url))
                    except (ValueError, TypeError, AttributeError) as exc:
                        bad.append(RowError(row.id, str(row.uid), f"{type(exc).__name__}: {exc}"))
            return good, bad

        good, bad = with_retry(run, self.timeout)
        if bad:
            if errors is None:
                more = f" (and {len(bad) - 1} more invalid row(s))" if len(bad) > 1 else ""
                raise RecordError("", f"{self.display_url}: {bad[0]}{more}")
            errors.extend(bad)
        return good

    def count(self) -> int:
        if self.version is None:
            return 0
        with self.engine.connect() as conn, conn.begin():
            return int(conn.execute(sa.select(sa.func.count()).select_from(Measurement)).scalar_one())

    @classmethod
    def upgrade_database(cls, url: str | os.PathLike[str] | URL | None = None, *, timeout: float = 30.0) -> tuple[int | None, int]:
        """Create or upgrade the store at ``url``; returns (version before, version after)."""
        resolved = resolve_url(url)
        engine = make_engine(resolved, timeout=timeout)
        try:
            with engine.connect() as conn, conn.begin():
                before = stored_version(conn)
            after = with_retry(lambda: ensure_schema(engine, where=safe_url(resolved)), timeout)
        finally:
            engine.dispose()
        return before, int(after or SCHEMA_VERSION)


def open_error_text(exc: BaseException, url: object = None) -> str:
    """One line describing why a store could not be used (no traceback; the password of
    ``url`` -- None: ``$SPARKTUNE_DB`` -- is hidden even where a driver quotes it)."""
    from ._engine import scrub
    from ._schema import SchemaError

    # a library's wrapper (e.g. Optuna's StorageInternalError) says less than the driver error
    # it was raised from
    inner: BaseException | None = exc
    seen: set[int] = set()
    while inner is not None and not isinstance(inner, DBAPIError) and id(inner) not in seen:
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    if not isinstance(inner, DBAPIError):
        inner = None
    if inner is not None and not isinstance(exc, (SchemaError, StoreMissingError)):
        exc = inner
    if isinstance(exc, (SchemaError, StoreMissingError)):
        text = str(exc)
    elif isinstance(exc, DBAPIError) and exc.orig is not None:
        lines = str(exc.orig).strip().splitlines()
        text = f"{type(exc.orig).__name__}: {lines[0] if lines else ''}"
    else:
        lines = str(exc).strip().splitlines()
        text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return scrub(text, url)

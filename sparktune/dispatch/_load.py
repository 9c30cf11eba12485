"""The records a device and kernel build see, layer by layer, and where they came from.

Layers, most specific first: the user's (or shared) database -- or, when a shared server does
not answer, dispatch's local snapshot of it (:mod:`._snapshot`) -- then the read-only files
shipped in ``tuning_db/`` (one JSON Lines file per GPU model): their records of this build of
the kernel family, then those of other builds (measured before configurations were added to
or removed from the declared space; used for the candidates this build still has). :func:`load_records` reads them
all once; dispatch, ``sparktune bench`` and ``sparktune db`` call it, each with its own
timeouts and its own way of reporting what could not be read.

Nothing here raises for a database that is missing, locked, damaged or unreachable, or for
shipped files that cannot be read: what went wrong is in the result (``error``,
``invalid_rows``, ``shipped_error``, ``shipped_errors``) and, worded for dispatch's log, in
its ``notices``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..db import (
    ENV_DB,
    LineError,
    Record,
    RowError,
    Store,
    StoreMissingError,
    is_network,
    open_error_text,
    resolve_url,
    safe_url,
)
from ..problem import DeviceInfo, Problem
from ._ranking import layered, load_shipped, shipped_dir
from ._snapshot import Snapshot, read_snapshot, snapshot_path, write_snapshot

__all__ = ["ENV_SNAPSHOT_TTL", "LoadedRecords", "Notice", "load_records"]

#: environment: use a snapshot younger than this many seconds without asking the server
ENV_SNAPSHOT_TTL = "SPARKTUNE_SNAPSHOT_TTL"


@dataclass(frozen=True)
class Notice:
    """Something the reader should be told once per process (``key`` names it), worded for
    dispatch's log."""

    key: str
    message: str
    level: int = logging.WARNING


@dataclass
class LoadedRecords:
    """What :func:`load_records` read: the two layers and a description of their sources."""

    #: the device model and kernel build read for (None: every one)
    device: DeviceInfo | None
    build: str | None
    #: the database, as shown (any password hidden)
    database: str
    #: how the database layer was read, as dispatch shows it: the database, "(not created
    #: yet)", or the snapshot used in its place
    where: str
    #: the database layer: its records (or its snapshot's)
    stored: list[Record] = field(default_factory=list)
    #: the shipped layer: the shipped records of this device model and build
    shipped: list[Record] = field(default_factory=list)
    #: the shipped records of this device model measured with another build of the kernel
    #: family (a space that declared other configurations): the last layer, for problems that
    #: no record of this build reaches; a record whose kernel this build lacks is passed over
    shipped_earlier: list[Record] = field(default_factory=list)
    #: why the database could not be read ("" when it was); a database that does not exist
    #: is an error only when it was named (``db=`` or ``$SPARKTUNE_DB``)
    error: str = ""
    #: the database does not exist (no SQLite file)
    missing: bool = False
    #: the database was opened (an error after that is one of reading)
    opened: bool = False
    #: its schema version (None: no sparktune tables yet, or not opened)
    schema: int | None = None
    #: the snapshot read in place of the database server
    snapshot: Snapshot | None = None
    #: stored rows that are not valid records (left out)
    invalid_rows: list[RowError] = field(default_factory=list)
    #: the directory of the shipped files
    shipped_dir: Path | None = None
    #: how many shipped files have records (of any device)
    shipped_files: int = 0
    #: invalid lines of the shipped files (left out)
    shipped_errors: list[LineError] = field(default_factory=list)
    #: why the shipped files could not be read at all ("" when they were)
    shipped_error: str = ""
    #: what dispatch logs (once per process and key)
    notices: list[Notice] = field(default_factory=list)

    @property
    def sources(self) -> list[str]:
        """Where the records were read from, most specific first, in words."""
        return [self.where] + ([f"{self.shipped_files} shipped file(s)"] if self.shipped_files else [])

    def ranked(self) -> dict[Problem, list[Record]]:
        """The usable records per problem, fastest first: a problem takes the first layer that
        has it (see :func:`~sparktune.dispatch.layered`)."""
        return layered([self.stored, self.shipped, self.shipped_earlier], self.device)

    def _notice(self, key: str, message: str, level: int = logging.WARNING) -> None:
        self.notices.append(Notice(key, message, level))


def load_records(
    device: DeviceInfo | None = None,
    build: str | None = None,
    *,
    db: Any = None,
    shipped: bool = True,
    snapshot: bool = False,
    timeout: float = 30.0,
    statement_timeout: float | None = None,
) -> LoadedRecords:
    """The records of ``device``'s GPU model and kernel ``build`` (None: of every one) in the
    database ``db`` (a URL or SQLite path; None: ``$SPARKTUNE_DB`` or the default file) and,
    with ``shipped``, in the shipped files.

    The database is opened as dispatch opens it: never created, an older schema brought up to
    date, ``timeout`` bounding the wait for locks and connections, ``statement_timeout``
    (PostgreSQL) every statement. With ``snapshot`` (and a device and build), a database
    server is read through a local snapshot: what was read is written to it, a snapshot
    younger than ``$SPARKTUNE_SNAPSHOT_TTL`` seconds is used without asking the server, and
    the snapshot is used when the server does not answer."""
    out = LoadedRecords(device, build, safe_url(db), safe_url(db))
    _read_database(out, db, snapshot=snapshot, timeout=timeout, statement_timeout=statement_timeout)
    if shipped:
        _read_shipped(out)
    return out


def _snapshot_ttl(out: LoadedRecords) -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_SNAPSHOT_TTL) or 0))
    except ValueError:
        out._notice("ttl", f"sparktune: ${ENV_SNAPSHOT_TTL} is not a number of seconds; ignored")
        return 0.0


def _snapshot_text(snap: Snapshot) -> str:
    return f"snapshot taken {snap.taken_at:%Y-%m-%d %H:%M} UTC, {len(snap.records)} record(s), {snap.path}"


def _read_database(
    out: LoadedRecords, db: Any, *, snapshot: bool, timeout: float, statement_timeout: float | None
) -> None:
    device, build, where = out.device, out.build, out.database
    explicit = db is not None or bool(os.environ.get(ENV_DB))
    snap_path = None
    try:
        url = resolve_url(db)
        if snapshot and device is not None and build is not None and is_network(url):
            snap_path = snapshot_path(url, device, build)
            ttl = _snapshot_ttl(out)
            if ttl > 0:
                try:
                    if time.time() - snap_path.stat().st_mtime < ttl:
                        snap = read_snapshot(snap_path)
                        out.stored, out.snapshot = snap.records, snap
                        out.where = f"{where} ({_snapshot_text(snap)}, younger than ${ENV_SNAPSHOT_TTL})"
                        return
                except (OSError, ValueError):
                    pass  # no usable snapshot: ask the server
        invalid: list[RowError] = []
        with Store(url, create=False, upgrade=True, timeout=timeout, statement_timeout=statement_timeout) as store:
            out.opened, out.schema = True, store.version
            records, shown = store.records(device=device, build_id=build, errors=invalid), store.display_url
        if invalid:
            out.invalid_rows = invalid
            out._notice(
                f"rows:{shown}",
                f"sparktune: {len(invalid)} invalid row(s) in the tuning database {shown} were ignored "
                f"(the other records are used), first: {invalid[0]}",
            )
    except StoreMissingError as exc:
        out.missing = True
        if explicit:
            out.error = str(exc)
            out._notice(f"db:{where}", f"sparktune: {exc}; using the default kernels")
        else:
            out.where = f"{where} (not created yet)"
        return
    except Exception as exc:  # noqa: BLE001 - a broken database must never reach the caller
        text = out.error = open_error_text(exc, db)
        if snap_path is not None:
            try:
                snap = read_snapshot(snap_path)
            except FileNotFoundError:
                snap = None
            except (OSError, ValueError) as bad:
                snap = None
                out._notice("snapshot-read", f"sparktune: ignoring a damaged snapshot: {bad}")
            if snap is not None:
                out._notice(
                    f"db:{where}",
                    f"sparktune: cannot reach the tuning database {where}: {text}; using its local "
                    f"snapshot ({_snapshot_text(snap)})",
                )
                out.stored, out.snapshot = snap.records, snap
                out.where = f"{where} unreachable: {_snapshot_text(snap)}"
                return
        out._notice(
            f"db:{where}",
            f"sparktune: cannot read the tuning database {where}: {text}; using the default "
            "kernels (tuned choices are ignored until this is fixed)",
        )
        return
    out.stored, out.where = records, shown
    if snap_path is not None and device is not None and build is not None:
        try:
            write_snapshot(snap_path, records, database=shown, device=device, build_id=build)
        except (OSError, ValueError) as exc:  # a read-only cache costs only the fallback
            out._notice("snapshot-write", f"sparktune: cannot write the snapshot {snap_path}: {exc}", logging.INFO)


def _read_shipped(out: LoadedRecords) -> None:
    try:
        out.shipped_dir = shipped_dir()
        records, bad = load_shipped(out.shipped_dir)
    except Exception as exc:  # noqa: BLE001
        records, bad = [], []
        out.shipped_error = str(exc)
        out._notice("shipped", f"sparktune: cannot read the shipped tuning files: {exc}")
    if bad:
        out.shipped_errors = bad
        out._notice(
            "shipped-lines",
            f"sparktune: {len(bad)} invalid line(s) in the shipped tuning files were ignored, first: {bad[0]}",
        )
    d, b = out.device, out.build
    model = [
        r
        for r in records
        if d is None or (r.device.name, r.device.capability, r.device.sm_count) == (d.name, d.capability, d.sm_count)
    ]
    out.shipped = [r for r in model if b is None or r.build_id == b]
    out.shipped_earlier = [r for r in model if b is not None and r.build_id != b]
    out.shipped_files = len({r.source for r in records})
    for r in out.shipped_earlier:
        r.source = f"{r.source} (kernel build {r.build_id})"

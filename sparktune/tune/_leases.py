"""Leases: how tuning workers on many processes and hosts divide work through the database.

A unit of work (one problem on one device fingerprint and kernel build, in a named run) is
claimed before it is tuned: the claim inserts a row in ``sparktune_leases`` -- or takes over a
row whose lease expired -- in one transaction, so two workers never hold the same work. The
holder renews the lease by heartbeat. Finishing commits the work's records and marks the row
``done`` in one transaction, and only while the lease is still the holder's: a worker that
stalled past its lease and was replaced can no longer commit, so a problem's records are
written exactly once. Every time is the database server's clock.

States: ``running`` (held, or abandoned once ``expires_at`` has passed), ``done`` (never
claimed again in the run), ``failed`` (tuning could not go on, e.g. the GPU failed; claimed
again only when asked).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from ..db import Lease, Record, Store, insert_ignore, server_time, with_retry, write_connection

__all__ = ["Claim", "LeaseBoard", "LeaseInfo", "LeaseLost", "new_owner_id", "work_id"]

LEASE_STATES = ("running", "done", "failed")


class LeaseLost(RuntimeError):
    """The worker no longer holds the lease of the work it is doing (it stalled past the lease
    and another worker took the work over)."""


def work_id(run: str, label: str) -> str:
    """The lease key of a unit of work: a hash of the run name and the work's label."""
    return hashlib.sha1(f"{run}\n{label}".encode()).hexdigest()


def new_owner_id() -> str:
    """A worker id, unique across hosts and processes: ``host:pid:random``."""
    try:
        host = socket.gethostname()
    except OSError:  # pragma: no cover
        host = "?"
    return f"{host}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True)
class LeaseInfo:
    """One row of the lease table."""

    work: str
    run: str
    label: str
    owner: str
    state: str
    attempts: int
    claimed_at: float
    heartbeat_at: float
    expires_at: float
    finished_at: float | None
    records: int
    message: str

    def expired(self, now: float) -> bool:
        return self.state == "running" and self.expires_at <= now


@dataclass(frozen=True)
class Claim:
    """A lease just obtained. ``previous_owner`` is the worker it was taken from ("" for new
    work); ``attempt`` counts the claims of the work, this one included."""

    work: str
    label: str
    attempt: int
    previous_owner: str = ""
    previous_state: str = ""


def _info(row: Any) -> LeaseInfo:
    return LeaseInfo(
        row.work, row.run, row.label, row.owner, row.state, row.attempts, row.claimed_at, row.heartbeat_at,
        row.expires_at, row.finished_at, row.records, row.message,
    )


class LeaseBoard:
    """The lease table of a store, seen by one worker (``owner``). ``lease_s``: how long a
    claim or a heartbeat keeps the work the worker's.

    Each method is one transaction and may be repeated after a connection error (a claim or a
    finish that did commit before the connection dropped is recognised as this worker's)."""

    def __init__(self, store: Store, *, owner: str | None = None, lease_s: float = 60.0) -> None:
        if lease_s <= 0:
            raise ValueError(f"the lease must be positive, got {lease_s!r} s")
        self.store = store
        self.owner = owner or new_owner_id()
        self.lease_s = float(lease_s)
        self._table = Lease.__table__

    def _write(self, fn: Any) -> Any:
        def run() -> Any:
            with write_connection(self.store.engine) as conn, conn.begin():
                return fn(conn)

        return with_retry(run, self.store.timeout)

    def _row(self, conn: sa.Connection, work: str, *, lock: bool = False) -> Any:
        stmt = sa.select(self._table).where(self._table.c.work == work)
        if lock:
            stmt = stmt.with_for_update()
        return conn.execute(stmt).first()

    # ------------------------------------------------------------------ reading

    def now(self) -> float:
        with self.store.engine.connect() as conn:
            return server_time(conn)

    def get(self, work: str) -> LeaseInfo | None:
        with self.store.engine.connect() as conn, conn.begin():
            row = self._row(conn, work)
        return _info(row) if row is not None else None

    def rows(self, run: str | None = None) -> list[LeaseInfo]:
        stmt = sa.select(self._table).order_by(self._table.c.run, self._table.c.label)
        if run is not None:
            stmt = stmt.where(self._table.c.run == run)
        with self.store.engine.connect() as conn, conn.begin():
            return [_info(r) for r in conn.execute(stmt)]

    # ------------------------------------------------------------------ writing

    def claim(self, work: str, label: str, *, run: str = "", retry_failed: bool = False) -> Claim | None:
        """Claim ``work``: new work, work whose lease expired, or (``retry_failed``) work that
        failed. None when it is done, failed, or held by a live lease of another worker."""

        def txn(conn: sa.Connection) -> Claim | None:
            now = server_time(conn)
            fresh = {
                "owner": self.owner, "state": "running", "claimed_at": now, "heartbeat_at": now,
                "expires_at": now + self.lease_s, "finished_at": None, "records": 0, "message": "",
            }
            if insert_ignore(conn, self._table, {"work": work, "run": run, "label": label, "attempts": 1, **fresh}, "work"):
                return Claim(work, label, 1)
            row = self._row(conn, work, lock=True)
            if row is None:  # deleted meanwhile: try again on the next pass
                return None
            if row.owner == self.owner and row.state == "running":
                return Claim(work, label, row.attempts)  # ours already (a repeated claim)
            if row.state == "done" or (row.state == "failed" and not retry_failed):
                return None
            if row.state == "running" and row.expires_at > now:
                return None
            t = self._table
            taken = conn.execute(
                sa.update(t)
                .where(t.c.work == work, t.c.owner == row.owner, t.c.state == row.state, t.c.attempts == row.attempts)
                .values(attempts=row.attempts + 1, **fresh)
            ).rowcount
            return Claim(work, label, row.attempts + 1, row.owner, row.state) if taken == 1 else None

        return self._write(txn)

    def renew(self, work: str) -> bool:
        """Extend the lease (the heartbeat); False when it is no longer this worker's."""

        def txn(conn: sa.Connection) -> bool:
            now = server_time(conn)
            t = self._table
            return (
                conn.execute(
                    sa.update(t)
                    .where(t.c.work == work, t.c.owner == self.owner, t.c.state == "running")
                    .values(heartbeat_at=now, expires_at=now + self.lease_s)
                ).rowcount
                == 1
            )

        return self._write(txn)

    def finish(self, work: str, records: Iterable[Record] = (), *, failed: bool = False, message: str = "") -> bool:
        """Commit the work's records and mark it done (or failed) in one transaction, only
        while the lease is this worker's. False (nothing written) when it is not."""
        records = list(records)
        state = "failed" if failed else "done"

        def txn(conn: sa.Connection) -> bool:
            now = server_time(conn)
            t = self._table
            updated = conn.execute(
                sa.update(t)
                .where(t.c.work == work, t.c.owner == self.owner, t.c.state == "running")
                .values(state=state, finished_at=now, expires_at=now, records=len(records), message=message[:2000])
            ).rowcount
            if updated != 1:
                row = self._row(conn, work)
                # a finish repeated after a dropped connection had committed already
                return row is not None and row.owner == self.owner and row.state == state
            self.store.insert(conn, records)
            return True

        return self._write(txn)

    def release(self, work: str, message: str = "released") -> None:
        """Give the work up unfinished: the lease expires now, so another worker (or a rerun)
        may claim it at once."""

        def txn(conn: sa.Connection) -> None:
            now = server_time(conn)
            t = self._table
            conn.execute(
                sa.update(t)
                .where(t.c.work == work, t.c.owner == self.owner, t.c.state == "running")
                .values(expires_at=now, message=message[:2000])
            )

        self._write(txn)

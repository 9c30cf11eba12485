"""The lease table: claims, expiry and takeover, finishing only while the lease is held,
release, failed work; schema 3 and the upgrade from 2; many claimants at once on PostgreSQL."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from sparktune import db
from sparktune.db import Store
from sparktune.db._schema import KEY_COLUMNS
from sparktune.tune import LeaseBoard, new_owner_id
from tests._pg import pg_url  # noqa: F401 - fixture
from tests._store_helpers import ServerClock, problem, record


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = Store(tmp_path / "leases.sqlite3")
    else:
        s = Store(request.getfixturevalue("pg_url"))
    yield s
    s.close()


def test_claim_expire_takeover_finish(store, monkeypatch):
    clock = ServerClock(monkeypatch)  # the lease table's clock moves only when told
    a = LeaseBoard(store, owner="host-a:1:aa", lease_s=0.5)
    b = LeaseBoard(store, owner="host-b:2:bb", lease_s=0.5)
    c = a.claim("w1", "problem one", run="r")
    assert (c.attempt, c.previous_owner) == (1, "")
    assert a.claim("w1", "problem one", run="r") == c  # repeated (e.g. after a dropped connection)
    assert b.claim("w1", "problem one", run="r") is None  # held
    clock.advance(0.4)
    assert a.renew("w1")  # the heartbeat: 0.5 s more from now
    clock.advance(0.4)
    assert b.claim("w1", "problem one", run="r") is None  # renewed: still held
    assert b.get("w1").expires_at == pytest.approx(clock.now + 0.1)
    clock.advance(0.2)  # a stops renewing: the lease expires
    info = b.get("w1")
    assert info.expired(b.now()) and info.owner == a.owner
    t = b.claim("w1", "problem one", run="r")
    assert (t.attempt, t.previous_owner, t.previous_state) == (2, a.owner, "running")
    # the old holder can neither renew nor commit: its results are discarded
    assert not a.renew("w1")
    assert a.finish("w1", [record()]) is False
    assert store.count() == 0
    recs = [record(problem(), config=c) for c in ("fast", "slow")]
    assert b.finish("w1", recs) is True
    assert b.finish("w1", recs) is True  # a repeated finish (the first committed) is recognised
    assert store.count() == 2
    row = b.get("w1")
    assert (row.state, row.owner, row.attempts, row.records, row.run) == ("done", b.owner, 2, 2, "r")
    # done work is never claimed again
    assert a.claim("w1", "problem one", run="r") is None
    assert LeaseBoard(store, lease_s=60).claim("w1", "problem one", run="r") is None


def test_release_and_failed_work(store):
    a = LeaseBoard(store, owner="a:1:x", lease_s=60)
    b = LeaseBoard(store, owner="b:2:y", lease_s=60)
    a.claim("w", "work")
    a.release("w", "released: interrupted")
    t = b.claim("w", "work")
    assert t is not None and t.previous_owner == a.owner
    assert b.finish("w", [record()], failed=True, message="the CUDA context is unusable")
    assert store.count() == 1  # a failure's measurements are kept
    assert a.claim("w", "work") is None
    again = a.claim("w", "work", retry_failed=True)
    assert again.previous_state == "failed" and again.attempt == 3
    rows = a.rows()
    assert [(r.state, r.owner) for r in rows] == [("running", a.owner)]


def test_lease_must_be_positive(store):
    with pytest.raises(ValueError, match="positive"):
        LeaseBoard(store, lease_s=0)


def test_owner_ids_are_unique():
    ids = {new_owner_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.count(":") == 2 for i in ids)


def test_many_claimants_at_once_one_wins(pg_url):  # noqa: F811
    """Sixteen threads, each with its own connection pool, claim the same work at the same
    moment: exactly one gets it, and no one sees an error."""
    stores = [Store(pg_url) for _ in range(16)]
    try:
        boards = [LeaseBoard(s, lease_s=60) for s in stores]
        go = threading.Barrier(len(boards))
        got, errors = [], []

        def claim(board):
            go.wait()
            try:
                got.append(board.claim("same", "the same work"))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=claim, args=(b,)) for b in boards]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sum(c is not None for c in got) == 1
    finally:
        for s in stores:
            s.close()


def test_schema_2_is_upgraded_with_the_lease_table(tmp_path):
    path = tmp_path / "v2.sqlite3"
    Store(path).close()
    con = sqlite3.connect(path)
    con.execute("DROP TABLE sparktune_leases")
    con.execute("ALTER TABLE sparktune_records DROP COLUMN floor_ms")  # schema 4's
    for name in KEY_COLUMNS:  # schemas 5 and 6
        con.execute(f"ALTER TABLE sparktune_records DROP COLUMN {name}")
    con.execute("UPDATE sparktune_meta SET value='2' WHERE key='schema_version'")
    con.commit()
    con.close()
    with Store(path, readonly=True) as s:  # read as it is, not changed
        assert s.version == 2 and s.records() == []
    with Store(path) as s:
        assert s.version == db.SCHEMA_VERSION == 6
        assert LeaseBoard(s).claim("w", "x") is not None

"""Schema versions: a fresh store, an upgrade from version 1, a newer store refused."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa

from sparktune import db
from sparktune.db import SCHEMA_VERSION, SchemaOutdatedError, SchemaTooNewError, Store
from sparktune.db._schema import DECODE_COLUMNS, KEY_COLUMNS
from sparktune.problem import Problem
from tests._store_helpers import record

# The tables exactly as schema version 1 created them on SQLite (sparktune's first store).
SCHEMA_V1 = """
CREATE TABLE sparktune_meta (
    "key" VARCHAR(64) NOT NULL,
    value VARCHAR(255) NOT NULL,
    PRIMARY KEY ("key")
);
CREATE TABLE sparktune_records (
    id INTEGER NOT NULL, uid VARCHAR(64) NOT NULL,
    op VARCHAR(8) NOT NULL, dtype VARCHAR(16) NOT NULL, batch INTEGER NOT NULL,
    heads_q INTEGER NOT NULL, heads_kv INTEGER NOT NULL, seqlen_q INTEGER NOT NULL,
    seqlen_k INTEGER NOT NULL, head_dim INTEGER NOT NULL, causal BOOLEAN NOT NULL,
    allow_fp16_accum BOOLEAN NOT NULL, device_name VARCHAR(128) NOT NULL,
    cc_major INTEGER NOT NULL, cc_minor INTEGER NOT NULL, sm_count INTEGER NOT NULL,
    driver VARCHAR(64) NOT NULL, cuda VARCHAR(32) NOT NULL, build_id VARCHAR(64) NOT NULL,
    backend VARCHAR(64) NOT NULL, config VARCHAR(255) NOT NULL, status VARCHAR(16) NOT NULL,
    median_ms FLOAT, min_ms FLOAT, max_ms FLOAT, runs INTEGER NOT NULL, tflops FLOAT,
    error FLOAT, message TEXT NOT NULL, host VARCHAR(255) NOT NULL,
    measured_at DATETIME NOT NULL, version VARCHAR(32) NOT NULL,
    PRIMARY KEY (id), UNIQUE (uid)
);
CREATE INDEX ix_sparktune_records_device
    ON sparktune_records (device_name, cc_major, cc_minor, sm_count, build_id);
CREATE INDEX ix_sparktune_records_problem
    ON sparktune_records (op, dtype, head_dim, seqlen_q, seqlen_k, batch, heads_q);
INSERT INTO sparktune_meta VALUES ('schema_version', '1');
INSERT INTO sparktune_records VALUES (
    1, 'v1record', 'fwd', 'float16', 1, 12, 12, 8192, 8192, 128, 0, 0, 'Test GPU', 9, 0, 132,
    '580.1', '13.0', 'build-test', 'torch', 'flash', 'ok', 1.5, 1.4, 1.7, 50, 300.0, 0.001, '',
    'oldhost', '2026-01-02 03:04:05.000000', '0.0.1');
"""


def _v1_file(tmp_path):
    path = tmp_path / "v1.sqlite3"
    con = sqlite3.connect(path)
    con.executescript(SCHEMA_V1)
    con.commit()
    con.close()
    return path


def _version(path):
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT value FROM sparktune_meta WHERE key='schema_version'").fetchone()[0]
    finally:
        con.close()


def test_fresh_store_has_current_version(tmp_path):
    s = Store(tmp_path / "new.sqlite3")
    assert s.version == SCHEMA_VERSION
    s.close()
    assert _version(tmp_path / "new.sqlite3") == str(SCHEMA_VERSION)


def test_upgrade_from_v1_keeps_records(tmp_path):
    path = _v1_file(tmp_path)
    with Store(path) as s:  # opening upgrades
        assert s.version == SCHEMA_VERSION
        (r,) = s.records()
        assert (r.uid, r.backend, r.config, r.median_ms, r.host) == ("v1record", "torch", "flash", 1.5, "oldhost")
        assert r.q1_ms is None and r.torch_version == ""
        s.add([record()])  # the new columns are writable
        assert s.count() == 2
    assert _version(path) == str(SCHEMA_VERSION)


def _older_file(tmp_path, version: int, dropped, config: str):
    """A store as schema ``version`` wrote it (without the ``dropped`` columns), with one
    forward record of ``config``."""
    path = tmp_path / f"v{version}.sqlite3"
    with Store(path) as s:
        s.add([record(config=config, median=2.0)])
    con = sqlite3.connect(path)
    for name in dropped:
        con.execute(f"ALTER TABLE sparktune_records DROP COLUMN {name}")
    con.execute(f"UPDATE sparktune_meta SET value='{version}' WHERE key='schema_version'")
    con.commit()
    con.close()
    return path


def _v3_file(tmp_path):
    """A store as schema version 3 wrote it (no burst floor column), with one record."""
    return _older_file(tmp_path, 3, ("floor_ms", *KEY_COLUMNS), "v3")  # KEY_COLUMNS: schemas 5 and 6


def test_schema_3_is_read_as_it_is_and_upgraded_with_the_burst_floor(tmp_path):
    path = _v3_file(tmp_path)
    with Store(path, readonly=True) as s:  # read without the floor column, not changed
        (r,) = s.records()
        assert s.version == 3 and (r.config, r.median_ms, r.q1_ms, r.floor_ms) == ("v3", 2.0, 1.98, None)
    assert _version(path) == "3"
    with pytest.raises(SchemaOutdatedError):
        Store(path, upgrade=False)
    assert Store.upgrade_database(path) == (3, SCHEMA_VERSION)
    with Store(path) as s:
        (old,) = s.records()
        # the stored times are kept as they were: no floor was recorded then
        assert (old.uid, old.median_ms, old.min_ms, old.q1_ms, old.q3_ms, old.max_ms, old.floor_ms) == (
            r.uid, 2.0, r.min_ms, r.q1_ms, r.q3_ms, r.max_ms, None)
        s.add([record(config="v4", floor_ms=0.5, min_ms=None, q1_ms=None, q3_ms=None, max_ms=None)])
        new = next(x for x in s.records() if x.config == "v4")
        assert (new.floor_ms, new.min_ms, new.q1_ms, new.q3_ms, new.max_ms) == (0.5, None, None, None, None)
    con = sqlite3.connect(path)
    cols = [row[1] for row in con.execute("PRAGMA table_info(sparktune_records)")]
    con.close()
    assert cols.count("floor_ms") == 1 and _version(path) == str(SCHEMA_VERSION)


def test_upgrade_not_allowed_says_how(tmp_path):
    path = _v1_file(tmp_path)
    with pytest.raises(SchemaOutdatedError, match="sparktune db upgrade"):
        Store(path, upgrade=False)
    assert _version(path) == "1"


def test_upgrade_database_reports_versions(tmp_path):
    path = _v1_file(tmp_path)
    assert Store.upgrade_database(path) == (1, SCHEMA_VERSION)
    assert Store.upgrade_database(path) == (SCHEMA_VERSION, SCHEMA_VERSION)
    assert Store.upgrade_database(tmp_path / "fresh.sqlite3") == (None, SCHEMA_VERSION)


def test_newer_schema_is_refused_and_untouched(tmp_path):
    path = tmp_path / "future.sqlite3"
    Store(path).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE sparktune_meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    con.execute("CREATE TABLE future_table (x INTEGER)")
    con.commit()
    con.close()
    before = path.read_bytes()
    for attempt in (lambda: Store(path), lambda: Store.upgrade_database(path)):
        with pytest.raises(SchemaTooNewError) as info:
            attempt()
        msg = str(info.value)
        assert f"version {SCHEMA_VERSION + 1}" in msg and "upgrade sparktune" in msg and "untouched" in msg
    assert _version(path) == str(SCHEMA_VERSION + 1)
    assert path.read_bytes() == before


def test_foreign_table_without_meta_is_an_error(tmp_path):
    path = tmp_path / "odd.sqlite3"
    eng = sa.create_engine(f"sqlite:///{path}")
    with eng.begin() as c:
        c.exec_driver_sql("CREATE TABLE sparktune_records (x INTEGER)")
    eng.dispose()
    with pytest.raises(db.SchemaError, match="not written by sparktune"):
        Store(path)


def _v4_file(tmp_path):
    """A store as schema version 4 wrote it (no feature columns), with one record."""
    return _older_file(tmp_path, 4, KEY_COLUMNS, "v4rec")


def test_schema_4_rows_read_as_features_off_before_and_after_the_upgrade(tmp_path):
    path = _v4_file(tmp_path)
    with Store(path, readonly=True) as s:  # read as it is, features off
        (r,) = s.records()
        assert s.version == 4 and r.config == "v4rec" and not r.problem.features
        assert s.records(problem=r.problem) == [r]
        assert s.records(problem=r.problem.replace(softcap=True)) == []
    assert _version(path) == "4"
    assert Store.upgrade_database(path) == (4, SCHEMA_VERSION)
    with Store(path) as s:
        (old,) = s.records()
        assert old.uid == r.uid and old.problem == r.problem and not old.problem.features
        p = r.problem.replace(window_left=128, softcap=True, alibi=True)
        s.add([record(p, config="feat")])
        assert [x.config for x in s.records(problem=p)] == ["feat"]
        assert [x.config for x in s.records(problem=r.problem)] == ["v4rec"]
        (new,) = s.records(problem=p)
        assert new.problem == p and new.problem.features == {"window", "softcap", "alibi"}


def test_upgrade_from_v1_reads_features_off(tmp_path):
    path = _v1_file(tmp_path)
    with Store(path) as s:
        (r,) = s.records()
        assert r.problem == Problem("fwd", "float16", 1, 12, 12, 8192, 8192, 128, False)
        assert r.problem.features == frozenset()


DECODE = Problem("decode", "bfloat16", 8, 32, 8, 1, 8192, 128, True, page_size=256)


def _v5_file(tmp_path):
    """A store as schema version 5 wrote it (no decode columns), with one forward record."""
    return _older_file(tmp_path, 5, DECODE_COLUMNS, "v5rec")


def test_schema_5_is_read_as_it_is_and_upgraded_for_decode_records(tmp_path):
    path = _v5_file(tmp_path)
    with Store(path, readonly=True) as s:  # read as it is: dense rows, no decode records
        (r,) = s.records()
        assert s.version == 5 and r.config == "v5rec" and r.problem.page_size == 0
        assert s.records(problem=r.problem) == [r]
        assert s.records(problem=DECODE) == []
    assert _version(path) == "5"
    assert Store.upgrade_database(path) == (5, SCHEMA_VERSION)
    with Store(path) as s:
        (old,) = s.records()
        assert old.uid == r.uid and old.problem == r.problem
        s.add([record(DECODE, config="tdec_n64_w4s2_x4"),
               record(DECODE.replace(page_size=0, appends=1), config="contig")])
        (dec,) = s.records(problem=DECODE)
        assert dec.problem == DECODE and dec.problem.paged and dec.config == "tdec_n64_w4s2_x4"
        assert [x.config for x in s.records(problem=DECODE.replace(page_size=0, appends=1))] == ["contig"]
        assert [x.config for x in s.records(problem=r.problem)] == ["v5rec"]
    con = sqlite3.connect(path)
    cols = [row[1] for row in con.execute("PRAGMA table_info(sparktune_records)")]
    con.close()
    assert all(cols.count(name) == 1 for name in DECODE_COLUMNS)

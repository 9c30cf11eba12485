"""The tuning store: round trips, filters, ranking and layering, URL handling."""

from __future__ import annotations

import dataclasses
import os

import pytest
import sqlalchemy as sa

from sparktune import db, dispatch
from sparktune.db import Store
from tests._store_helpers import BUILD, DEVICE, OTHER_DEVICE, problem, record


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "t.sqlite3")
    yield s
    s.close()


def _strip(r):
    return dataclasses.replace(r, source="")


def test_round_trip_keeps_every_field(store):
    r = record(message="", tflops=123.5, torch_version="2.13")
    assert store.add([r]) == 1
    (back,) = store.records()
    assert _strip(back) == r
    assert back.measured_at.tzinfo is not None
    assert back.source == store.display_url


def test_duplicates_by_uid_are_skipped(store):
    r = record()
    assert store.add([r, r]) == 1
    assert store.add([r]) == 0
    assert store.count() == 1


def test_every_measured_candidate_is_kept(store):
    p = problem()
    recs = [record(p, config=c, median=m) for c, m in (("fast", 1.0), ("slow", 3.0))]
    recs.append(record(p, config="wrong", status="wrong", message="max error 0.5 > limit 0.002"))
    recs.append(record(p, config="crash", status="failed", message="RuntimeError: boom"))
    store.add(recs)
    assert {r.config for r in store.records(problem=p)} == {"fast", "slow", "wrong", "crash"}
    assert {r.config for r in store.records(status="ok")} == {"fast", "slow"}


def test_filters_by_device_model_build_and_column(store):
    p = problem()
    store.add([
        record(p, config="a"),
        record(p, config="b", device=OTHER_DEVICE),
        record(p, config="c", build="other-build"),
        record(p, config="d", device=dataclasses.replace(DEVICE, driver="999")),
    ])
    assert {r.config for r in store.records(device=DEVICE, build_id=BUILD)} == {"a", "d"}
    assert {r.config for r in store.records(where={"backend": "knowncost", "config": "b"})} == {"b"}
    with pytest.raises(KeyError):
        store.records(where={"nope": 1})


def test_rank_takes_latest_measurement_and_ok_only():
    p = problem()
    recs = [
        record(p, config="fast", median=1.0),
        record(p, config="slow", median=3.0),
        record(p, config="fast", status="wrong"),  # a later re-tune found it wrong
        record(p, config="mid", median=2.0),
        record(p, config="mid", median=2.5),
    ]
    ranked = dispatch.rank(recs, DEVICE)[p]
    assert [(r.config, r.median_ms) for r in ranked] == [("mid", 2.5), ("slow", 3.0)]


def test_rank_prefers_exact_driver():
    p = problem()
    other_driver = dataclasses.replace(DEVICE, driver="123")
    recs = [record(p, config="x", median=1.0, device=other_driver), record(p, config="y", median=2.0)]
    assert [r.config for r in dispatch.rank(recs, DEVICE)[p]] == ["y"]
    # no record with this driver: the GPU model's records are used
    assert [r.config for r in dispatch.rank(recs[:1], DEVICE)[p]] == ["x"]


def test_layers_more_specific_wins():
    p, q = problem(), problem(seqlen_q=512, seqlen_k=512)
    user = [record(p, config="user", median=5.0)]
    shipped = [record(p, config="shipped", median=1.0), record(q, config="shipped", median=1.0)]
    merged = dispatch.layered([user, shipped], DEVICE)
    assert merged[p][0].config == "user"
    assert merged[q][0].config == "shipped"


def test_shipped_layer_reads_jsonl_and_reports_bad_lines(tmp_path, monkeypatch):
    d = tmp_path / "shipped"
    d.mkdir()
    good = db.dumps_record(record())
    (d / "test-gpu.jsonl").write_text(good + "\n{not json\n")
    monkeypatch.setenv(dispatch.ENV_SHIPPED, str(d))
    recs, errors = dispatch.load_shipped()
    assert len(recs) == 1 and recs[0].source == "shipped:test-gpu.jsonl"
    assert len(errors) == 1 and errors[0].line == 2
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    assert dispatch.load_shipped() == ([], [])


def test_url_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv(db.ENV_DB, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert db.resolve_url(None).database == str(tmp_path / "cache" / "sparktune" / "tuning.sqlite3")
    monkeypatch.setenv(db.ENV_DB, "sqlite:////x/y.db")
    assert db.resolve_url(None).database == "/x/y.db"
    assert db.resolve_url("rel.db").database == os.path.abspath("rel.db")
    assert "hunter2" not in db.safe_url("postgresql+psycopg://u:hunter2@h/db")


def test_default_store_is_wal_with_busy_timeout(store):
    with store.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


def test_missing_file_not_created_when_asked(tmp_path):
    with pytest.raises(db.StoreMissingError):
        Store(tmp_path / "none.sqlite3", create=False)
    assert not (tmp_path / "none.sqlite3").exists()


def test_database_without_our_tables(tmp_path):
    path = tmp_path / "other.sqlite3"
    eng = sa.create_engine(f"sqlite:///{path}")
    with eng.begin() as c:
        c.exec_driver_sql("CREATE TABLE unrelated (x INTEGER)")
    eng.dispose()
    s = Store(path, create=False)
    assert not s.exists and s.records() == [] and s.count() == 0
    s.close()


def test_read_only_database_is_readable(tmp_path):
    import sqlite3

    path = tmp_path / "ro.sqlite3"
    with Store(path) as s:
        s.add([record()])
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=DELETE")  # as a shared read-only copy might be
    con.close()
    with Store(f"sqlite:///file:{path}?mode=ro&uri=true", create=False) as s:
        assert len(s.records()) == 1

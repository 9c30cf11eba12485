"""`sparktune db merge`: the faster verified record wins, provenance is kept, other devices'
and builds' records are kept but not dispatched, every record is validated as `db import`
validates a line, sources are never changed."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest

from sparktune import db, dispatch
from sparktune.cli import main
from sparktune.db import Store, merge, problem_key
from sparktune.dispatch import rank
from tests._store_helpers import BUILD, DEVICE, OTHER_DEVICE, problem, record, registered_plugin


@pytest.fixture(autouse=True)
def _plugin(monkeypatch):
    """The known-cost backend registered (the records' backend), no shipped layer."""
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    monkeypatch.setattr(dispatch, "build_id", lambda: BUILD)
    with registered_plugin(None):
        yield


def _jsonl(path, records):
    path.write_text("".join(db.dumps_record(r) + "\n" for r in records))
    return path


def _sqlite(path, records):
    with Store(path) as s:
        s.add(records)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_faster_verified_record_wins_and_provenance_is_kept(tmp_path, capsys):
    p = problem()
    here = record(p, config="fast", median=1.0, host="node-a")
    dest = _sqlite(tmp_path / "dest.sqlite3", [here, record(p, config="slow", median=3.0, host="node-a")])
    # measured earlier on another node: faster for the same candidate; a wrong one that is
    # "faster" still; another problem only the other node tuned
    theirs = record(p, config="fast", median=0.8, host="node-b", version="0.0.other", torch_version="2.99")
    wrong = record(p, config="wrong", status="wrong", host="node-b", message="max abs error 0.5")
    q = problem(seqlen_q=512, seqlen_k=512)
    other = record(q, config="medium", median=2.0, host="node-b")
    src = _jsonl(tmp_path / "node-b.jsonl", [theirs, wrong, other])
    code, out, err = run(capsys, "db", "merge", "--db", str(dest), str(src))
    assert code == 0, err
    assert f"{src}: 3 read, 3 new, 0 already there" in out
    assert "best record changed for 2 problem(s)" in out
    assert "knowncost:fast 1 ms (host node-a" in out and "knowncost:fast 0.8 ms (host node-b" in out
    with Store(dest) as s:
        recs = {r.uid: r for r in s.records()}
        ranked = rank(recs.values())
    assert len(recs) == 5
    assert ranked[p][0].uid == theirs.uid
    # provenance: every field as measured on node-b
    assert dataclasses.replace(recs[theirs.uid], source="") == theirs
    assert recs[here.uid].host == "node-a"  # the local record is kept too
    dispatch.configure(dest)
    sel = dispatch.select(p, DEVICE)
    assert (sel.candidate.label, sel.record.host, sel.source) == ("knowncost:fast", "node-b", "tuned")
    assert dispatch.select(q, DEVICE).candidate.config == "medium"
    # merging again adds nothing and changes nothing
    code, out, _ = run(capsys, "db", "merge", "--db", str(dest), str(src))
    assert code == 0 and "0 new, 3 already there" in out and "no problem's best record changed" in out


def test_slower_merged_record_does_not_win(tmp_path):
    p = problem()
    dest = Store(tmp_path / "d.sqlite3")
    mine = record(p, config="fast", median=1.0)
    dest.add([mine])
    src = _jsonl(tmp_path / "s.jsonl", [record(p, config="fast", median=1.5, host="slowpoke")])
    report = merge(dest, [str(src)], rank=rank)
    assert report.added == 1 and report.changes == []
    assert rank(dest.records())[p][0].uid == mine.uid
    dest.close()


def test_other_devices_and_builds_are_kept_but_not_dispatched(tmp_path, capsys):
    p = problem()
    dest = tmp_path / "d.sqlite3"
    src = _sqlite(tmp_path / "s.sqlite3", [
        record(p, config="fast", device=OTHER_DEVICE),
        record(p, config="slow", build="another-build"),
    ])
    code, out, _ = run(capsys, "db", "merge", "--db", str(dest), str(src), "--json")
    data = json.loads(out)
    assert code == 0 and data["added"] == 2
    assert {(d["device"], d["build_id"]) for d in data["added_by_device"]} == {
        (db.device_label(OTHER_DEVICE), BUILD), (db.device_label(DEVICE), "another-build"),
    }
    with Store(dest) as s:
        assert s.count() == 2
    dispatch.configure(dest)
    assert dispatch.select(p, DEVICE).source == "default"


def test_invalid_records_refuse_the_merge_unless_skipped(tmp_path, capsys):
    p = problem()
    good = record(p, config="fast")
    bad_line = json.dumps({**db.record_to_json(record(p, config="slow")), "status": "great"})
    src = tmp_path / "s.jsonl"
    src.write_text(db.dumps_record(good) + "\n" + bad_line + "\n")
    # a database source with a record that claims to be verified but exceeds its bound, and
    # one of a backend this installation does not have
    src_db = _sqlite(tmp_path / "s.sqlite3", [
        record(p, config="medium", error=0.5, error_limit=0.01),
        record(p, backend="elsewhere", config="k1"),
    ])
    dest = tmp_path / "d.sqlite3"
    code, _, err = run(capsys, "db", "merge", "--db", str(dest), str(src), str(src_db))
    assert code == 1 and "nothing merged" in err
    assert f"{src}:2: status: must be one of" in err
    assert "error: an ok record must be within its error_limit" in err
    assert "backend: unknown backend 'elsewhere'" in err
    with Store(dest) as s:
        assert s.count() == 0
    code, out, err = run(capsys, "db", "merge", "--db", str(dest), str(src), str(src_db), "--skip-invalid")
    assert code == 0 and "1 invalid skipped" in out and "2 invalid skipped" in out
    with Store(dest) as s:
        assert [r.uid for r in s.records()] == [good.uid]
    # without the kernel check the other backend's record is accepted (never dispatched here)
    code, out, _ = run(capsys, "db", "merge", "--db", str(dest), str(src_db), "--skip-invalid", "--no-kernel-check")
    assert code == 0 and "1 new" in out


def test_sources_are_never_changed(tmp_path, capsys):
    p = problem()
    src = _sqlite(tmp_path / "s.sqlite3", [record(p, config="fast")])
    # an older schema (2) source is read as it is
    con = sqlite3.connect(src)
    con.execute("DROP TABLE sparktune_leases")
    con.execute("UPDATE sparktune_meta SET value='2' WHERE key='schema_version'")
    con.commit()
    con.close()
    before = src.read_bytes()
    dest = tmp_path / "d.sqlite3"
    code, out, err = run(capsys, "db", "merge", "--db", str(dest), str(src))
    assert code == 0, err
    assert src.read_bytes() == before
    assert not (tmp_path / "s.sqlite3-wal").exists() or (tmp_path / "s.sqlite3-wal").stat().st_size == 0


def test_dry_run_and_missing_source(tmp_path, capsys):
    dest = tmp_path / "d.sqlite3"
    src = _jsonl(tmp_path / "s.jsonl", [record()])
    code, out, _ = run(capsys, "db", "merge", "--db", str(dest), str(src), "--dry-run")
    assert code == 0 and out.startswith("would merge into") and "1 new" in out
    with Store(dest) as s:
        assert s.count() == 0
    code, _, err = run(capsys, "db", "merge", "--db", str(dest), str(tmp_path / "absent.jsonl"), str(src))
    assert code == 1 and "absent.jsonl: no such file" in err and "nothing merged" in err
    with Store(dest) as s:
        assert s.count() == 0


def test_export_per_device_and_merge_back(tmp_path, capsys):
    p = problem()
    src = _sqlite(tmp_path / "s.sqlite3", [
        record(p, config="slow"), record(p, config="fast"), record(problem(seqlen_q=64, seqlen_k=64), config="fast"),
        record(p, config="fast", device=OTHER_DEVICE),
    ])
    out_dir = tmp_path / "tuning_db"
    code, _, err = run(capsys, "db", "export", "--db", str(src), "--per-device", str(out_dir))
    assert code == 0, err
    files = sorted(f.name for f in out_dir.iterdir())
    assert files == ["other-gpu.jsonl", "test-gpu.jsonl"]
    lines = (out_dir / "test-gpu.jsonl").read_text().splitlines()
    keys = [problem_key(db.record_from_json(json.loads(line)).problem) for line in lines]
    assert len(lines) == 3 and keys == sorted(keys)
    # the export is stable: the same records give the same bytes
    first = (out_dir / "test-gpu.jsonl").read_bytes()
    run(capsys, "db", "export", "--db", str(src), "--per-device", str(out_dir))
    assert (out_dir / "test-gpu.jsonl").read_bytes() == first
    dest = tmp_path / "d.sqlite3"
    code, out, _ = run(capsys, "db", "merge", "--db", str(dest), *map(str, sorted(out_dir.iterdir())))
    assert code == 0 and "test-gpu.jsonl: 3 read, 3 new" in out and "other-gpu.jsonl: 1 read, 1 new" in out
    with Store(dest) as s:
        assert s.count() == 4

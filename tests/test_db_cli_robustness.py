"""`sparktune db`: the layer each listed record comes from and which layer dispatch uses; no
password shown, not even one in the URL's query; damaged rows, files that are not UTF-8 and
URLs that cannot be parsed are reported in one line each, never as a traceback; nothing
half-written."""

from __future__ import annotations

import json
import sqlite3

import pytest
import sqlalchemy as sa

from sparktune import db, dispatch
from sparktune.cli import main
from sparktune.db import Store, problem_key
from tests._pg import pg_url  # noqa: F401 - fixture
from tests._store_helpers import BUILD, DEVICE, OTHER_DEVICE, problem, record, registered_plugin

SECRET = "q-Secret_8812"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    monkeypatch.setattr(dispatch, "build_id", lambda: BUILD)
    with registered_plugin(None):
        yield


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _sqlite(path, records):
    with Store(path) as s:
        s.add(records)
    return path


def _damage(path, uid):
    """Make the row ``uid`` an invalid record (heads that do not divide)."""
    con = sqlite3.connect(path)
    con.execute("UPDATE sparktune_records SET heads_q = 3, heads_kv = 2 WHERE uid = ?", (uid,))
    con.commit()
    con.close()


# --------------------------------------------------------------------------- layers


def test_list_says_which_layer_each_record_comes_from_and_which_decides(tmp_path, capsys, monkeypatch):
    p, q = problem(), problem(seqlen_q=512, seqlen_k=512)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "test-gpu.jsonl").write_text(
        db.dumps_record(record(p, config="slow", median=0.5)) + "\n" + db.dumps_record(record(q, config="medium")) + "\n"
    )
    (shipped / "other-gpu.jsonl").write_text(db.dumps_record(record(p, config="fast", device=OTHER_DEVICE)) + "\n")
    monkeypatch.setenv(dispatch.ENV_SHIPPED, str(shipped))
    path = _sqlite(tmp_path / "u.sqlite3", [record(p, config="fast", median=2.0)])
    where = Store(path).display_url

    code, out, _ = run(capsys, "db", "list", "--db", str(path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["layers"] == [
        {"layer": 1, "kind": "database", "source": where, "records": 1},
        {"layer": 2, "kind": "shipped", "source": str(shipped), "records": 3,
         "files": [{"source": "shipped:other-gpu.jsonl", "records": 1}, {"source": "shipped:test-gpu.jsonl", "records": 2}]},
    ]
    rows = {(r["key"], r["device"]["name"], r["config"]): r for r in data["records"]}
    pk, qk = problem_key(p), problem_key(q)
    # the database decides for p on this GPU, though the shipped figure is faster
    assert (rows[pk, "Test GPU", "fast"]["layer"], rows[pk, "Test GPU", "fast"]["overridden_by_layer"]) == (1, None)
    assert (rows[pk, "Test GPU", "slow"]["layer"], rows[pk, "Test GPU", "slow"]["overridden_by_layer"]) == (2, 1)
    assert rows[pk, "Test GPU", "slow"]["source"] == "shipped:test-gpu.jsonl"
    # only the shipped layer has q, and only it has p on the other GPU
    assert (rows[qk, "Test GPU", "medium"]["layer"], rows[qk, "Test GPU", "medium"]["overridden_by_layer"]) == (2, None)
    assert (rows[pk, "Other GPU", "fast"]["layer"], rows[pk, "Other GPU", "fast"]["overridden_by_layer"]) == (2, None)
    # what list says decides is what dispatch uses
    dispatch.configure(path)
    assert dispatch.select(p, DEVICE).record.uid == rows[pk, "Test GPU", "fast"]["uid"]
    assert dispatch.select(q, DEVICE).record.uid == rows[qk, "Test GPU", "medium"]["uid"]

    code, out, _ = run(capsys, "db", "list", "--db", str(path))
    assert code == 0
    assert f"  1. {where}: 1 record(s)" in out
    assert f"  2. shipped, read-only, {shipped}: 3 record(s): other-gpu.jsonl (1), test-gpu.jsonl (2)" in out
    lines = [ln for ln in out.splitlines() if ln.startswith(pk) and "Test GPU" in ln]
    assert len(lines) == 2 and "knowncost:fast" in lines[0] and "knowncost:slow" in lines[1]
    assert "2 (layer 1 decides)" in lines[1] and "decides" not in lines[0]


# --------------------------------------------------------------------------- passwords


def test_query_password_is_hidden_everywhere_it_is_shown(capsys):
    url = f"postgresql+psycopg://user@127.0.0.1:9/none?password={SECRET}"
    assert SECRET not in db.safe_url(url) and "password=***" in db.safe_url(url)
    assert db.scrub(f"could not connect with {SECRET}", url) == "could not connect with ***"
    for argv in (["db", "list"], ["db", "list", "--json"], ["db", "export"], ["db", "upgrade"], ["db", "leases"]):
        code, out, err = run(capsys, *argv, "--db", url)
        assert code == 2 and SECRET not in out + err and "password=***" in err, (argv, err)


def test_unparsable_url_never_shows_its_password(tmp_path, capsys):
    bad = f"postgresql+psycopg://user:{SECRET}@db-host:notaport/x"
    assert SECRET not in db.scrub(f"could not parse {bad}", bad)
    code, out, err = run(capsys, "db", "list", "--db", bad)
    assert code == 2 and SECRET not in out + err and len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, "db", "merge", "--db", str(tmp_path / "d.sqlite3"), bad)
    assert code == 1 and SECRET not in out + err and "Traceback" not in err
    assert "<unparsable database URL>" in err and "nothing merged" in err


def test_query_password_on_a_server(pg_url, capsys, tmp_path):  # noqa: F811
    url = f"{pg_url}?password={SECRET}"  # trust authentication ignores it
    with Store(url) as s:
        s.add([record(config="fast")])
        assert SECRET not in s.display_url + repr(s)
    for argv in (["db", "list"], ["db", "list", "--json"], ["db", "show", problem_key(problem())], ["db", "upgrade"]):
        code, out, err = run(capsys, *argv, "--db", url)
        assert code == 0 and SECRET not in out + err, (argv, err)
    code, out, err = run(capsys, "db", "merge", "--db", str(tmp_path / "d.sqlite3"), url, "--json")
    assert code == 0 and SECRET not in out + err and json.loads(out)["added"] == 1
    # dispatch's snapshot of the server names it without the password
    dispatch.configure(url)
    assert dispatch.select(problem(), DEVICE).source == "tuned"
    snaps = list(dispatch.snapshot_path(db.resolve_url(url), DEVICE, BUILD).parent.glob("*.json"))
    assert snaps and all(SECRET not in f.read_text() for f in snaps)


@pytest.fixture(autouse=True)
def _snapshots(tmp_path, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SNAPSHOT_DIR, str(tmp_path / "snapshots"))


# --------------------------------------------------------------------------- damaged input


def test_damaged_rows_are_reported_and_the_rest_listed(tmp_path, capsys):
    p = problem()
    path = _sqlite(tmp_path / "d.sqlite3", [record(p, config="fast"), record(p, config="slow", uid="damaged")])
    _damage(path, "damaged")
    for argv in (["db", "list"], ["db", "list", "--all"], ["db", "show", problem_key(p)], ["db", "export"]):
        code, out, err = run(capsys, *argv, "--db", str(path))
        assert code == 0 and "Traceback" not in err, (argv, err)
        assert "row id 2 (uid damaged): ValueError: heads_q (3) must be a multiple of heads_kv (2) (left out)" in err
        assert "knowncost:fast" in out or '"config": "fast"' in out
    # the strict form names the row
    with Store(path) as s, pytest.raises(db.RecordError, match=r"row id 2 \(uid damaged\)"):
        s.records()


def test_merge_reports_damaged_rows_of_a_database_source(tmp_path, capsys):
    p = problem()
    src = _sqlite(tmp_path / "s.sqlite3", [record(p, config="fast", uid="good"), record(p, config="slow", uid="damaged")])
    _damage(src, "damaged")
    dest = tmp_path / "d.sqlite3"
    code, out, err = run(capsys, "db", "merge", "--db", str(dest), str(src))
    assert code == 1 and "nothing merged" in err and "Traceback" not in err
    assert "record damaged (row id 2): ValueError: heads_q (3)" in err
    with Store(dest) as s:
        assert s.count() == 0
    code, out, err = run(capsys, "db", "merge", "--db", str(dest), str(src), "--skip-invalid")
    assert code == 0 and f"{src}: 2 read, 1 new, 0 already there, 1 invalid skipped" in out
    with Store(dest) as s:
        assert [r.uid for r in s.records()] == ["good"]


def test_import_of_a_file_that_is_not_utf8(tmp_path, capsys):
    good = db.dumps_record(record(config="fast"))
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(good.encode() + b"\n" + b'{"format": 1, "host": "\xff\xfe"}\n')
    dest = tmp_path / "d.sqlite3"
    code, out, err = run(capsys, "db", "import", "--db", str(dest), str(f), "--no-kernel-check")
    assert code == 1 and "Traceback" not in err
    assert f"{f}:2: not UTF-8 text: byte 0xff at column 24" in err and "nothing imported" in err
    with Store(dest) as s:
        assert s.count() == 0
    code, out, err = run(capsys, "db", "import", "--db", str(dest), str(f), "--no-kernel-check", "--skip-invalid")
    assert code == 0 and "imported 1 record(s)" in out and "1 invalid line(s) skipped" in out
    # the same file as a merge source: the same line error
    code, out, err = run(capsys, "db", "merge", "--db", str(tmp_path / "m.sqlite3"), str(f), "--no-kernel-check")
    assert code == 1 and f"{f}:2: not UTF-8 text" in err


def test_a_byte_order_mark_and_deep_nesting(tmp_path):
    good = db.dumps_record(record(config="fast"))
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + good.encode() + b"\n" + b"[" * 100000 + b"\n")
    records, errors = db.read_jsonl_file(f)
    assert [r.config for _, r in records] == ["fast"]
    assert [(e.line, e.message) for e in errors] == [(2, "not valid JSON: nested too deeply")]


def test_failed_export_leaves_no_partial_file(tmp_path, capsys):
    path = _sqlite(tmp_path / "d.sqlite3", [record(config="fast")])
    target = tmp_path / "taken"
    target.mkdir()
    code, _, err = run(capsys, "db", "export", "--db", str(path), str(target))
    assert code == 2 and "cannot write" in err
    assert not (tmp_path / "taken.partial").exists()
    assert target.is_dir() and not any(target.iterdir())


def test_a_failing_write_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_text(db.dumps_record(record(config="fast")) + "\n")
    dest = tmp_path / "d.sqlite3"
    Store(dest).close()

    def broken(self, conn, records):
        raise sa.exc.OperationalError("INSERT INTO sparktune_records ...", {}, Exception("disk I/O error"))

    monkeypatch.setattr(Store, "insert", broken)
    code, _, err = run(capsys, "db", "import", "--db", str(dest), str(src), "--no-kernel-check")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "disk I/O error" in err and "nothing imported" in err
    code, _, err = run(capsys, "db", "merge", "--db", str(dest), str(src), "--no-kernel-check")
    assert code == 2 and "disk I/O error" in err and "nothing merged" in err
    monkeypatch.undo()
    with Store(dest) as s:
        assert s.count() == 0


def test_a_record_in_both_layers_is_listed_once_per_layer(tmp_path, capsys, monkeypatch):
    p = problem()
    mine = record(p, config="fast")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "test-gpu.jsonl").write_text(db.dumps_record(mine) + "\n" + db.dumps_record(record(p, config="slow", median=4.0)) + "\n")
    monkeypatch.setenv(dispatch.ENV_SHIPPED, str(shipped))
    path = _sqlite(tmp_path / "u.sqlite3", [mine])
    code, out, _ = run(capsys, "db", "list", "--db", str(path), "--json")
    data = json.loads(out)
    got = [(r["uid"], r["layer"], r["overridden_by_layer"], r["usable_candidates"], r["measured"]) for r in data["records"]]
    assert got == [(mine.uid, 1, None, 1, 1), (mine.uid, 2, 1, 2, 2)]

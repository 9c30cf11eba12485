"""`sparktune db ...`: list, show, export, import (validated), upgrade."""

from __future__ import annotations

import json
import sqlite3

import pytest

from sparktune import db, dispatch
from sparktune.cli import main
from sparktune.db import Store, problem_key
from tests._store_helpers import OTHER_DEVICE, problem, record
from tests.test_db_schema import SCHEMA_V1


@pytest.fixture
def path(tmp_path, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    p = tmp_path / "cli.sqlite3"
    with Store(p) as s:
        s.add([
            record(problem(), config="fast", median=1.0),
            record(problem(), config="slow", median=4.0),
            record(problem(), config="wrong", status="wrong", message="max abs error 0.5"),
            record(problem(op="bwd"), config="bwd_fast", median=2.0, device=OTHER_DEVICE),
        ])
    return p


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_text_and_json(path, capsys):
    code, out, _ = run(capsys, "db", "list", "--db", str(path))
    assert code == 0
    assert problem_key(problem()) in out and "knowncost:fast" in out and "2/3" in out
    assert "knowncost:slow" not in out
    code, out, _ = run(capsys, "db", "list", "--db", str(path), "--json")
    data = json.loads(out)
    assert {r["config"] for r in data["records"]} == {"fast", "bwd_fast"}
    code, out, _ = run(capsys, "db", "list", "--db", str(path), "--all")
    assert "knowncost:slow" in out and "wrong" in out


def test_list_missing_and_shipped(tmp_path, capsys, monkeypatch):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "test-gpu.jsonl").write_text(db.dumps_record(record(config="medium")) + "\n")
    monkeypatch.setenv(dispatch.ENV_SHIPPED, str(shipped))
    code, out, _ = run(capsys, "db", "list", "--db", str(tmp_path / "none.sqlite3"))
    assert code == 0 and "not created yet" in out and "shipped:test-gpu.jsonl" in out
    code, out, _ = run(capsys, "db", "list", "--db", str(tmp_path / "none.sqlite3"), "--no-shipped")
    assert "no tuning records" in out
    assert not (tmp_path / "none.sqlite3").exists()


def test_show_by_key_and_filters(path, capsys):
    code, out, _ = run(capsys, "db", "show", "--db", str(path), problem_key(problem()))
    assert code == 0
    assert out.index("knowncost:fast") < out.index("knowncost:slow") < out.index("knowncost:wrong")
    assert "max abs error 0.5" in out
    code, out, _ = run(capsys, "db", "show", "--db", str(path), "op=bwd", "--json")
    (line,) = out.splitlines()
    assert json.loads(line)["config"] == "bwd_fast"
    code, _, err = run(capsys, "db", "show", "--db", str(path), "seqlen_q=3")
    assert code == 1 and "no records match" in err
    code, _, err = run(capsys, "db", "show", "--db", str(path), "colour=red")
    assert code == 2 and "unknown field 'colour'" in err
    code, _, err = run(capsys, "db", "show", "--db", str(path), "fwd:nonsense")
    assert code == 2 and "not a problem key" in err


def test_show_prints_only_what_was_measured(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    path = tmp_path / "floor.sqlite3"
    with Store(path) as s:
        s.add([
            record(problem(), config="spread", median=1.0, floor_ms=0.25),
            record(problem(), config="floored", median=2.0, min_ms=None, q1_ms=None, q3_ms=None, max_ms=None,
                   floor_ms=2.0),
            record(problem(), config="older", median=3.0),  # measured before the floor was kept
        ])
    code, out, _ = run(capsys, "db", "show", "--db", str(path), problem_key(problem()))
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("candidate"))
    assert header.split()[:6] == ["candidate", "status", "median", "ms", "q1-q3", "ms"] and "floor ms" in header
    rows = {line.split()[0]: line.split()[:6] for line in out.splitlines() if line.startswith("knowncost:")}
    assert rows["knowncost:spread"] == ["knowncost:spread", "ok", "1", "0.99-1.01", "0.25", "20"]
    assert rows["knowncost:floored"] == ["knowncost:floored", "ok", "2", "-", "2", "20"]
    assert rows["knowncost:older"] == ["knowncost:older", "ok", "3", "2.97-3.03", "-", "20"]
    code, out, _ = run(capsys, "db", "show", "--db", str(path), problem_key(problem()), "--json")
    times = {json.loads(line)["config"]: json.loads(line)["time_ms"] for line in out.splitlines()}
    assert times["floored"] == {"median": 2.0, "min": None, "max": None, "q1": None, "q3": None, "floor": 2.0}


def test_export_import_round_trip(path, tmp_path, capsys):
    out_file = tmp_path / "out.jsonl"
    code, _, err = run(capsys, "db", "export", "--db", str(path), str(out_file))
    assert code == 0 and "exported 4 record(s)" in err
    assert len(out_file.read_text().splitlines()) == 4
    code, stdout, _ = run(capsys, "db", "export", "--db", str(path))
    assert stdout == out_file.read_text()
    other = tmp_path / "other.sqlite3"
    code, out, _ = run(capsys, "db", "import", "--db", str(other), str(out_file), "--no-kernel-check")
    assert code == 0 and "imported 4 record(s)" in out
    code, out, _ = run(capsys, "db", "import", "--db", str(other), str(out_file), "--no-kernel-check")
    assert "imported 0 record(s)" in out and "4 already there" in out


def test_import_reports_lines_and_refuses_or_skips(path, tmp_path, capsys):
    good = db.dumps_record(record(config="fast"))
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text(good + "\n{nope\n" + good.replace('"batch": 1', '"batch": "one"') + "\n")
    target = tmp_path / "t.sqlite3"
    code, _, err = run(capsys, "db", "import", "--db", str(target), str(bad_file), "--no-kernel-check")
    assert code == 1
    assert f"{bad_file}:2: not valid JSON" in err and f"{bad_file}:3: problem.batch" in err
    assert "nothing imported" in err
    assert Store(target).count() == 0
    code, out, _ = run(capsys, "db", "import", "--db", str(target), str(bad_file), "--no-kernel-check", "--skip-invalid")
    assert code == 0 and "imported 1 record(s)" in out and "2 invalid line(s) skipped" in out


def test_import_checks_kernels_against_the_registry(tmp_path, capsys):
    f = tmp_path / "k.jsonl"
    f.write_text(db.dumps_record(record(backend="nosuchbackend")) + "\n"
                 + db.dumps_record(record(backend="torch", config="nosuchconfig")) + "\n"
                 + db.dumps_record(record(backend="torch", config="math")) + "\n")
    code, _, err = run(capsys, "db", "import", "--db", str(tmp_path / "t.sqlite3"), str(f))
    assert code == 1
    assert ":1: backend: unknown backend 'nosuchbackend'" in err
    assert ":2: config: unknown kernel 'nosuchconfig'" in err
    assert ":3:" not in err


def test_upgrade(tmp_path, capsys):
    old = tmp_path / "v1.sqlite3"
    con = sqlite3.connect(old)
    con.executescript(SCHEMA_V1)
    con.close()
    code, out, _ = run(capsys, "db", "upgrade", "--db", str(old))
    assert code == 0 and f"from schema version 1 to {db.SCHEMA_VERSION}" in out
    code, out, _ = run(capsys, "db", "upgrade", "--db", str(old))
    assert "already at schema version" in out
    code, out, _ = run(capsys, "db", "upgrade", "--db", str(tmp_path / "new.sqlite3"))
    assert "created" in out


def test_newer_schema_is_one_clear_line(path, capsys):
    con = sqlite3.connect(path)
    con.execute("UPDATE sparktune_meta SET value='99' WHERE key='schema_version'")
    con.commit()
    con.close()
    for argv in (("db", "list"), ("db", "upgrade"), ("db", "export")):
        code, out, err = run(capsys, *argv, "--db", str(path))
        assert code == 2 and "schema version 99" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


def test_password_never_printed(capsys):
    code, _, err = run(capsys, "db", "list", "--db", "postgresql+psycopg://me:hunter2@127.0.0.1:9/x")
    assert code == 2 and "hunter2" not in err and "***" in err

"""The tuning store on PostgreSQL: round trips, the schema created by many processes at once
and upgraded, the command line against a server, and a password in the URL never shown."""

from __future__ import annotations

import dataclasses
import json
import threading

import optuna
import pytest
import sqlalchemy as sa

from sparktune import db, dispatch
from sparktune.cli import build_parser, main
from sparktune.cli import tune as tune_cli
from sparktune.db import Store, problem_key
from sparktune.db._schema import KEY_COLUMNS
from sparktune.tune import CostTimer, LeaseBoard
from tests._pg import pg_url, with_password  # noqa: F401 - fixture
from tests._store_helpers import (
    DEVICE,
    OTHER_DEVICE,
    known_cost,
    problem,
    record,
    registered_plugin,
)

SECRET = "pg-Secret_4711"


@pytest.fixture(autouse=True)
def _no_shipped(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_round_trip_and_filters(pg_url):  # noqa: F811
    with Store(pg_url) as s:
        assert s.version == db.SCHEMA_VERSION
        p = problem()
        rs = [record(p, config="fast", tflops=12.5, message="", torch_version="2.13"),
              record(p, config="crash", status="failed", message="RuntimeError: boom"),
              record(p, config="fast", device=OTHER_DEVICE)]
        assert s.add(rs + rs[:1]) == 3
        back = s.records(device=DEVICE)
        assert [dataclasses.replace(r, source="") for r in back] == rs[:2]
        assert back[0].measured_at.tzinfo is not None
        assert {r.config for r in s.records(status="failed")} == {"crash"}
        assert s.count() == 3


def test_many_processes_create_the_schema_at_once(pg_url):  # noqa: F811
    errors, versions = [], []
    go = threading.Barrier(8)

    def open_store():
        go.wait()
        try:
            with Store(pg_url) as s:
                versions.append(s.version)
                s.add([record()])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=open_store) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and versions == [db.SCHEMA_VERSION] * 8
    with Store(pg_url) as s:
        assert s.count() == 8


def test_upgrade_from_schema_2(pg_url):  # noqa: F811
    Store(pg_url).close()
    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("DROP TABLE sparktune_leases")
        c.exec_driver_sql("ALTER TABLE sparktune_records DROP COLUMN floor_ms")  # schema 4's
        for name in KEY_COLUMNS:  # schemas 5 and 6
            c.exec_driver_sql(f"ALTER TABLE sparktune_records DROP COLUMN {name}")
        c.exec_driver_sql("UPDATE sparktune_meta SET value='2' WHERE key='schema_version'")
    eng.dispose()
    assert Store.upgrade_database(pg_url) == (2, db.SCHEMA_VERSION)
    with Store(pg_url) as s:
        assert LeaseBoard(s).claim("w", "x") is not None


def test_upgrade_from_schema_4_reads_old_rows_as_features_off(pg_url):  # noqa: F811
    with Store(pg_url) as s:
        s.add([record(problem(), config="old")])
    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        for name in KEY_COLUMNS:
            c.exec_driver_sql(f"ALTER TABLE sparktune_records DROP COLUMN {name}")
        c.exec_driver_sql("UPDATE sparktune_meta SET value='4' WHERE key='schema_version'")
    eng.dispose()
    assert Store.upgrade_database(pg_url) == (4, db.SCHEMA_VERSION)
    with Store(pg_url) as s:
        (old,) = s.records()
        assert old.config == "old" and old.problem == problem() and not old.problem.features
        p = problem().replace(window_left=64, varlen=True, total_q=problem().seqlen_q,
                              total_k=problem().seqlen_k)
        s.add([record(p, config="new")])
        assert [r.config for r in s.records(problem=p)] == ["new"]
        assert [r.config for r in s.records(problem=problem())] == ["old"]


def test_cli_never_shows_the_password(pg_url, capsys, tmp_path):  # noqa: F811
    url = with_password(pg_url, SECRET)
    with Store(url) as s:
        s.add([record(problem(), config="fast"), record(problem(), config="slow", median=3.0)])
    for argv in (["db", "list"], ["db", "list", "--json"], ["db", "show", problem_key(problem())],
                 ["db", "export"], ["db", "leases"], ["db", "leases", "--json"], ["db", "upgrade"]):
        code, out, err = run(capsys, *argv, "--db", url)
        assert code == 0, (argv, err)
        assert SECRET not in out + err, argv
    code, out, _ = run(capsys, "db", "list", "--json", "--db", url)
    data = json.loads(out)
    assert "***" in data["database"] and data["layers"][0]["records"] == 2
    assert {r["source"] for r in data["records"]} == {s.display_url}
    code, out, _ = run(capsys, "db", "list", "--db", url)
    assert "layers, most specific first" in out and "1. postgresql+psycopg://postgres:***@" in out
    # the same through $SPARKTUNE_DB, and a wrong database name in the error
    bad = with_password(pg_url + "_missing", SECRET)
    code, out, err = run(capsys, "db", "list", "--db", bad)
    assert code == 2 and SECRET not in err and "does not exist" in err


def test_plain_postgresql_url_uses_psycopg(pg_url, monkeypatch):  # noqa: F811
    plain = pg_url.replace("postgresql+psycopg://", "postgresql://")
    monkeypatch.setenv("SPARKTUNE_DB", plain)
    import importlib.util

    if importlib.util.find_spec("psycopg2") is None:  # SQLAlchemy's default driver is absent
        assert db.resolve_url(None).drivername == "postgresql+psycopg"
    with Store() as s:
        assert s.version == db.SCHEMA_VERSION


def test_tune_into_postgres_with_optuna_studies_there(pg_url, capsys):  # noqa: F811
    url = with_password(pg_url, SECRET)
    args = build_parser().parse_args(["tune", "--seqlen", "32", "--heads", "1", "--head-dim", "16", "--op", "fwd",
                                      "--backend", "knowncost", "--db", url, "--json", "--no-progress"])
    problems, extra = tune_cli.problems_from_args(args)
    with registered_plugin(url):
        code = tune_cli.run(args, problems, extra, device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost))
    out, err = capsys.readouterr()
    assert code == 0 and SECRET not in out + err
    data = json.loads(out)
    assert "***" in data["database"] and data["results"][0]["best"]["candidate"] == "knowncost:fast"
    storage = optuna.storages.RDBStorage(pg_url)
    study = optuna.load_study(study_name=data["results"][0]["study"], storage=storage)
    attrs = next(t.user_attrs["sparktune"] for t in study.trials if t.params["candidate"] == "knowncost:fast")
    assert attrs["status"] == "ok" and len(attrs["times_ms"]) == attrs["runs"] and attrs["host"]


def test_merge_between_postgres_and_sqlite(pg_url, tmp_path, capsys):  # noqa: F811
    url = with_password(pg_url, SECRET)
    p = problem()
    local = tmp_path / "node.sqlite3"
    with Store(local) as s:
        s.add([record(p, config="fast", median=0.5, host="node-7")])
    with registered_plugin(None):
        code, out, err = run(capsys, "db", "merge", "--db", url, str(local))
        assert code == 0 and SECRET not in out + err and "1 new" in out
        assert "merged into postgresql+psycopg://postgres:***@" in out
        back = tmp_path / "back.sqlite3"
        code, out, err = run(capsys, "db", "merge", "--db", str(back), url, "--json")
        assert code == 0 and SECRET not in out + err
        data = json.loads(out)
        assert data["added"] == 1 and "***" in data["sources"][0]["source"]
    with Store(back) as s:
        (r,) = s.records()
        assert r.host == "node-7" and r.median_ms == 0.5


def test_on_ci_an_installed_server_must_answer(monkeypatch):
    """Off CI the PostgreSQL tests skip without a server; on CI, where a server is named or
    installed, they fail instead (a server that did not start must not look absent)."""
    from tests import _pg

    monkeypatch.delenv(_pg.ENV_PG, raising=False)
    monkeypatch.delenv("CI", raising=False)
    assert _pg.required() == ""
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(_pg.shutil, "which", lambda name: None)
    monkeypatch.setattr(_pg.glob, "glob", lambda pattern: [])
    assert _pg.required() == ""  # no server on this machine: skipping is honest
    monkeypatch.setattr(_pg.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "pg_ctlcluster" else None)
    assert "installed" in _pg.required()
    monkeypatch.setattr(_pg.shutil, "which", lambda name: None)
    monkeypatch.setenv(_pg.ENV_PG, "postgresql+psycopg://postgres@db.example:5432/postgres")
    assert "SPARKTUNE_TEST_PG" in _pg.required()
    monkeypatch.setenv("CI", "false")
    assert _pg.required() == ""

"""Dispatch and a shared database: a local snapshot is kept of what was read; when the server
does not answer, the snapshot (or the defaults) is used with one warning; a fresh snapshot can
spare the server; the registry tells dispatch to choose again; ``sparktune.explain``."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import sqlalchemy as sa

from sparktune import db, dispatch, registry
from sparktune.db import Store
from tests._pg import _connect, pg_url, terminate_connections, with_password  # noqa: F401 - fixture
from tests._store_helpers import (
    BUILD,
    DEVICE,
    connection_attempts,
    problem,
    record,
    registered_plugin,
)

SECRET = "snap-secret-91x"


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SNAPSHOT_DIR, str(tmp_path / "snapshots"))
    monkeypatch.setattr(dispatch, "build_id", lambda: BUILD)
    monkeypatch.delenv(dispatch.ENV_SNAPSHOT_TTL, raising=False)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "sparktune.dispatch"]


def _block(dbname, allow):
    with _connect() as conn:
        conn.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS {"true" if allow else "false"}')
    if not allow:
        terminate_connections(dbname)


def test_snapshot_taken_and_used_when_the_server_is_away(pg_url, tmp_path, caplog):  # noqa: F811
    url = with_password(pg_url, SECRET)
    dbname = sa.engine.make_url(pg_url).database
    p, q = problem(), problem(seqlen_q=512, seqlen_k=512)
    with Store(url) as s:
        s.add([record(p, config="fast", median=1.0), record(p, config="slow", median=3.0), record(q, config="medium")])
    with registered_plugin(url):
        assert dispatch.select(p, DEVICE).source == "tuned"
        snaps = list((tmp_path / "snapshots").glob("*.json"))
        assert len(snaps) == 1 and snaps[0].name.startswith("127.0.0.1-")
        text = snaps[0].read_text()
        assert SECRET not in text and "***" in text
        assert len(json.loads(text)["records"]) == 3
        stamp = snaps[0].stat().st_mtime_ns
        dispatch.reload()
        dispatch.select(p, DEVICE)
        assert snaps[0].stat().st_mtime_ns == stamp  # unchanged records: the file is left alone
        _block(dbname, allow=False)
        try:
            dispatch.reload()
            caplog.clear()
            with caplog.at_level(logging.WARNING), connection_attempts() as tried:
                a, b = dispatch.select(p, DEVICE), dispatch.select(q, DEVICE)
            # the server is asked once for both calls, with dispatch's connect timeout
            assert [t["connect_timeout"] for t in tried] == [math.ceil(dispatch.READ_TIMEOUT_S)]
        finally:
            _block(dbname, allow=True)
        assert (a.candidate.config, a.source) == ("fast", "tuned")
        assert a.record.source.startswith("snapshot ") and b.candidate.config == "medium"
        (warning,) = _warnings(caplog)
        assert "cannot reach the tuning database" in warning and "using its local snapshot" in warning
        assert SECRET not in warning and "***" in warning
        assert "unreachable: snapshot taken" in str(dispatch.explain(p, DEVICE))


def test_no_snapshot_and_a_damaged_one_mean_the_defaults(pg_url, tmp_path, caplog):  # noqa: F811
    url = with_password(pg_url, SECRET)
    dbname = sa.engine.make_url(pg_url).database
    with Store(url) as s:
        s.add([record(problem(), config="fast")])
    with registered_plugin(url):
        _block(dbname, allow=False)
        try:
            with caplog.at_level(logging.WARNING):
                assert dispatch.select(problem(), DEVICE).source == "default"
            (w,) = _warnings(caplog)
            assert "using the default kernels" in w and SECRET not in w
            # a damaged snapshot is never trusted
            path = dispatch.snapshot_path(db.resolve_url(url), DEVICE, BUILD)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text('{"snapshot": 1, "taken_at": "2026-01-01T00:00:00Z", "records": [{"format": 1}]}')
            dispatch.reload()
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                assert dispatch.select(problem(), DEVICE).source == "default"
            ws = _warnings(caplog)
            assert any("ignoring a damaged snapshot" in w for w in ws) and any("default kernels" in w for w in ws)
        finally:
            _block(dbname, allow=True)


def test_fresh_snapshot_spares_the_server(pg_url, monkeypatch):  # noqa: F811
    with Store(pg_url) as s:
        s.add([record(problem(), config="fast")])
    with registered_plugin(pg_url):
        assert dispatch.select(problem(), DEVICE).source == "tuned"  # takes the snapshot
        monkeypatch.setenv(dispatch.ENV_SNAPSHOT_TTL, "600")

        def no_server(*a, **k):
            raise AssertionError("the server was asked")

        monkeypatch.setattr(db.Store, "__init__", no_server)
        dispatch.reload()
        sel = dispatch.select(problem(), DEVICE)
        assert sel.source == "tuned" and sel.record.source.startswith("snapshot ")
        assert "younger than $SPARKTUNE_SNAPSHOT_TTL" in str(dispatch.explain(problem(), DEVICE))


def test_unroutable_server_is_given_up_quickly(tmp_path):
    # TEST-NET-1 (RFC 5737): never answers; dispatch waits about its connect timeout, once
    with registered_plugin(f"postgresql+psycopg://u:{SECRET}@192.0.2.1:5432/x"), connection_attempts() as tried:
        assert dispatch.select(problem(), DEVICE).source == "default"
        assert dispatch.select(problem(seqlen_q=64, seqlen_k=64), DEVICE).source == "default"
    # one attempt for both calls, given up after dispatch's connect timeout (counted, not timed)
    assert [(t["host"], t["connect_timeout"]) for t in tried] == [("192.0.2.1", math.ceil(dispatch.READ_TIMEOUT_S))]


def test_sqlite_stores_get_no_snapshot(tmp_path):
    path = tmp_path / "local.sqlite3"
    with Store(path) as s:
        s.add([record(problem(), config="fast")])
    with registered_plugin(path):
        assert dispatch.select(problem(), DEVICE).source == "tuned"
    assert not (tmp_path / "snapshots").exists()


def test_registering_a_backend_makes_dispatch_choose_again(tmp_path):
    path = tmp_path / "r.sqlite3"
    with Store(path) as s:
        s.add([record(problem(), config="fast")])
    with registered_plugin(path) as backend:
        assert dispatch.select(problem(), DEVICE).source == "tuned"
        registry.unregister_backend("knowncost")
        assert dispatch.select(problem(), DEVICE).source == "default"  # no stale choice
        registry.register_backend(backend)
        assert dispatch.select(problem(), DEVICE).candidate.label == "knowncost:fast"


def test_package_exports_explain_lazily():
    code = (
        "import sys, sparktune\n"
        "heavy = ('optuna', 'sqlalchemy', 'yaml')\n"
        "assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]\n"
        "from sparktune import explain\n"
        "from sparktune.dispatch import explain as e2\n"
        "assert explain is e2 and sparktune.explain is e2 and 'explain' in sparktune.__all__\n"
        "assert not [m for m in heavy if m in sys.modules]\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

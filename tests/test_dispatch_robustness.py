"""Dispatch: the memo of selections is bounded without costing the hit path anything; a
damaged row of the database costs only that row; a password in the database URL's query is
never shown."""

from __future__ import annotations

import collections
import logging
import sqlite3
import sys

import pytest

from sparktune import db, dispatch
from sparktune.db import Store
from tests._store_helpers import BUILD, DEVICE, problem, record, registered_plugin


@pytest.fixture(autouse=True)
def _build(monkeypatch):
    monkeypatch.setattr(dispatch, "build_id", lambda: BUILD)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "sparktune.dispatch"]


def test_memo_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatch, "_MEMO_MAX", 8)
    with registered_plugin(tmp_path / "none.sqlite3"):
        shapes = [problem(seqlen_q=n, seqlen_k=n) for n in range(16, 16 + 40)]
        for p in shapes:
            dispatch.select(p, DEVICE)
            assert len(dispatch._memo) <= 8
        # what is memoised is still found: the same selection, not a new one
        last = dispatch.select(shapes[-1], DEVICE)
        assert dispatch.select(shapes[-1], DEVICE) is last
        assert dispatch.counters()["default"] == 42


def test_a_hit_calls_nothing_but_the_lookup(tmp_path):
    path = tmp_path / "hit.sqlite3"
    p = problem()
    with Store(path) as s:
        s.add([record(p, config="fast")])
    with registered_plugin(path):
        assert dispatch.select(p, DEVICE).source == "tuned"
        seen = collections.Counter()

        def hook(frame, event, arg):
            if event == "call":
                code = frame.f_code
                name = getattr(code, "co_qualname", code.co_name)
                seen[name if name == "select" else f"{type(frame.f_locals.get('self')).__name__}.{code.co_name}"] += 1
            elif event == "c_call":
                seen["c:" + getattr(arg, "__name__", "?")] += 1

        sys.setprofile(hook)
        try:
            dispatch.select(p, DEVICE)
        finally:
            sys.setprofile(None)
        seen.pop("c:setprofile", None)
        # select itself and the memo's dict.get (with the key's cached hashes): no size check,
        # no lock, no resolution
        assert seen == {"select": 1, "c:get": 1, "Problem.__hash__": 1, "DeviceInfo.__hash__": 1}, seen


def test_an_invalid_row_costs_only_that_row(tmp_path, caplog):
    path = tmp_path / "d.sqlite3"
    p, q = problem(), problem(seqlen_q=512, seqlen_k=512)
    with Store(path) as s:
        s.add([record(p, config="fast"), record(q, config="slow"), record(q, config="medium", uid="damaged")])
    con = sqlite3.connect(path)
    con.execute("UPDATE sparktune_records SET heads_q = 3, heads_kv = 2 WHERE uid = 'damaged'")
    con.commit()
    con.close()
    with registered_plugin(path), caplog.at_level(logging.WARNING):
        a, b = dispatch.select(p, DEVICE), dispatch.select(q, DEVICE)
        dispatch.select(problem(seqlen_q=64, seqlen_k=64), DEVICE)
    assert (a.source, a.candidate.config) == ("tuned", "fast")
    assert (b.source, b.candidate.config) == ("tuned", "slow")
    (w,) = _warnings(caplog)
    assert "1 invalid row(s)" in w and "uid damaged" in w and "heads_q (3) must be a multiple" in w


def test_password_in_the_query_never_shown(caplog):
    url = "postgresql+psycopg://user@127.0.0.1:9/none?password=qsecret-5521&sslmode=disable"
    with registered_plugin(url), caplog.at_level(logging.WARNING):
        assert dispatch.select(problem(), DEVICE).source == "default"
        text = str(dispatch.explain(problem(), DEVICE))
    (w,) = _warnings(caplog)
    assert "qsecret-5521" not in w + text
    assert "password=***" in w and "password=***" in text
    assert db.safe_url(url) == "postgresql+psycopg://user@127.0.0.1:9/none?password=***&sslmode=disable"

"""Dispatch with a tuning store: order (forced, tuned, nearest, default), memoisation,
counters, layers, explain(), and fallbacks when the database is broken."""

from __future__ import annotations

import collections
import dataclasses
import logging
import sqlite3
import sys

import pytest
import torch

from sparktune import db, dispatch
from sparktune.backends.base import Candidate
from sparktune.db import Store
from tests._store_helpers import BUILD, DEVICE, OTHER_DEVICE, problem, record, registered_plugin

KC = "knowncost"


@pytest.fixture
def build(monkeypatch):
    monkeypatch.setattr(dispatch, "build_id", lambda: BUILD)
    return BUILD


@pytest.fixture
def path(tmp_path):
    return tmp_path / "d.sqlite3"


def _fill(path, records):
    with Store(path) as s:
        s.add(records)


@pytest.fixture
def plugin(path, build):
    with registered_plugin(path) as backend:
        yield backend


def test_default_when_nothing_is_tuned(plugin):
    sel = dispatch.select(problem(), DEVICE)
    assert sel.source == "default"
    assert sel == dispatch.heuristic_default(problem(), DEVICE)
    assert dispatch.counters()["default"] == 1


def test_tuned_hit_and_counters(path, plugin):
    p = problem()
    _fill(path, [record(p, config="slow", median=4.0), record(p, config="fast", median=1.0)])
    dispatch.reload()
    for _ in range(3):
        sel = dispatch.select(p, DEVICE)
    assert (sel.candidate, sel.source) == (Candidate(KC, "fast"), "tuned")
    assert sel.record is not None and sel.record.median_ms == 1.0
    assert dispatch.counters() == {"forced": 0, "tuned": 3, "nearest": 0, "default": 0}
    dispatch.reset_counters()
    assert set(dispatch.counters().values()) == {0}


def test_store_is_read_once(path, plugin, monkeypatch):
    p = problem()
    _fill(path, [record(p, config="fast")])
    dispatch.reload()
    assert dispatch.select(p, DEVICE).source == "tuned"
    calls = []
    monkeypatch.setattr(db.Store, "records", lambda *a, **k: calls.append(1) or [])
    q = problem(seqlen_q=128, seqlen_k=128)
    dispatch.select(q, DEVICE)  # a new problem on the same device: no new read
    dispatch.select(p, DEVICE)
    assert calls == []
    dispatch.reload()
    dispatch.select(p, DEVICE)
    assert calls == [1]


def test_forced_beats_tuned_and_explains_refusal(path, plugin):
    p = problem()
    _fill(path, [record(p, config="fast")])
    dispatch.reload()
    sel = dispatch.select(p, DEVICE, backend=KC, config="slow")
    assert (sel.candidate.config, sel.source) == ("slow", "forced")
    with pytest.raises(dispatch.NoKernelError, match="d64only needs 64"):
        dispatch.select(problem(head_dim=128), DEVICE, backend=KC, config="d64only")
    with pytest.raises(ValueError, match="needs backend"):
        dispatch.select(p, DEVICE, config="fast")


def test_wrong_or_failed_latest_measurement_is_never_chosen(path, plugin):
    p = problem()
    _fill(path, [
        record(p, config="fast", median=1.0),
        record(p, config="medium", median=2.0),
        record(p, config="fast", status="wrong"),
        record(p, config="wrong", status="wrong"),
    ])
    dispatch.reload()
    assert dispatch.select(p, DEVICE).candidate.config == "medium"


def test_records_of_other_devices_and_builds_are_ignored(path, plugin):
    p = problem()
    _fill(path, [record(p, config="fast", device=OTHER_DEVICE), record(p, config="slow", build="old-build")])
    dispatch.reload()
    assert dispatch.select(p, DEVICE).source == "default"
    # another driver of the same GPU model is still this GPU
    q = problem(seqlen_q=512, seqlen_k=512)
    _fill(path, [record(q, config="slow", device=dataclasses.replace(DEVICE, driver="1.0"))])
    dispatch.reload()
    assert dispatch.select(q, DEVICE).source == "tuned"


def test_unrunnable_record_is_skipped(path, plugin):
    p = problem(head_dim=128)
    _fill(path, [
        record(p, backend="gone", config="x", median=0.1),
        record(p, config="d64only", median=0.2),  # cannot run head_dim 128 any more
        record(p, config="slow", median=4.0),
    ])
    dispatch.reload()
    sel = dispatch.select(p, DEVICE)
    assert (sel.candidate.config, sel.source) == ("slow", "tuned")
    text = str(dispatch.explain(p, DEVICE))
    assert "gone:x" in text and "not registered" in text and "d64only needs 64" in text


def test_nearest_tuned_shape(path, plugin):
    short, long_ = problem(seqlen_q=256, seqlen_k=256), problem(seqlen_q=2048, seqlen_k=2048)
    _fill(path, [record(short, config="fast"), record(long_, config="long")])
    dispatch.reload()
    sel = dispatch.select(problem(seqlen_q=1500, seqlen_k=1500), DEVICE)
    assert (sel.candidate.config, sel.source) == ("long", "nearest")
    assert "seqlen 2048/2048" in sel.detail
    assert dispatch.select(problem(seqlen_q=300, seqlen_k=300, batch=2), DEVICE).candidate.config == "fast"
    # another kind (causal, another head_dim, GQA, dtype, op) has no nearest: the default
    for other in (
        problem(causal=True),
        problem(head_dim=128),
        problem(heads_kv=2),
        problem(dtype="bfloat16"),
        problem(seqlen_q=256, seqlen_k=512),
    ):
        assert dispatch.select(other, DEVICE).source == "default", other
    assert dispatch.counters()["nearest"] == 2


def test_cpu_tensors_get_the_default(path, plugin):
    p = problem()
    _fill(path, [record(p, config="fast")])
    dispatch.reload()
    assert dispatch.select(p, None).source == "default"


def test_shipped_layer_under_the_user_database(path, plugin, tmp_path, monkeypatch):
    p, q = problem(), problem(seqlen_q=512, seqlen_k=512)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "test-gpu.jsonl").write_text(
        "\n".join(db.dumps_record(r) for r in (record(p, config="slow"), record(q, config="slow"))) + "\n"
    )
    monkeypatch.setenv(dispatch.ENV_SHIPPED, str(shipped))
    _fill(path, [record(p, config="fast", median=9.0)])
    dispatch.reload()
    a, b = dispatch.select(p, DEVICE), dispatch.select(q, DEVICE)
    assert (a.candidate.config, a.record.source) == ("fast", Store(path).display_url)
    assert (b.candidate.config, b.record.source) == ("slow", "shipped:test-gpu.jsonl")
    assert "1 shipped file(s)" in str(dispatch.explain(q, DEVICE))


def test_load_records_reads_the_layers_of_a_device_and_build(path, tmp_path, monkeypatch):
    p = problem()
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    mine, other, old = record(p, config="slow"), record(p, device=OTHER_DEVICE), record(p, build="another-build")
    (shipped / "test-gpu.jsonl").write_text("".join(db.dumps_record(r) + "\n" for r in (mine, other, old)))
    monkeypatch.setenv(dispatch.ENV_SHIPPED, str(shipped))
    missing = dispatch.load_records(DEVICE, BUILD, db=path)
    assert missing.missing and missing.error  # named explicitly: worth a warning
    assert missing.stored == [] and [r.uid for r in missing.shipped] == [mine.uid]
    assert [r.uid for r in missing.shipped_earlier] == [old.uid]  # the other GPU model: nowhere
    _fill(path, [record(p, config="fast"), record(p, config="fast", build="another-build")])
    loaded = dispatch.load_records(DEVICE, BUILD, db=path)
    assert (loaded.error, loaded.missing, loaded.opened, loaded.notices) == ("", False, True, [])
    assert [r.config for r in loaded.stored] == ["fast"] and [r.uid for r in loaded.shipped] == [mine.uid]
    assert loaded.sources == [Store(path).display_url, "1 shipped file(s)"]
    assert [r.config for r in loaded.ranked()[p]] == ["fast"]  # the database layer decides
    everything = dispatch.load_records(db=path, shipped=False)
    assert len(everything.stored) == 2 and everything.shipped == [] and everything.sources == [everything.where]


def test_shipped_records_of_another_build_come_last(path, plugin, tmp_path, monkeypatch):
    """Shipped records measured with another build of the kernel family (a space that declared
    other configurations) serve the problems that nothing of this build reaches, for the
    candidates this build still has; a record of this build wins even when slower."""
    p, q, r = problem(), problem(seqlen_q=512, seqlen_k=512), problem(seqlen_q=1024, seqlen_k=1024)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    lines = [
        record(p, config="fast", median=1.0, build="earlier"),
        record(q, config="fast", median=1.0, build="earlier"),
        record(q, config="slow", median=5.0),
        record(r, config="gone", median=0.5, build="earlier"),  # a kernel this build lacks
        record(r, config="slow", median=2.0, build="earlier"),
    ]
    (shipped / "test-gpu.jsonl").write_text("".join(db.dumps_record(x) + "\n" for x in lines))
    monkeypatch.setenv(dispatch.ENV_SHIPPED, str(shipped))
    dispatch.reload()
    a, b, c = (dispatch.select(x, DEVICE) for x in (p, q, r))
    assert (a.candidate.config, a.source) == ("fast", "tuned")
    assert a.record.source == "shipped:test-gpu.jsonl (kernel build earlier)"
    assert (b.candidate.config, b.record.source) == ("slow", "shipped:test-gpu.jsonl")
    assert (c.candidate.config, c.source) == ("slow", "tuned")
    _fill(path, [record(p, config="slow", median=9.0)])
    dispatch.reload()
    assert dispatch.select(p, DEVICE).candidate.config == "slow"  # the user's database first


def test_explain(path, plugin):
    p = problem()
    _fill(path, [record(p, config="fast", median=1.0), record(p, config="slow", median=4.0)])
    dispatch.reload()
    before = dispatch.counters()
    e = dispatch.explain(p, DEVICE)
    assert e.selection.candidate.config == "fast" and e.selection.source == "tuned"
    text = str(e)
    for part in ("choice:   knowncost:fast (tuned)", "measured: 1 ms median", "testhost", "tuned:    knowncost:slow"):
        assert part in text
    assert dispatch.counters() == before
    forced = dispatch.explain(p, DEVICE, backend=KC, config="slow")
    assert forced.selection.source == "forced"
    bad = dispatch.explain(problem(head_dim=128), DEVICE, backend=KC, config="d64only")
    assert bad.selection is None and "d64only needs 64" in str(bad)
    q = torch.zeros(1, 4, 256, 64, dtype=torch.float16)
    cpu = dispatch.explain(q, k=q)
    assert cpu.device is None and cpu.selection.source == "default" and "CPU tensors" in str(cpu)
    bnhd = dispatch.explain(q.transpose(1, 2), k=q.transpose(1, 2), layout="bnhd", causal=True)
    assert bnhd.problem == problem(causal=True)


def test_explain_prints_only_what_was_measured(path, plugin):
    p, q = problem(), problem(seqlen_q=512, seqlen_k=512)
    _fill(path, [
        record(p, config="fast", median=1.0, floor_ms=0.25),
        # a spread that was not kept (unknown) and a median set by the burst floor
        record(q, config="fast", median=2.0, min_ms=None, q1_ms=None, q3_ms=None, max_ms=None, floor_ms=2.0),
    ])
    dispatch.reload()
    full = str(dispatch.explain(p, DEVICE))
    assert "measured: 1 ms median, quartiles 0.99-1.01, burst floor 0.25 ms, 20 runs" in full
    floored = str(dispatch.explain(q, DEVICE))
    assert "measured: 2 ms median, burst floor 2 ms, 20 runs" in floored and "quartiles" not in floored


# --------------------------------------------------------------------------- broken databases


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "sparktune.dispatch"]


def _assert_falls_back_once(caplog, expect):
    with caplog.at_level(logging.WARNING):
        a = dispatch.select(problem(), DEVICE)
        b = dispatch.select(problem(seqlen_q=128, seqlen_k=128), DEVICE)
    assert a.source == b.source == "default"
    warns = _warnings(caplog)
    assert len(warns) == 1, [w.getMessage() for w in warns]
    assert expect in warns[0].getMessage()
    assert "using the default kernels" in warns[0].getMessage()
    return warns[0].getMessage()


def test_corrupted_database(path, plugin, caplog):
    path.write_bytes(b"this is not a database" * 100)
    _assert_falls_back_once(caplog, "cannot read the tuning database")


def _counting_store_opens(monkeypatch):
    """The ``timeout`` of every Store opened from now on (what bounds its waiting)."""
    opened = []
    init = db.Store.__init__

    def counting(self, *args, **kwargs):
        opened.append(kwargs.get("timeout"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(db.Store, "__init__", counting)
    return opened


def test_locked_database(path, plugin, caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "READ_TIMEOUT_S", 0.2)
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=DELETE")
    con.execute("CREATE TABLE x (y INTEGER)")
    con.execute("BEGIN EXCLUSIVE")
    con.execute("INSERT INTO x VALUES (1)")
    try:
        opened = _counting_store_opens(monkeypatch)
        _assert_falls_back_once(caplog, "locked")
        # the locked file is tried once for both calls, its wait bounded by dispatch's timeout
        assert opened == [0.2]
    finally:
        con.execute("ROLLBACK")
        con.close()


def test_newer_schema(path, plugin, caplog):
    Store(path).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE sparktune_meta SET value='999' WHERE key='schema_version'")
    con.commit()
    con.close()
    msg = _assert_falls_back_once(caplog, "schema version 999")
    assert "upgrade sparktune" in msg


def test_unreachable_server(plugin, caplog):
    dispatch.configure("postgresql+psycopg://nobody:secret@127.0.0.1:9/none")
    msg = _assert_falls_back_once(caplog, "127.0.0.1:9")
    assert "secret" not in msg


def test_missing_database(tmp_path, plugin, caplog, monkeypatch):
    dispatch.configure(tmp_path / "absent.sqlite3")
    _assert_falls_back_once(caplog, "no tuning database")
    assert not (tmp_path / "absent.sqlite3").exists()
    # the default database not created yet is normal: no warning
    monkeypatch.delenv("SPARKTUNE_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    dispatch.configure(None)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert dispatch.select(problem(), DEVICE).source == "default"
    assert _warnings(caplog) == []


def test_upgrades_an_old_database_on_read(path, plugin):
    from tests.test_db_schema import SCHEMA_V1

    con = sqlite3.connect(path)
    con.executescript(SCHEMA_V1)
    con.commit()
    con.close()
    p = problem(heads_q=12, heads_kv=12, seqlen_q=8192, seqlen_k=8192, head_dim=128)
    # the v1 row (torch:flash, which cannot run on CPU tensors here) is read after the upgrade
    e = dispatch.explain(p, DEVICE)
    assert "torch:flash (1.5 ms)" in str(e) and e.selection.source == "default"
    assert Store(path).version == db.SCHEMA_VERSION


def test_hit_costs_a_dictionary_lookup(path, plugin):
    p = problem()
    _fill(path, [record(p, config="fast")])
    dispatch.reload()
    first = dispatch.select(p, DEVICE)
    # counted, not timed: the Python functions a second call enters (a profile hook sees
    # every call); only the key's hashes and select itself, around one dictionary read
    entered = collections.Counter()

    def hook(frame, event, arg):
        if event == "call":
            entered[frame.f_code.co_qualname] += 1
        elif event == "c_call":
            entered[f"c:{getattr(arg, '__name__', '?')}"] += 1

    sys.setprofile(hook)
    try:
        again = dispatch.select(p, DEVICE)
    finally:
        sys.setprofile(None)
    entered.pop("c:setprofile", None)
    assert again is first and again.source == "tuned"
    assert set(entered) <= {"select", "Problem.__hash__", "DeviceInfo.__hash__", "c:get"}, entered
    assert entered["select"] == 1 and sum(entered.values()) <= 5, entered

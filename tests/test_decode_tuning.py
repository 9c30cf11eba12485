"""Decode problems (docs/DECODING.md) in the problem key, the store, JSON Lines, dispatch, the
tuner and ``sparktune tune --decode``; the per-signature plan of ``attention_with_kvcache``.
On the CPU: the torch and reference paths run here, the Triton candidates under the
interpreter in tests/test_triton_decode.py."""

from __future__ import annotations

import importlib
import io
import json

import pytest
import torch

import sparktune
from sparktune import db, dispatch
from sparktune._kvcache import DecodeKey, check_kvcache, decode_problem
from sparktune.backends.base import Candidate
from sparktune.cli import build_parser, main
from sparktune.cli import tune as tune_cli
from sparktune.db import Store, parse_problem_key, problem_key
from sparktune.problem import Problem
from sparktune.registry import get_backend, kernel_check
from sparktune.tune import CostTimer, Tuner
from tests._store_helpers import BUILD, DEVICE, record, registered_plugin

kv = importlib.import_module("sparktune._kvcache")
plan_mod = importlib.import_module("sparktune._plan")

DEC = Problem("decode", "bfloat16", 8, 32, 8, 1, 8192, 128, True, page_size=256)
#: a tiny decode problem the CPU checks and runs: 2 sequences, GQA 4:2, a cache of 64 keys
TINY = Problem("decode", "bfloat16", 2, 4, 2, 1, 64, 32, True)


# --------------------------------------------------------------------------- the key


def test_decode_problem_fields_and_key_text():
    assert DEC.features == {"decode"} and DEC.paged and DEC.is_decode
    assert problem_key(DEC) == "decode:bfloat16:b8:h32/8:n1/8192:d128:causal:acc32:page256"
    p = DEC.replace(page_size=0, appends=2, seqlen_q=4, window_left=100, softcap=True, alibi=True)
    text = problem_key(p)
    assert text == "decode:bfloat16:b8:h32/8:n4/8192:d128:causal:acc32:w100/-1:softcap:alibi:new2"
    assert parse_problem_key(text) == p and parse_problem_key(problem_key(DEC)) == DEC
    assert hash(p) == hash(parse_problem_key(text))


def test_decode_throughput_numbers():
    # FLOPs of every query against a full cache; K/V bytes at the bucket's length
    assert DEC.flops() == 4.0 * 8 * 32 * 1 * 8192 * 128
    assert DEC.bytes_read() == 2.0 * 8 * 8 * 8192 * 128 * 2


@pytest.mark.parametrize(
    ("changes", "expect"),
    [
        ({"seqlen_k": 8000}, "power of two >= 16"),
        ({"seqlen_k": 8}, "power of two >= 16"),
        ({"page_size": 16384}, "must not exceed the cache-length bucket"),
        ({"appends": -1}, "appends must be an integer >= 0"),
        ({"dropout": True}, "a decode problem has no dropout"),
        ({"allow_fp16_accum": True}, "a decode problem has no allow_fp16_accum"),
        ({"op": "fwd"}, "page_size and appends are for decode problems only"),
        ({"window_right": 3}, "a causal problem has window_right -1"),
    ],
)
def test_bad_decode_problems_say_what(changes, expect):
    with pytest.raises(ValueError, match=expect):
        DEC.replace(**changes)


def test_decode_key_becomes_the_problem():
    q = torch.zeros(8, 1, 32, 128, dtype=torch.bfloat16)
    pages = torch.zeros(8 * 30, 256, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(8, 30, dtype=torch.int32)  # capacity 7680: bucket 8192
    inp = check_kvcache(q, pages, pages.clone(), cache_seqlens=10, block_table=table)
    assert decode_problem(inp.key) == DEC
    assert decode_problem(DecodeKey("float32", 1, 1, 1, 1, 16, 16, True)) is None


# --------------------------------------------------------------------------- store and JSON


def _decode_records():
    return [
        record(DEC, backend="triton", config="tdec_n64_w4s2_x4", median=0.05),
        record(DEC, backend="torch", config="auto", median=0.07),
        record(DEC.replace(page_size=0, appends=1), backend="triton", config="tdec_n128_w8s2_x8", median=0.04),
    ]


def test_store_json_and_merge_round_trip(tmp_path):
    recs = _decode_records()
    with Store(tmp_path / "a.sqlite3") as s:
        s.add(recs)
        back = s.records(problem=DEC)
        assert {r.config for r in back} == {"tdec_n64_w4s2_x4", "auto"}
        assert all(r.problem == DEC for r in back)
        assert [r.config for r in s.records(problem=DEC.replace(page_size=0, appends=1))] == ["tdec_n128_w8s2_x8"]
    buf = io.StringIO()
    db.write_jsonl(recs, buf)
    lines = buf.getvalue().splitlines()
    first = json.loads(lines[0])["problem"]
    assert first["op"] == "decode" and first["page_size"] == 256 and "appends" not in first
    path = tmp_path / "d.jsonl"
    path.write_text(buf.getvalue())
    with Store(tmp_path / "b.sqlite3") as s:
        rep = db.import_jsonl(s, path)
        assert (rep.added, rep.errors) == (3, [])
        assert sorted(db.record_to_json(r)["uid"] for r in s.records()) == sorted(r.uid for r in recs)
        assert {r.problem for r in s.records()} == {r.problem for r in recs}


def test_cli_export_import_merge_and_kernel_check(tmp_path, capsys):
    src = tmp_path / "src.sqlite3"
    with Store(src) as s:
        s.add(_decode_records())
    out_file = tmp_path / "out.jsonl"
    assert main(["db", "export", "--db", str(src), str(out_file)]) == 0
    assert main(["db", "import", "--db", str(tmp_path / "i.sqlite3"), str(out_file)]) == 0
    assert "imported 3 record(s)" in capsys.readouterr().out
    assert main(["db", "merge", "--db", str(tmp_path / "m.sqlite3"), str(src)]) == 0
    with Store(tmp_path / "m.sqlite3") as s:
        assert s.count() == 3
    check = kernel_check()
    assert check(record(DEC, backend="triton", config="tdec_n64_w4s2_x4")) is None
    assert check(record(DEC, backend="torch", config="auto")) is None
    if not get_backend("triton").unavailable_reasons():  # else it cannot vouch for its configs
        assert "unknown kernel 'tdec_bogus'" in check(record(DEC, backend="triton", config="tdec_bogus"))
    assert "unknown kernel 'flash'" in check(record(DEC, backend="torch", config="flash"))


# --------------------------------------------------------------------------- backends and dispatch


def test_backends_answer_for_decode_problems():
    tri, tor, ref, spark = (get_backend(n) for n in ("triton", "torch", "reference", "spark"))
    assert "decode" in tor.features and "decode" in ref.features and "decode" not in spark.features
    assert spark.feature_reasons(DEC) == ["backend 'spark' does not support the feature 'decode'"]
    assert tor.configs("decode") == ("auto",) and tor.default_config(DEC, DEVICE) == "auto"
    assert tor.runnable_reasons(DEC.replace(softcap=True), "auto", DEVICE) == ["SDPA has no softcap"]
    assert "tdec_n64_w4s2_x4" in tri.configs("decode")
    if not tri.unavailable_reasons():
        assert tri.runnable_reasons(DEC, "tdec_n64_w4s2_x4", DEVICE) == []
        assert tri.default_config(DEC, DEVICE) == "tdec_n64_w4s2_x4"
        assert any("not a decode config" in r for r in tri.runnable_reasons(DEC, "tfwd_m128n64_w8s3", DEVICE))
        assert any("group size * Nq" in r for r in tri.runnable_reasons(DEC.replace(seqlen_q=64), None, DEVICE))


def test_default_order_of_decode_problems(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    dispatch.configure(None)
    sel = dispatch.heuristic_default(DEC.replace(softcap=True), DEVICE)
    tri = get_backend("triton")
    if tri.unavailable_reasons():
        assert sel.candidate.backend == "reference"  # softcap: not SDPA
    else:
        assert sel.candidate == Candidate("triton", "tdec_n64_w4s2_x4") and "decode default" in sel.detail
        assert dispatch.heuristic_default(DEC, DEVICE).candidate.backend == "triton"


def _tensors(batch=2, cap=64, hq=4, hkv=2, d=32, dtype=torch.bfloat16, nq=1):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, nq, hq, d, generator=gen).to(dtype)
    kc = torch.randn(batch, cap, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(batch, cap, hkv, d, generator=gen).to(dtype)
    lens = torch.tensor([cap - 3, cap // 2][:batch], dtype=torch.int32)
    return q, kc, vc, lens


@pytest.fixture
def stand_in_gpu(monkeypatch, tmp_path):
    """CPU tensors dispatched as if on :data:`DEVICE` (so that its records apply), a fresh
    dispatch state over a database of its own and no shipped layer."""
    path = tmp_path / "dispatch.sqlite3"
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    monkeypatch.setattr(plan_mod, "device_info", lambda device: DEVICE)
    monkeypatch.setattr(dispatch, "build_id", lambda: BUILD)
    dispatch.configure(path)
    dispatch.reset_counters()
    yield path
    dispatch.configure(None)


def test_tuned_record_wins_and_repeated_calls_hit_the_plan(stand_in_gpu, monkeypatch):
    q, kc, vc, lens = _tensors()
    key = check_kvcache(q, kc, vc, cache_seqlens=lens).key
    problem = decode_problem(key)
    assert problem == TINY
    with Store(stand_in_gpu) as s:  # the tuned choice: SDPA on the sliced cache
        s.add([record(problem, backend="torch", config="auto", median=0.01)])
    dispatch.reload()
    checked = []
    real_check = kv.check_kvcache
    monkeypatch.setattr(kv, "check_kvcache", lambda *a, **k: checked.append(1) or real_check(*a, **k))
    with torch.no_grad():
        outs = [sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens) for _ in range(3)]
    assert kv.choose_decode(key, q.device).source == "tuned"
    assert kv.select_decode(key, q.device) == ("torch", "auto")
    assert len(checked) == 1  # the later calls reuse the plan of their signature
    assert dispatch.counters()["tuned"] == 3
    assert all(torch.equal(o, outs[0]) for o in outs)
    ref = sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="reference")
    assert (outs[0].double() - ref.double()).abs().max().item() < 2e-2
    # new length values are the same signature; new shapes are a new plan
    n = len(checked)
    sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens.flip(0))
    assert len(checked) == n
    sparktune.attention_with_kvcache(q[:1], kc[:1], vc[:1], cache_seqlens=lens[:1])
    assert len(checked) == n + 1
    # asking for the log-sum-exp never gets the torch path
    _, lse = sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True)
    assert lse.shape == (2, 4, 1) and kv.select_decode(key, q.device, True)[0] != "torch"
    # a reload (e.g. after tuning) plans again; an override wins over the record
    n = len(checked)
    dispatch.reload()
    sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    assert len(checked) == n + 1
    kv.set_decode_choice(key, q.device, "reference", "float64")
    assert kv.choose_decode(key, q.device).source == "chosen"
    got = sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    assert torch.equal(got, ref) or (got.double() - ref.double()).abs().max().item() < 1e-2
    kv._chosen.clear()
    kv._memo.clear()
    kv._plans.clear()


def test_explain_a_decode_problem(stand_in_gpu):
    with Store(stand_in_gpu) as s:
        s.add([record(TINY, backend="torch", config="auto", median=0.01)])
    dispatch.reload()
    text = str(dispatch.explain(TINY, DEVICE))
    assert "problem:  decode:bfloat16:b2:h4/2:n1/64:d32:causal:acc32" in text
    assert "choice:   torch:auto (tuned)" in text
    assert f"{TINY.bytes_read() / 1e-5 / 1e9:.0f} GB/s of K/V" in text
    near = str(dispatch.explain(TINY.replace(batch=4), DEVICE))
    assert "choice:   torch:auto (nearest)" in near
    other_kind = str(dispatch.explain(TINY.replace(page_size=16), DEVICE))
    assert "(default)" in other_kind  # a paged cache is another kind: no nearest from contiguous


def test_repeated_call_still_checks_what_the_signature_cannot(stand_in_gpu):
    q, kc, vc, lens = _tensors()
    with torch.no_grad():
        sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
        bad = lens.clone()
        bad[1] = 65  # past the capacity: a value, not part of the signature
        with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 65"):
            sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=bad)
        with pytest.raises(ValueError, match="config= needs backend= too"):
            sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, config="auto")
        with pytest.raises(ValueError, match="must be different tensors"):
            sparktune.attention_with_kvcache(q, kc, kc, cache_seqlens=lens)
        q.requires_grad_()
        with torch.enable_grad(), pytest.raises(ValueError, match="inference only"):
            sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)


def test_broken_database_never_breaks_a_decode_call(monkeypatch, tmp_path):
    broken = tmp_path / "broken.sqlite3"
    broken.write_bytes(b"this is not a database" * 100)
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    monkeypatch.setattr(plan_mod, "device_info", lambda device: DEVICE)
    dispatch.configure(broken)
    try:
        q, kc, vc, lens = _tensors()
        with torch.no_grad():
            out = sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=False)
        assert out.shape == q.shape
    finally:
        dispatch.configure(None)


# --------------------------------------------------------------------------- the tuner


def _cost(candidate, problem):
    """Decode costs for CostTimer: SDPA (and the baseline) at 2 ms, Triton configs faster the
    more split multiplier they have."""
    if candidate is None or candidate.backend in ("torch", "sdpa"):
        return 2.0
    return 1.0 / int(candidate.config.rsplit("_x", 1)[1]) if "_x" in candidate.config else 1.5


def test_tuner_measures_and_stores_the_torch_candidate(tmp_path, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    with Store(tmp_path / "t.sqlite3") as store, registered_plugin(store.url):
        tuner = Tuner(device=DEVICE, torch_device="cpu", store=store, backends=["torch", "triton", "knowncost"],
                      timer=CostTimer(_cost), trials=2, screen_timer=False)
        order, mode, planned = tuner.plan(TINY)
        labels = [c.label for c in order]
        assert "torch:auto" in labels and "knowncost" not in {c.backend for c in order}
        if not get_backend("triton").unavailable_reasons():
            assert labels[0] == "triton:tdec_n64_w4s2_x4" and len(labels) == 289 and mode == "tpe"
        _, excluded = tuner.candidates(TINY)
        assert "does not support the feature 'decode'" in " ".join(excluded["knowncost"])
        tuner.backends = ["torch"]
        result = tuner.tune(TINY)
        (m,) = result.measurements
        assert (m.candidate.label, m.status) == ("torch:auto", "ok")
        assert 0 <= m.error <= m.error_limit
        assert result.baseline is not None and result.baseline.median_ms == pytest.approx(2.0, rel=0.05)
        (r,) = store.records(problem=TINY)
        assert r.tflops == pytest.approx(TINY.flops() / (r.median_ms * 1e-3) / 1e12)
        sel = dispatch.select(TINY, DEVICE)
        assert (sel.candidate.label, sel.source) == ("torch:auto", "tuned")


def test_decode_workload_check_catches_a_wrong_output():
    from sparktune.tune._decode_workload import DecodeWorkload

    w = DecodeWorkload(TINY.replace(page_size=16, appends=2, alibi=True), "cpu")
    t = w.check_inputs()
    assert t["block_table"].shape == (2, 4) and sorted(t["block_table"].flatten().tolist()) == list(range(8))
    fn, outs = w.launch(get_backend("torch"), Candidate("torch", "auto"), t, fill=float("nan"))
    with torch.no_grad():
        fn()
        fn()  # appends write the same slots again: the same result
    good = w.check(outs)
    assert good.ok and good.what == "out"
    outs["out"] = outs["out"] + 0.05
    bad = w.check(outs)
    assert not bad.ok and "exceeds the bound" in bad.message


# --------------------------------------------------------------------------- the CLI


def test_cli_decode_problem():
    args = build_parser().parse_args([
        "tune", "--decode", "--batch", "8", "--heads", "32", "--heads-kv", "8", "--cache-len", "8000",
        "--paged", "--page-size", "256", "--nq", "1", "--dtype", "bf16",
    ])
    (p,), extra = tune_cli.problems_from_args(args)
    assert p == DEC and extra == {}
    args = build_parser().parse_args(["tune", "--decode", "--heads", "4", "--cache-len", "64", "--appends", "1",
                                      "--no-causal", "--window", "8", "3"])
    (p,), _ = tune_cli.problems_from_args(args)
    assert (p.causal, p.page_size, p.appends, p.window, p.seqlen_k) == (False, 0, 1, (8, 3), 64)


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--decode", "--heads", "4"], "--decode needs --cache-len"),
        (["--decode", "--heads", "4", "--cache-len", "64", "--seqlen", "8"], "--seqlen: not for --decode"),
        (["--decode", "--heads", "4", "--cache-len", "64", "--op", "fwd"], "--op: not for --decode"),
        (["--decode", "--heads", "4", "--cache-len", "64", "--page-size", "16"], "--page-size needs --paged"),
        (["--decode", "--heads", "4", "--cache-len", "64", "--paged", "--page-size", "128"], "--page-size must be between"),
        (["--decode", "--heads", "4", "--cache-len", "0"], "--cache-len must be at least 1"),
        (["--seqlen", "64", "--heads", "4", "--cache-len", "64"], "--cache-len needs --decode"),
        (["--seqlen", "64", "--heads", "4", "--paged"], "--paged needs --decode"),
    ],
)
def test_cli_decode_errors(capsys, argv, expect):
    assert main(["tune", *argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_cli_decode_run_reports_bandwidth(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    dbp = tmp_path / "cli.sqlite3"
    args = build_parser().parse_args(["tune", "--decode", "--batch", "2", "--heads", "4", "--heads-kv", "2",
                                      "--head-dim", "32", "--cache-len", "64", "--dtype", "bf16",
                                      "--backend", "torch", "--db", str(dbp), "--no-progress"])
    problems, extra = tune_cli.problems_from_args(args)
    assert problems == [TINY]
    with registered_plugin(dbp):
        code = tune_cli.run(args, problems, extra, device=DEVICE, torch_device="cpu", timer=CostTimer(_cost))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "decode:bfloat16:b2:h4/2:n1/64:d32:causal:acc32" in out and "GB/s" in out
    assert "PyTorch SDPA on the sliced cache" in out and "torch:auto" in out


def test_shipped_decode_records_are_dispatched(stand_in_gpu, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "test-gpu.jsonl").write_text(
        db.dumps_record(record(TINY, backend="torch", config="auto", median=0.02)) + "\n")
    monkeypatch.setenv(dispatch.ENV_SHIPPED, str(shipped))
    dispatch.reload()
    sel = dispatch.select(TINY, DEVICE)
    assert (sel.candidate.label, sel.source, sel.record.source) == ("torch:auto", "tuned", "shipped:test-gpu.jsonl")
    q, kc, vc, lens = _tensors()
    with torch.no_grad():
        sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    key = check_kvcache(q, kc, vc, cache_seqlens=lens).key
    assert kv.choose_decode(key, q.device).source == "tuned"

"""What a build compiles for SPARKTUNE_KERNELS: the default build (each default configuration
and the spark winners of the shipped records), 'all', patterns, and their union; no compiler
or GPU needed."""

from __future__ import annotations

import json
from pathlib import Path

from sparktune.kernels import kernel_space as ks

ROOT = Path(__file__).resolve().parent.parent
SPACE = ks.full_space()
NAMES = {e.name for e in SPACE}


def _names(entries):
    return [e.name for e in entries]


def test_every_default_is_declared_once_per_dtype():
    """Each default of the tables names a declared entry, for each dtype the family declares
    at that head dim, and exactly one per (family, op, dtype, head dim)."""
    defaults = [e for e in SPACE if ks.is_default(e)]
    keys = [(type(e).__name__, getattr(e, "family", 90), e.dtype, e.head_dim) for e in defaults]
    assert len(keys) == len(set(keys)), sorted(keys)
    for (fam, hd) in ks.FWD_DEFAULTS:
        dts = {e.dtype for e in SPACE if isinstance(e, ks.FwdEntry) and e.family == fam and e.head_dim == hd}
        got = {e.dtype for e in defaults if isinstance(e, ks.FwdEntry) and e.family == fam and e.head_dim == hd}
        assert dts and got == dts, (fam, hd, dts, got)
    for (fam, hd) in ks.BWD_DEFAULTS:
        got = {e.dtype for e in defaults if isinstance(e, ks.BwdEntry) and e.family == fam and e.head_dim == hd}
        assert got, (fam, hd)
    for (op, hd) in ks.SM90_DEFAULTS:
        kind = ks.Fwd90Entry if op == "fwd" else ks.Bwd90Entry
        got = {e.dtype for e in defaults if isinstance(e, kind) and e.head_dim == hd}
        named = [e for e in SPACE if isinstance(e, kind) and e.head_dim == hd
                 and e.name.endswith(f"_d{hd}_{ks.SM90_DEFAULTS[(op, hd)]}")]
        assert {e.dtype for e in named} == {"f16", "bf16"}, (op, hd)
        if all(ks.is_unverified(e.name) for e in named):
            assert got == set(), (op, hd, got)  # no default until its device check passes
        else:
            assert got == {"f16", "bf16"}, (op, hd, got)


def test_unverified_kernels_are_never_built_by_default_nor_chosen(monkeypatch):
    """The configurations that wait for their first GPU check: out of the default build, out
    of the spark backend's candidates (so never tuned, dispatched or a default), runnable
    when forced by name."""
    from sparktune.backends.spark import SparkBackend
    from sparktune.problem import DeviceInfo, Problem

    # the mechanism, on a family that could wait for its check (none does today)
    monkeypatch.setattr(ks, "UNVERIFIED", ("bwd_sm90_*",))
    unverified = [e for e in SPACE if ks.is_unverified(e.name)]
    assert unverified
    assert not set(_names(unverified)) & set(_names(ks.build_selection(SPACE, "", ROOT / "tuning_db")))
    b = SparkBackend()
    e = next(x for x in unverified if x.dtype == "f16")
    facts = dict(name=e.name, op=e.name[:3], family=90, atom="wgmma", dtype="float16", head_dim=e.head_dim,
                 block_m=e.block_m, block_n=e.block_n, warps_m=4, warps_n=1, accum=32, softmax="reg",
                 threads=384, smem_bytes=1024, min_arch=90, archs=[90])
    b._kernels = {e.name: facts}
    monkeypatch.setattr(b, "unavailable_reasons", lambda: [])
    monkeypatch.setattr(b, "build_info", lambda: {"archs": [90]})
    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132)
    p = Problem(facts["op"], "float16", 1, 2, 2, 256, 256, e.head_dim, True)
    assert b.not_supported_reasons(p, e.name, h200) == []  # forced: runs
    assert b.candidates(p, h200) == [] and b.default_config(p, h200) is None


def test_the_default_build_is_defaults_and_shipped_winners(tmp_path):
    problem = {"op": "fwd", "dtype": "float16", "batch": 1, "heads_q": 2, "heads_kv": 2,
               "seqlen_q": 512, "seqlen_k": 512, "head_dim": 64, "causal": False}
    dev = {"name": "GPU", "capability": [9, 0], "sm_count": 1}

    def rec(config, median, backend="spark", status="ok", **kw):
        return json.dumps(dict(problem=problem, device=dev, build_id="b", backend=backend, config=config,
                               status=status, time_ms={"median": median}, **kw))

    winner, slower = "fwd_sm80_f16_d64_m64n64_w4x1_acc32_preg", "fwd_sm80_f16_d64_m128n128_w8x1_acc32_preg"
    wrong = "fwd_sm80_f16_d64_m64n128_w4x1_acc32_preg"
    lines = [rec(winner, 1.0), rec(slower, 2.0), rec(wrong, 0.5, error=1.0, error_limit=0.1),
             rec("cudnn", 0.1, backend="torch"), rec(wrong, 0.2, status="wrong"), "not json"]
    (tmp_path / "gpu.jsonl").write_text("\n".join(lines) + "\n")
    assert ks.shipped_winners(tmp_path) == {winner}
    chosen = _names(ks.build_selection(SPACE, "", tmp_path))
    assert winner in chosen and slower not in chosen and wrong not in chosen
    assert set(chosen) == {e.name for e in SPACE if ks.is_default(e)} | {winner}
    assert chosen == _names(ks.build_selection(SPACE, "default", tmp_path))


def test_all_patterns_and_unions():
    assert _names(ks.build_selection(SPACE, "all")) == _names(SPACE)
    sm90 = _names(ks.build_selection(SPACE, "fwd_sm90_*"))
    assert sm90 and all(n.startswith("fwd_sm90_") for n in sm90)
    both = _names(ks.build_selection(SPACE, "default, fwd_sm90_*", None))
    defaults = {e.name for e in SPACE if ks.is_default(e)}
    assert set(both) == defaults | set(sm90)
    assert len(both) == len(set(both))


def test_the_shipped_winners_are_declared_and_few():
    """The repository's own records: every winner is a declared kernel, and the default build
    stays a small part of the space (what keeps its build time short)."""
    winners = ks.shipped_winners(ROOT / "tuning_db")
    assert winners <= NAMES, winners - NAMES
    chosen = ks.build_selection(SPACE, "", ROOT / "tuning_db")
    assert len(chosen) < len(SPACE) / 3

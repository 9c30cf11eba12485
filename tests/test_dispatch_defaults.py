"""Out of the box never slower than SDPA: the default for a problem no record reaches is
measured per architecture (SDPA's own choice from sm_80 on, sparktune's kernels on Volta), a
record serves shapes that differ only in batch, heads or GQA ratio and nearby sequence
lengths, and dispatch never prefers what the records place below SDPA's own choice."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from sparktune import dispatch
from sparktune.backends.base import Candidate
from sparktune.backends.reference import ReferenceBackend
from sparktune.backends.torch_sdpa import AUTO, TorchSDPABackend
from sparktune.db import Store
from sparktune.problem import DeviceInfo
from tests._store_helpers import BUILD, DEVICE, problem, record, registered_plugin

# the module (dispatch has a function of the same name)
_resolve = importlib.import_module("sparktune.dispatch._resolve")

VOLTA = DeviceInfo("Tesla V100-SXM2-32GB", (7, 0), 80, driver="1", cuda="12.0")
HOPPER = DEVICE  # sm_90


class _StandInSpark(ReferenceBackend):
    """Stands in for the CUDA family (not built on a CPU machine): runs whatever it is asked."""

    name = "spark"
    tunable = True

    def configs(self, op="fwd"):
        return ("fwd_sm80_f16_d64_m128n64_w4x1_acc32_preg",) if op == "fwd" else ("bwd_sm80_f16_d64_m128n64_w4x1_acc32",)

    def not_supported_reasons(self, problem, config=None, device=None):
        return [] if device is not None else ["needs CUDA"]


def _registered() -> dict:
    return {"spark": _StandInSpark(), "torch": TorchSDPABackend(), "reference": ReferenceBackend()}


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_default_per_architecture(op):
    p = problem(op=op, dtype="bfloat16", heads_q=16, heads_kv=4, head_dim=128, causal=True)
    hopper = _resolve.heuristic_default(p, HOPPER, registered=_registered())
    assert hopper.candidate == Candidate("torch", AUTO) and hopper.source == "default"
    assert "SDPA's own choice" in hopper.detail
    volta = _resolve.heuristic_default(p, VOLTA, registered=_registered())
    assert volta.candidate.backend == "spark"
    assert "sm_80" in volta.detail
    assert _resolve.default_order(VOLTA)[0] == "spark"
    assert _resolve.default_order(HOPPER)[0] == "torch"
    # tensors off the GPU keep the math kernel (SDPA's public call is not forced there)
    assert _resolve.heuristic_default(p, None, registered=_registered()).candidate == Candidate("torch", "math")


class _StandInTriton(ReferenceBackend):
    """Stands in for the Triton family (no GPU here): runs whatever it is asked on a GPU."""

    name = "triton"

    def not_supported_reasons(self, problem, config=None, device=None):
        return [] if device is not None else ["needs CUDA"]


@pytest.mark.parametrize("features", [dict(varlen=True, batch=8, seqlen_q=512, seqlen_k=512, total_q=4096, total_k=4096),
                                      dict(window_left=256), dict(softcap=True), dict(alibi=True),
                                      dict(dropout=True)])
def test_attention_features_default_to_the_triton_family_on_a_gpu(features):
    """With window, soft-capping, ALiBi, dropout or packed sequences, no record and a GPU from
    sm_80 on, the Triton family comes first (the torch backend's default there, FlexAttention,
    builds its block mask on every call); plain problems keep SDPA's own choice, CPU tensors
    and Volta keep their orders."""
    reg = {**_registered(), "triton": _StandInTriton()}
    del reg["spark"]  # (its stand-in runs anything; the real one runs some of these forwards)
    p = problem(dtype="bfloat16", heads_q=16, heads_kv=16, head_dim=128, causal=True, **features)
    sel = _resolve.heuristic_default(p, HOPPER, registered=reg)
    assert sel.candidate.backend == "triton" and sel.source == "default", sel
    if p.varlen:  # the Hopper kernels come first there, forward and backward, and cannot run here
        for op in ("fwd", "bwd"):
            pv = dataclasses.replace(p, op=op)
            sel = _resolve.heuristic_default(pv, HOPPER, registered=reg)
            assert sel.candidate.backend == "triton", sel
            assert "the Hopper kernels first (forward and backward), then the Triton family" in sel.detail
            assert _resolve.default_order(HOPPER, pv) == _resolve.HOPPER_VARLEN_ORDER
        p = dataclasses.replace(p, dropout=True)  # with dropout: the Triton family first
    elif not p.dropout:  # windows, softcap, ALiBi: the Hopper kernels first (cannot run here)
        for op in ("fwd", "bwd"):
            pv = dataclasses.replace(p, op=op)
            sel = _resolve.heuristic_default(pv, HOPPER, registered=reg)
            assert "the Hopper kernels first (forward and backward), then the Triton family" in sel.detail
            assert _resolve.default_order(HOPPER, pv) == _resolve.HOPPER_FEATURE_FWD_ORDER
        p = dataclasses.replace(p, dropout=True)  # with dropout: the Triton family first
    for op in ("fwd", "bwd"):
        p = dataclasses.replace(p, op=op)
        assert "Triton family" in _resolve.heuristic_default(p, HOPPER, registered=reg).detail
        assert _resolve.default_order(HOPPER, p) == _resolve.FEATURE_DEFAULT_ORDER
        assert _resolve.default_order(VOLTA, p) == _resolve.VOLTA_DEFAULT_ORDER
        assert _resolve.default_order(None, p) == _resolve.DEFAULT_ORDER
    plain = problem(dtype="bfloat16", heads_q=16, heads_kv=16, head_dim=128, causal=True)
    assert _resolve.heuristic_default(plain, HOPPER, registered=reg).candidate == Candidate("torch", AUTO)


class _StandInHopper(ReferenceBackend):
    """Stands in for the spark backend on an H200: its family 90 forward runs packed sequences,
    sliding windows, soft-capping and ALiBi, its family 90 backward packed sequences (also
    deterministic); nothing else with features."""

    name = "spark"
    features = frozenset({"deterministic", "varlen", "window", "softcap", "alibi"})

    def not_supported_reasons(self, problem, config=None, device=None):
        return [] if device is not None else ["needs CUDA"]


class _StandInHopperForwardOnly(_StandInHopper):
    """The same with no packed-sequence backward (a build without bwd_sm90 kernels)."""

    def not_supported_reasons(self, problem, config=None, device=None):
        if device is None:
            return ["needs CUDA"]
        hopper_only = problem.features & {"varlen", "window", "softcap", "alibi"}
        return ["no backward with these features"] if hopper_only and problem.op == "bwd" else []


def test_packed_sequences_on_hopper_default_to_the_hopper_family():
    """The forward and the backward (deterministic or not) of packed sequences with no other
    feature, on sm_90 and with no record: the Hopper kernels first (a packed training call runs
    the sm90 forward and the sm90 backward); with another feature, or on another GPU, the
    Triton family; where the spark backend cannot run the backward, the Triton family runs it."""
    reg = {**_registered(), "triton": _StandInTriton(), "spark": _StandInHopper()}
    varlen = dict(varlen=True, batch=8, seqlen_q=2048, seqlen_k=2048, total_q=16384, total_k=16384)
    p = problem(dtype="bfloat16", heads_q=16, heads_kv=16, head_dim=128, causal=True, **varlen)
    ops = (p, dataclasses.replace(p, op="bwd"), dataclasses.replace(p, op="bwd", deterministic=True))
    for q in ops:
        sel = _resolve.heuristic_default(q, HOPPER, registered=reg)
        assert sel.candidate.backend == "spark" and "the Hopper kernels first" in sel.detail, (q, sel)
        assert _resolve.default_order(HOPPER, q) == _resolve.HOPPER_VARLEN_ORDER
    # another GPU, or dropout with it: the Triton family; with a window too: the Hopper
    # kernels (the features' order), forward and backward
    for q in ops:
        for other, device in ((q, dataclasses.replace(HOPPER, capability=(8, 0))),
                              (dataclasses.replace(q, dropout=True), HOPPER)):
            assert _resolve.heuristic_default(other, device, registered=reg).candidate.backend == "triton"
    windowed = dataclasses.replace(p, window_left=256)
    sel = _resolve.heuristic_default(windowed, HOPPER, registered=reg)
    assert sel.candidate.backend == "spark" and "windows, soft-capping or ALiBi" in sel.detail, sel
    for q in ops[1:]:
        other = dataclasses.replace(q, window_left=256)
        sel = _resolve.heuristic_default(other, HOPPER, registered=reg)
        assert sel.candidate.backend == "spark" and "windows, soft-capping or ALiBi" in sel.detail, sel
    # a spark build without the packed backward: the forward stays on it, the backward moves on
    reg["spark"] = _StandInHopperForwardOnly()
    assert _resolve.heuristic_default(p, HOPPER, registered=reg).candidate.backend == "spark"
    for q in ops[1:]:
        sel = _resolve.heuristic_default(q, HOPPER, registered=reg)
        assert sel.candidate.backend == "triton" and "the Hopper kernels first" in sel.detail, sel


@pytest.mark.parametrize("features", [dict(window_left=4095), dict(window_left=3, window_right=5, causal=False),
                                      dict(softcap=True), dict(alibi=True),
                                      dict(window_left=1023, softcap=True, alibi=True)])
def test_window_softcap_alibi_forward_on_hopper_defaults_to_the_hopper_family(features):
    """Windows, soft-capping and ALiBi (alone or together): on sm_90 the forward and the
    backward try the Hopper kernels first (HOPPER_FEATURE_FWD_ORDER); where the spark backend
    has no such backward (a build without bwd_sm90 kernels), the Triton family runs it; with
    dropout, and on other GPUs, the Triton family first for both."""
    reg = {**_registered(), "triton": _StandInTriton(), "spark": _StandInHopperForwardOnly()}
    kw = dict(dtype="bfloat16", heads_q=16, heads_kv=16, head_dim=128, causal=True)
    p = problem(**{**kw, **features})
    assert _resolve.default_order(HOPPER, p) == _resolve.HOPPER_FEATURE_FWD_ORDER
    assert _resolve.HOPPER_FEATURE_FWD_ORDER[0] == "spark"
    sel = _resolve.heuristic_default(p, HOPPER, registered=reg)
    assert sel.candidate.backend == "spark" and sel.source == "default", sel
    assert "windows, soft-capping or ALiBi on sm_90: the Hopper kernels first" in sel.detail
    bwd = dataclasses.replace(p, op="bwd")
    assert _resolve.default_order(HOPPER, bwd) == _resolve.HOPPER_FEATURE_FWD_ORDER
    sel = _resolve.heuristic_default(bwd, HOPPER, registered={**reg, "spark": _StandInHopper()})
    assert sel.candidate.backend == "spark", sel
    # (the forward-only stand-in: the backward moves on to the Triton family)
    assert _resolve.heuristic_default(bwd, HOPPER, registered=reg).candidate.backend == "triton"
    dropout = dataclasses.replace(p, dropout=True)
    assert _resolve.default_order(HOPPER, dropout) == _resolve.FEATURE_DEFAULT_ORDER
    assert _resolve.heuristic_default(dropout, HOPPER, registered=reg).candidate.backend == "triton"
    ampere = dataclasses.replace(HOPPER, capability=(8, 0))
    assert _resolve.default_order(ampere, p) == _resolve.FEATURE_DEFAULT_ORDER
    assert _resolve.heuristic_default(p, ampere, registered=reg).candidate.backend == "triton"
    # where the Hopper forward cannot run the problem, the next in the order takes it
    del reg["spark"]
    assert _resolve.heuristic_default(p, HOPPER, registered=reg).candidate.backend == "triton"


@pytest.fixture
def store_path(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatch, "build_id", lambda: BUILD)
    path = tmp_path / "d.sqlite3"
    with registered_plugin(path):
        yield path


def _fill(path, records):
    with Store(path) as s:
        s.add(records)
    dispatch.reload()


def test_a_record_serves_other_batches_heads_and_gqa_ratios(store_path):
    tuned = problem(heads_q=16, heads_kv=4, seqlen_q=8192, seqlen_k=8192, causal=True)
    _fill(store_path, [record(tuned, config="fast", median=1.0), record(tuned, config="slow", median=2.0)])
    served = [
        dataclasses.replace(tuned, batch=4),
        dataclasses.replace(tuned, heads_q=32, heads_kv=4),  # GQA 8:1
        dataclasses.replace(tuned, heads_q=64, heads_kv=8, batch=2),
        dataclasses.replace(tuned, seqlen_q=4096, seqlen_k=4096),  # one octave
    ]
    for p in served:
        sel = dispatch.select(p, DEVICE)
        assert (sel.candidate.config, sel.source) == ("fast", "nearest"), p
        assert "heads 16/4" in sel.detail and "GQA ratio" in sel.detail
        text = str(dispatch.explain(p, DEVICE))
        assert "nearest tuned shape" in text
    not_served = [
        dataclasses.replace(tuned, heads_kv=16),  # not grouped: SDPA backends that repeat K/V rank otherwise
        dataclasses.replace(tuned, seqlen_q=2048, seqlen_k=2048),  # two octaves away
        dataclasses.replace(tuned, causal=False),
        dataclasses.replace(tuned, dtype="bfloat16"),
    ]
    for p in not_served:
        assert dispatch.select(p, DEVICE).source == "default", p


def test_never_below_sdpa_own_choice(store_path):
    """Where records measured SDPA's own choice fastest, dispatch runs it, tuned or nearest;
    a backend the records place below it is not chosen."""
    tuned = problem(heads_q=16, heads_kv=4, seqlen_q=2048, seqlen_k=2048, causal=True)
    _fill(
        store_path,
        [
            record(tuned, backend="torch", config=AUTO, median=0.5),
            record(tuned, backend="torch", config="cudnn", median=0.6),
            record(tuned, config="fast", median=0.7),
        ],
    )
    for p in (tuned, dataclasses.replace(tuned, batch=3, heads_q=32)):
        sel = dispatch.select(p, DEVICE)
        assert sel.candidate == Candidate("torch", AUTO), p
        assert sel.source in ("tuned", "nearest")

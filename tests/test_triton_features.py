"""The Triton family's attention features (docs/FEATURES.md): sliding windows, softcap, ALiBi,
dropout, deterministic backward and varlen, forward and backward, under Triton's CPU
interpreter on small shapes against a float64 implementation written here from the
definitions (not the reference backend), with FlashAttention's 2x rule: the kernel's max abs
error is at most twice PyTorch's own error in the same precision plus a small floor.

As in tests/test_triton.py, the interpreter must be chosen before triton is imported, so the
``test_interp_*`` tests run once in a child pytest process with ``TRITON_INTERPRET=1`` and each
one here reports the child's outcome. The offline compile checks (sm_90, Triton's bundled
ptxas, no GPU) run in this process.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from sparktune.kernels import triton_space as space
from sparktune.problem import Problem
from tests._features_baseline import feature_attention
from tests._interp import delegated, in_child, run_child

FWD = "tfwd_m16n16_w1s1"
#: a separate dQ kernel (deterministic) and atomic dQ
BWD = ("tbwd_m16n16_w1s1", "tbwd_m16n32_w1s1_dqatomic")
FLOOR = 1e-5


# ------------------------------------------------------------------------------------------
# the float64 definition and PyTorch's same-precision baseline
# ------------------------------------------------------------------------------------------


def _max_err(a, ref, where=None):
    diff = (a.double() - ref.double()).abs()
    if where is not None:
        diff = diff[where]
    return diff.max().item() if diff.numel() else 0.0


def _check(name, got, ref64, lowp, floor=FLOOR):
    err, base = _max_err(got, ref64), _max_err(lowp, ref64)
    assert math.isfinite(err), f"{name}: non-finite values"
    assert err <= 2 * base + floor, f"{name}: error {err:.3g} > 2 x torch's {base:.3g} + {floor}"


def _run_and_check(kernels, q, k, v, *, scale, feats, ref_kw, bwd_configs=BWD, dropout=None):
    """Forward (FWD) and backward (each of bwd_configs) with ``feats`` (the kernel keywords)
    against float64 with the 2x rule; ``ref_kw`` are _attention's keywords. ``dropout`` is
    (p, seed, offset) or None."""
    torch.manual_seed(1234)
    dout = torch.randn_like(q)
    keep = None
    kfeats = dict(feats)
    if dropout is not None:
        p, seed, offset = dropout
        kfeats.update(dropout_p=p, seed=seed, offset=offset)
        if "cu_seqlens_q" in feats:
            shape = (q.shape[1], q.shape[0], feats["max_seqlen_k"])
        else:
            shape = (*q.shape[:3], k.shape[2])
        keep = kernels.dropout_mask(shape, p, seed, offset)
        ref_kw = dict(ref_kw, keep=keep, dropout_p=p)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, lse64 = feature_attention(q64, k64, v64, scale=scale, **ref_kw)
    o64.backward(dout.double())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    olow, _ = feature_attention(ql, kl, vl, scale=scale, **ref_kw)
    olow.backward(dout)

    out = torch.full_like(q, float("nan"))
    lse = kernels.attention_forward(q, k, v, out, config=FWD, scale=scale, **kfeats)
    _check("out", out, o64, olow)
    empty = torch.isinf(lse64)
    assert torch.equal(torch.isneginf(lse), empty), "rows with lse -inf differ"
    assert _max_err(lse, lse64, ~empty) < 1e-3, "lse"
    if "cu_seqlens_q" in feats:
        assert (out.transpose(0, 1)[empty] == 0).all(), "rows that see no key must be 0"
    else:
        assert (out[empty] == 0).all(), "rows that see no key must be 0"
    for cfg in bwd_configs:
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        kernels.attention_backward(dout, q, k, v, out, lse, dq, dk, dv, config=cfg, scale=scale,
                                   **kfeats)
        for name, g, g64, glow in (("dq", dq, q64.grad, ql.grad), ("dk", dk, k64.grad, kl.grad),
                                   ("dv", dv, v64.grad, vl.grad)):
            _check(f"{cfg} {name}", g, g64, glow)
    return out, lse


# ------------------------------------------------------------------------------------------
# the interpreted child process
# ------------------------------------------------------------------------------------------

_CHILD_FLAG = "_SPARKTUNE_TRITON_FEATURES_INTERPRETED"
IN_CHILD = in_child(_CHILD_FLAG)
_CHILD_TIMEOUT_S = 1500


@pytest.fixture(scope="module")
def child_report(tmp_path_factory):
    return run_child(__file__, _CHILD_FLAG, tmp_path_factory, timeout_s=_CHILD_TIMEOUT_S, what="feature tests")


def _delegated(request) -> bool:
    return delegated(request, IN_CHILD)


@pytest.fixture
def kernels():
    from sparktune.kernels import triton_attn

    assert triton_attn.INTERPRET, "TRITON_INTERPRET was not set when the kernels were imported"
    return triton_attn


def _dense(b, hq, hk, nq, nk, d, dtype, seed):
    torch.manual_seed(seed)
    q = torch.randn(b, hq, nq, d, dtype=dtype)
    k = torch.randn(b, hk, nk, d, dtype=dtype)
    v = torch.randn(b, hk, nk, d, dtype=dtype)
    return q, k, v


F16, BF16 = torch.float16, torch.bfloat16

# (id, (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype), scale, kernel keywords)
DENSE_CASES = [
    ("window_5_3", (1, 2, 1, 37, 45, 32, F16), None, dict(causal=False, window=(5, 3))),
    ("causal_left7", (2, 2, 2, 33, 33, 32, BF16), None, dict(causal=True, window=(7, -1))),
    # more queries than keys: the first rows' windows hold no key (output 0, lse -inf)
    ("window_no_key_rows", (1, 2, 2, 40, 20, 32, F16), None, dict(causal=False, window=(4, 2))),
    ("diagonal_only_d48", (1, 2, 2, 17, 17, 48, F16), None, dict(causal=False, window=(0, 0))),
    ("right_only", (1, 2, 1, 20, 33, 32, BF16), None, dict(causal=False, window=(-1, 6))),
    ("window_wider_than_seq", (1, 1, 1, 17, 17, 32, F16), None,
     dict(causal=True, window=(100, 100))),
    ("softcap_causal", (2, 2, 1, 33, 33, 32, F16), 0.5, dict(causal=True, softcap=2.0)),
    ("softcap_full_d64", (1, 2, 2, 37, 45, 64, BF16), 0.4, dict(causal=False, softcap=5.0)),
    ("alibi_heads", (2, 4, 2, 33, 45, 32, F16), None, dict(causal=True, alibi="h")),
    ("alibi_batch_heads", (2, 2, 2, 29, 29, 32, BF16), None, dict(causal=False, alibi="bh")),
    ("causal_window_softcap_alibi_gqa", (1, 4, 2, 45, 37, 32, BF16), 0.5,
     dict(causal=True, window=(9, -1), softcap=3.0, alibi="bh")),
]


def _slopes(kind, b, hq):
    gen = torch.Generator().manual_seed(7)
    shape = (hq,) if kind == "h" else (b, hq)
    return torch.rand(shape, generator=gen, dtype=torch.float32) * 0.5


@pytest.mark.parametrize("case", DENSE_CASES, ids=[c[0] for c in DENSE_CASES])
def test_interp_dense_features(request, case):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    name, (b, hq, hk, nq, nk, d, dtype), scale, kw = case
    q, k, v = _dense(b, hq, hk, nq, nk, d, dtype, seed=nq * 31 + nk)
    scale = scale or 1.0 / math.sqrt(d)
    feats = dict(kw)
    ref_kw = {key: val for key, val in kw.items() if key != "alibi"}
    if "alibi" in kw:
        feats["alibi_slopes"] = ref_kw["slopes"] = _slopes(feats.pop("alibi"), b, hq)
    _run_and_check(kernels, q, k, v, scale=scale, feats=feats, ref_kw=ref_kw)


def _packed(lens_q, lens_k, hq, hk, d, dtype, seed):
    torch.manual_seed(seed)
    cu_q = [0]
    cu_k = [0]
    for a, c in zip(lens_q, lens_k, strict=True):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + c)
    q = torch.randn(cu_q[-1], hq, d, dtype=dtype)
    k = torch.randn(cu_k[-1], hk, d, dtype=dtype)
    v = torch.randn(cu_k[-1], hk, d, dtype=dtype)
    varlen = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
                  cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
                  max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return q, k, v, varlen, dict(cu_q=cu_q, cu_k=cu_k)


# (id, query lengths, key lengths, heads_q, heads_kv, head_dim, dtype, kernel keywords)
VARLEN_CASES = [
    ("plain_full_d64", (17, 1, 32), (17, 1, 32), 2, 2, 64, F16, dict(causal=False)),
    # an empty query sequence and an empty key sequence (its rows see nothing)
    ("causal_window_softcap_alibi_gqa", (5, 0, 32, 13), (9, 11, 0, 41), 4, 2, 32, BF16,
     dict(causal=True, window=(6, -1), softcap=2.5, alibi="bh")),
    ("window_both_sides", (19, 33), (23, 30), 2, 1, 32, F16, dict(causal=False, window=(3, 5))),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_interp_varlen_features(request, case):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    name, lens_q, lens_k, hq, hk, d, dtype, kw = case
    q, k, v, varlen, ref_cu = _packed(lens_q, lens_k, hq, hk, d, dtype, seed=sum(lens_q) + d)
    feats = dict(kw, **varlen)
    ref_kw = {key: val for key, val in kw.items() if key != "alibi"}
    ref_kw.update(ref_cu)
    if "alibi" in kw:
        feats["alibi_slopes"] = ref_kw["slopes"] = _slopes(feats.pop("alibi"), len(lens_q), hq)
    out, lse = _run_and_check(kernels, q, k, v, scale=1.0 / math.sqrt(d), feats=feats,
                              ref_kw=ref_kw)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])


def test_interp_dropout_dense_and_replay(request):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    q, k, v = _dense(2, 4, 2, 21, 27, 32, F16, seed=3)
    # a 64-bit seed and an offset past 2**32: both words of each reach the generator
    dropout = (0.3, 2**40 + 12345, 2**33 + 8)
    feats = dict(causal=True)
    out, lse = _run_and_check(kernels, q, k, v, scale=0.3, feats=feats,
                              ref_kw=dict(causal=True), dropout=dropout)
    again = torch.empty_like(out)
    kernels.attention_forward(q, k, v, again, config=FWD, scale=0.3, causal=True,
                              dropout_p=0.3, seed=dropout[1], offset=dropout[2])
    assert torch.equal(out, again), "the same seed and offset replay the same output"
    other = torch.empty_like(out)
    kernels.attention_forward(q, k, v, other, config=FWD, scale=0.3, causal=True,
                              dropout_p=0.3, seed=dropout[1], offset=dropout[2] + 4)
    assert not torch.equal(out, other), "another offset draws another mask"


def test_interp_dropout_varlen_window(request):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    q, k, v, varlen, ref_cu = _packed((9, 22), (14, 25), 2, 1, 32, BF16, seed=5)
    kw = dict(causal=True, window=(7, -1))
    _run_and_check(kernels, q, k, v, scale=0.25, feats=dict(kw, **varlen),
                   ref_kw=dict(kw, **ref_cu), dropout=(0.2, 99, 12))


def test_interp_dropout_mask_statistics(request):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    shape = (2, 3, 40, 50)
    for p in (0.1, 0.5):
        keep = kernels.dropout_mask(shape, p, seed=123, offset=0)
        assert keep.shape == shape and keep.dtype == torch.bool
        n = keep.numel()
        frac = keep.float().mean().item()
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(frac - (1 - p)) < 5 * sigma, f"keep fraction {frac:.4f} for p={p}"
        assert torch.equal(keep, kernels.dropout_mask(shape, p, seed=123, offset=0))
        assert not torch.equal(keep, kernels.dropout_mask(shape, p, seed=124, offset=0))
    assert kernels.dropout_mask(shape, 0.0, seed=1, offset=0).all()


def test_interp_dropout_mask_is_the_reference_definition(request):
    """The kernels' keep mask is sparktune.dropout's, bit for bit: rows in the log-sum-exp's
    layout, keys within the sequence, seeds and offsets past 32 bits, p where the threshold
    needs all 32 bits."""
    if _delegated(request):
        return
    from sparktune.dropout import dropout_keep, dropout_key

    kernels = request.getfixturevalue("kernels")
    shape = (2, 3, 21, 37)
    rows = torch.arange(2 * 3 * 21).view(2, 3, 21, 1)
    cols = torch.arange(37).view(1, 1, 1, -1)
    for p, seed, offset in ((0.1, 2**40 + 7, 2**33 + 4), (0.75, 5, 0), (0.5, 2**63 - 1, 2**62)):
        want = dropout_keep(dropout_key(seed, offset), rows, cols, p)
        assert torch.equal(kernels.dropout_mask(shape, p, seed, offset), want), (p, seed, offset)


def test_interp_deterministic_backward(request):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    q, k, v = _dense(1, 4, 2, 33, 33, 32, BF16, seed=11)
    dout = torch.randn_like(q)
    kw = dict(causal=True, window=(9, -1), softcap=3.0)
    out = torch.empty_like(q)
    lse = kernels.attention_forward(q, k, v, out, config=FWD, scale=0.3, **kw)
    runs = []
    for _ in range(3):
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        kernels.attention_backward(dout, q, k, v, out, lse, *grads, config=BWD[0], scale=0.3,
                                   deterministic=True, **kw)
        runs.append(grads)
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads, runs[0], strict=True))
    with pytest.raises(ValueError, match="deterministic"):
        kernels.attention_backward(dout, q, k, v, out, lse, *runs[0], config=BWD[1], scale=0.3,
                                   deterministic=True, **kw)


def test_interp_bad_feature_arguments(request):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    q, k, v = _dense(2, 4, 2, 8, 8, 32, F16, seed=0)
    out = torch.empty_like(q)

    def fwd(**kw):
        return kernels.attention_forward(q, k, v, out, config=FWD, scale=1.0,
                                         **dict(dict(causal=False), **kw))

    with pytest.raises(ValueError, match="window"):
        fwd(window=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        fwd(softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes must be"):
        fwd(alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="float32"):
        fwd(alibi_slopes=torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="dropout_p"):
        fwd(dropout_p=1.0)
    packed = q[0].transpose(0, 1).contiguous()
    cu = torch.tensor([0, 8], dtype=torch.int32)

    def varlen(**kw):
        return kernels.attention_forward(packed, packed[:, :2], packed[:, :2],
                                         torch.empty_like(packed), config=FWD, scale=1.0,
                                         causal=False, **kw)

    with pytest.raises(ValueError, match="varlen needs"):
        varlen(cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="int32"):
        varlen(cu_seqlens_q=cu.long(), cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8)
    with pytest.raises(ValueError, match="same length"):
        varlen(cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 4, 8], dtype=torch.int32),
               max_seqlen_q=8, max_seqlen_k=8)
    with pytest.raises(ValueError, match="packed"):
        fwd(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8)


# ------------------------------------------------------------------------------------------
# pure Python: the window normalisation and the config rules
# ------------------------------------------------------------------------------------------


def test_window_normalisation():
    pytest.importorskip("triton")
    from sparktune.kernels.triton_attn import _normalise_window as norm

    # (causal, window, nq, nk) -> (causal kernel, band kernel, left, right)
    assert norm(False, (-1, -1), 100, 100) == (False, False, 0, 0)
    assert norm(True, None, 100, 100) == (True, False, 0, 0)
    assert norm(False, (-1, 0), 100, 100) == (True, False, 0, 0)  # is causal
    assert norm(True, (10, 5), 100, 100) == (False, True, 10, 0)  # causal sets right = 0
    assert norm(True, (99, -1), 100, 100) == (True, False, 0, 0)  # reaches every key: causal
    assert norm(False, (500, 500), 100, 100) == (False, False, 0, 0)
    causal, band, left, right = norm(False, (-1, 3), 100, 100)
    assert (causal, band, right) == (False, True, 3) and left > 200  # beyond every key
    with pytest.raises(ValueError, match="window"):
        norm(False, (0, -3), 10, 10)


def test_deterministic_problems_refuse_atomic_dq():
    p = Problem("bwd", "bfloat16", 1, 8, 8, 1024, 1024, 64, True, deterministic=True)
    atomic = space.parse_config("tbwd_m64n128_w8s2_dqatomic")
    separate = space.parse_config("tbwd_m64n128_w8s2")
    assert any("atomics" in r for r in space.config_reasons(atomic, p, None))
    assert space.config_reasons(separate, p, None) == []
    name = space.default_config_name(p, None)
    assert name is not None and not space.parse_config(name).dq_atomic


# ------------------------------------------------------------------------------------------
# compiling for sm_90 without a GPU
# ------------------------------------------------------------------------------------------

OFFLINE_FEATURES = {
    "window": dict(window_left=1024),
    "softcap_alibi": dict(softcap=True, alibi=True),
    "dropout": dict(dropout=True),
    "varlen_combo": dict(window_left=1024, softcap=True, alibi=True, varlen=True, total_q=8192,
                         total_k=8192),
}


@pytest.mark.parametrize("feature", sorted(OFFLINE_FEATURES))
@pytest.mark.parametrize("op, config", [("fwd", "tfwd_m128n64_w8s3"), ("bwd", "tbwd_m32n128_w8s2")])
def test_feature_kernels_compile_for_sm90(op, config, feature):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: this process has no compiler-backed kernels")
    from sparktune.kernels import triton_attn

    p = Problem(op, "bfloat16", 2, 8, 4, 4096, 4096, 64, True, **OFFLINE_FEATURES[feature])
    kernels = triton_attn.compile_offline(p, config, 90)
    expected = {"fwd": ["_fwd_kernel"], "bwd": ["_bwd_preprocess", "_bwd_dkdv_kernel", "_bwd_dq_kernel"]}
    assert [k["kernel"] for k in kernels] == expected[op]
    estimate = space.parse_config(config).smem_bytes(64)
    for k in kernels:
        assert 0 < k["shared"] <= estimate, k
        assert k["regs"] is None or k["regs"] <= 255, k
        assert k["spilled"] in (None, 0), k
    # the compile label of a feature variant names its features (warmup keys on it)
    label = triton_attn._spec_plans(p, space.parse_config(config))[-1].label
    assert len(label) == 6 and label[-1]

"""The attention features (docs/FEATURES.md) on the CPU: the reference backend against the
float64 oracle written from the definitions (tests/_features_oracle.py), forward, log-sum-exp
and gradients, every feature and their combinations, dense and varlen; the public API's
checks; the problem key, string key and dispatch."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import sparktune
from sparktune import registry
from sparktune.backends.base import Backend
from sparktune.backends.reference import (
    dropout_keep,
    dropout_key,
    reference_attention,
    reference_attention_backward,
)
from sparktune.db import parse_problem_key, problem_key
from sparktune.problem import Problem
from tests._features_oracle import oracle, varlen_oracle

# (B, Hq, Hkv, Nq, Nk, D): odd lengths, Nq > Nk and Nq < Nk, GQA, single rows
SHAPES = [
    (2, 4, 2, 17, 13, 16),
    (1, 3, 1, 5, 33, 8),
    (1, 2, 2, 1, 1, 16),
    (2, 2, 1, 31, 31, 8),
]
WINDOWS = [(-1, -1), (3, -1), (-1, 2), (4, 4), (0, 0), (100, 100)]


def _inputs(shape, dtype=torch.float64, grad=False):
    b, hq, hk, nq, nk, d = shape
    q = torch.randn(b, hq, nq, d, dtype=dtype)
    k = torch.randn(b, hk, nk, d, dtype=dtype)
    v = torch.randn(b, hk, nk, d, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _features(shape, window, softcap, alibi, dropout):
    b, hq = shape[0], shape[1]
    kw = {}
    if window != (-1, -1):
        kw["window"] = window
    if softcap:
        kw["softcap"] = softcap
    if alibi == "h":
        kw["alibi_slopes"] = torch.rand(hq) * 0.5
    elif alibi == "bh":
        kw["alibi_slopes"] = torch.rand(b, hq) * 0.5
    if dropout:
        kw.update(dropout_p=dropout, seed=1234, offset=56)
    return kw


def _oracle_kw(kw):
    out = {k: v for k, v in kw.items() if k != "alibi_slopes"}
    if "alibi_slopes" in kw:
        out["alibi"] = kw["alibi_slopes"]
    return out


COMBOS = [
    (w, cap, al, dr, c)
    for (w, cap, al, dr, c) in itertools.product(WINDOWS, (0.0, 2.0), (None, "h", "bh"), (0.0, 0.3), (False, True))
    # every window with every other feature alone, and every feature combination with one window
    if (w in ((-1, -1), (4, 4))) or (cap == 0.0 and al is None and dr == 0.0)
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window,softcap,alibi,dropout,causal", COMBOS)
def test_reference_matches_the_float64_definition(shape, window, softcap, alibi, dropout, causal):
    q, k, v = _inputs(shape, grad=True)
    kw = _features(shape, window, softcap, alibi, dropout)
    out, lse = reference_attention(q, k, v, causal=causal, **kw)
    want, want_lse = oracle(q, k, v, causal=causal, **_oracle_kw(kw))
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-10, rtol=1e-10)
    dout = torch.randn_like(want)
    grads = reference_attention_backward(dout, q, k, v, causal=causal, **kw)
    wants = torch.autograd.grad(want, (q, k, v), dout)
    for name, g, w in zip("qkv", grads, wants, strict=True):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("config", ["float32", "float64"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(window=(5, 3)),
        dict(causal=True, window=(6, -1), softcap=3.0),
        dict(alibi="bh", softcap=1.5),
        dict(causal=True, alibi="h", window=(2, -1)),
        dict(dropout_p=0.25),
        dict(causal=True, window=(7, -1), softcap=4.0, alibi="h", dropout_p=0.1),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_api_on_the_reference_forward_and_gradients(config, kw, dtype):
    shape = (2, 4, 2, 19, 23, 16)
    kw = dict(kw)
    if "alibi" in kw:
        b, hq = shape[:2]
        kw["alibi_slopes"] = torch.rand(hq) if kw.pop("alibi") == "h" else torch.rand(b, hq)
    q, k, v = _inputs(shape, dtype, grad=True)
    gen = torch.Generator().manual_seed(7)
    out, lse = sparktune.attention(
        q, k, v, backend="reference", config=config, return_lse=True, generator=gen, **kw
    )
    # the call drew its (seed, offset) from the generator: draw them again to replay
    seed = int(torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(7)))
    okw = {k2: v2 for k2, v2 in kw.items() if k2 != "alibi_slopes"}
    if "alibi_slopes" in kw:
        okw["alibi"] = kw["alibi_slopes"]
    if kw.get("dropout_p"):
        okw.update(seed=seed, offset=0)
    want, want_lse = oracle(q, k, v, **okw)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=0)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-4, rtol=1e-4)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    wants = torch.autograd.grad(want, (q, k, v), dout.double())
    for name, g, w in zip("qkv", grads, wants, strict=True):
        gtol = 8 * tol * max(1.0, w.abs().max().item())
        torch.testing.assert_close(g.double(), w.double(), atol=gtol, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


def test_bnhd_layout_with_features():
    q, k, v = _inputs((2, 4, 2, 9, 12, 8), torch.float16)
    kw = dict(causal=True, window=(3, -1), softcap=2.0)
    a = sparktune.attention(q, k, v, backend="reference", **kw)
    b = sparktune.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend="reference",
        layout="bnhd", **kw,
    )
    assert torch.equal(a, b.transpose(1, 2))


def test_window_that_masks_nothing_is_the_plain_problem():
    q, k, v = _inputs((1, 2, 2, 9, 12, 8), torch.float16)
    plain = sparktune.attention(q, k, v, causal=True, backend="reference")
    wide = sparktune.attention(q, k, v, causal=True, window=(1000, 5), backend="reference")
    assert torch.equal(plain, wide)
    ex = sparktune.explain(q, k=k, causal=True)
    assert "w" not in problem_key(ex.problem).split(":")[-1]


def test_dropout_mask_statistics_and_replay():
    key = dropout_key(123, 4)
    row = torch.arange(400).view(-1, 1)
    col = torch.arange(500).view(1, -1)
    keep = dropout_keep(key, row, col, 0.3)
    assert abs(keep.double().mean().item() - 0.7) < 0.01
    assert torch.equal(keep, dropout_keep(key, row, col, 0.3))  # the same counters, the same mask
    assert not torch.equal(keep, dropout_keep(dropout_key(123, 5), row, col, 0.3))
    # two calls draw two masks; the same generator state replays the first
    q, k, v = _inputs((1, 2, 2, 16, 16, 8), torch.float16)
    g = torch.Generator().manual_seed(3)
    a = sparktune.attention(q, k, v, dropout_p=0.5, generator=g, backend="reference")
    b = sparktune.attention(q, k, v, dropout_p=0.5, generator=g, backend="reference")
    c = sparktune.attention(
        q, k, v, dropout_p=0.5, generator=torch.Generator().manual_seed(3), backend="reference"
    )
    assert not torch.equal(a, b) and torch.equal(a, c)
    # the expectation over masks is attention without dropout
    plain = sparktune.attention(q, k, v, backend="reference").double()
    mean = sum(
        sparktune.attention(q, k, v, dropout_p=0.5, generator=g, backend="reference").double()
        for _ in range(100)
    ) / 100
    assert (mean - plain).abs().mean() < 0.08


def test_deterministic_backward_is_bitwise_reproducible_on_the_reference():
    q, k, v = _inputs((1, 2, 1, 13, 13, 8), torch.float16, grad=True)
    grads = []
    for _ in range(2):
        out = sparktune.attention(q, k, v, causal=True, deterministic=True, backend="reference")
        grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- varlen

VARLEN = [
    ([0, 5, 5, 17, 18], [0, 3, 9, 13, 20]),  # an empty sequence, Nq > Nk and Nq < Nk
    ([0, 4, 9], [0, 0, 7]),  # a sequence with queries and no key
    ([0, 1, 2], [0, 1, 2]),
]


@pytest.mark.parametrize("cu", VARLEN)
@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(causal=True),
        dict(causal=True, window=(2, -1), softcap=2.0),
        dict(window=(1, 3), alibi="h"),
        dict(causal=True, alibi="bh", dropout_p=0.2),
    ],
)
def test_varlen_reference_matches_the_float64_definition(cu, kw):
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in cu)
    hq, hk, d = 4, 2, 8
    q = torch.randn(cq[-1].item(), hq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(ck[-1].item(), hk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(ck[-1].item(), hk, d, dtype=torch.float64, requires_grad=True)
    kw = dict(kw)
    nb = len(cu[0]) - 1
    if "alibi" in kw:
        kw["alibi_slopes"] = torch.rand(hq) if kw.pop("alibi") == "h" else torch.rand(nb, hq)
    if kw.get("dropout_p"):
        kw.update(seed=99, offset=7)
    out, lse = reference_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    okw = {k2: v2 for k2, v2 in kw.items() if k2 != "alibi_slopes"}
    if "alibi_slopes" in kw:
        okw["alibi"] = kw["alibi_slopes"]
    want, want_lse = varlen_oracle(q, k, v, cq, ck, **okw)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    dout = torch.randn_like(want)
    grads = reference_attention_backward(dout, q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    wants = torch.autograd.grad(want, (q, k, v), dout, allow_unused=True)
    for name, g, w in zip("qkv", grads, wants, strict=True):
        w = torch.zeros_like(g) if w is None else w
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("backend", ["reference", None])  # None: the per-sequence fallback
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(3, 1), softcap=2.0), {}])
def test_varlen_attention_api_forward_and_gradients(backend, kw):
    cq = torch.tensor([0, 6, 6, 19], dtype=torch.int32)
    ck = torch.tensor([0, 9, 11, 15], dtype=torch.int32)
    hq, hk, d = 4, 2, 16
    q = torch.randn(19, hq, d, dtype=torch.float16, requires_grad=True)
    k = torch.randn(15, hk, d, dtype=torch.float16, requires_grad=True)
    v = torch.randn(15, hk, d, dtype=torch.float16, requires_grad=True)
    out, lse = sparktune.varlen_attention(
        q, k, v, cq, ck, 13, 9, backend=backend, return_lse=True, **kw
    )
    want, want_lse = varlen_oracle(q, k, v, cq, ck, **kw)
    assert out.shape == q.shape and lse.shape == (hq, 19) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=0)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-3, rtol=1e-3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    wants = torch.autograd.grad(want, (q, k, v), dout.double())
    for name, g, w in zip("qkv", grads, wants, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=2e-2, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


def test_varlen_equals_dense_for_equal_lengths():
    b, n, hq, hk, d = 3, 10, 4, 2, 16
    q = torch.randn(b, n, hq, d, dtype=torch.float16)
    k = torch.randn(b, n, hk, d, dtype=torch.float16)
    v = torch.randn(b, n, hk, d, dtype=torch.float16)
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32)
    kw = dict(causal=True, window=(4, -1), softcap=3.0, backend="reference")
    dense = sparktune.attention(q, k, v, layout="bnhd", **kw)
    packed = sparktune.varlen_attention(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, n, n, **kw
    )
    torch.testing.assert_close(packed.view(b, n, hq, d), dense, atol=1e-3, rtol=0)


def test_varlen_with_no_key_at_all_gives_zeros():
    q = torch.randn(5, 2, 8, dtype=torch.float16)
    k = torch.randn(0, 2, 8, dtype=torch.float16)
    cq = torch.tensor([0, 5], dtype=torch.int32)
    ck = torch.tensor([0, 0], dtype=torch.int32)
    out, lse = sparktune.varlen_attention(q, k, k, cq, ck, 5, 0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isinf(lse).all()


# --------------------------------------------------------------------------- bad arguments


def _qkv():
    return _inputs((2, 4, 2, 8, 8, 16), torch.float16)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(window=(-2, 0)), ValueError, r"window left must be >= 0, or -1"),
        (dict(window=(3, -5)), ValueError, r"window right must be >= 0, or -1"),
        (dict(window=3), TypeError, r"window must be a pair of ints"),
        (dict(window=(1.5, 2)), TypeError, r"window must be a pair of ints"),
        (dict(window=(1, 2, 3)), TypeError, r"window must be a pair of ints"),
        (dict(softcap=-1.0), ValueError, r"softcap must be finite and >= 0"),
        (dict(softcap=math.inf), ValueError, r"softcap must be finite and >= 0"),
        (dict(softcap=math.nan), ValueError, r"softcap must be finite and >= 0"),
        (dict(softcap="1"), TypeError, r"softcap must be a real number"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(heads_q,\) = \(4,\)"),
        (dict(alibi_slopes=torch.ones(3, 4)), ValueError, r"or \(batch, heads_q\) = \(2, 4\)"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, r"alibi_slopes must be float32"),
        (dict(alibi_slopes=[1.0] * 4), TypeError, r"alibi_slopes must be a torch.Tensor"),
        (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, r"alibi_slopes must be on the inputs' device"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p=0.1, generator=3), TypeError, r"generator must be a torch.Generator"),
        (dict(deterministic=1), TypeError, r"deterministic must be True or False"),
    ],
)
def test_bad_feature_arguments_say_what_is_wrong(kw, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        sparktune.attention(q, k, v, **kw)


def _varlen_args(**changes):
    args = dict(
        q=torch.randn(10, 2, 8, dtype=torch.float16),
        k=torch.randn(12, 2, 8, dtype=torch.float16),
        v=torch.randn(12, 2, 8, dtype=torch.float16),
        cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32),
        max_seqlen_q=6,
        max_seqlen_k=7,
    )
    args.update(changes)
    return args


I32 = torch.int32


@pytest.mark.parametrize(
    "changes,exc,match",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, r"cu_seqlens_q must be int32, got int64"),
        (dict(cu_seqlens_k=torch.tensor([[0, 5, 12]], dtype=I32)), ValueError, r"cu_seqlens_k must be 1-dimensional"),
        (dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=I32)), ValueError, r"cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_q=torch.tensor([0, 6, 4, 10], dtype=I32)), ValueError, r"cu_seqlens_q must be non-decreasing"),
        (dict(cu_seqlens_k=torch.tensor([0, 5, 11], dtype=I32)), ValueError, r"last entry of cu_seqlens_k \(11\) must be the number of packed tokens \(12\)"),
        (dict(max_seqlen_q=5), ValueError, r"max_seqlen_q \(5\) is smaller than the longest sequence \(6\)"),
        (dict(max_seqlen_k=6), ValueError, r"max_seqlen_k \(6\) is smaller than the longest sequence \(7\)"),
        (dict(max_seqlen_k=7.0), TypeError, r"max_seqlen_k must be an int"),
        (dict(cu_seqlens_k=torch.tensor([0, 5, 5, 12], dtype=I32)), ValueError, r"same batch: they have 2 and 3 sequences"),
        (dict(q=torch.randn(2, 10, 2, 8, dtype=torch.float16)), ValueError, r"q must be 3-dimensional \(total_tokens, heads, head_dim\)"),
        (dict(cu_seqlens_q=[0, 4, 10]), TypeError, r"cu_seqlens_q must be a torch.Tensor"),
    ],
)
def test_bad_varlen_arguments_say_what_is_wrong(changes, exc, match):
    with pytest.raises(exc, match=match):
        sparktune.varlen_attention(**_varlen_args(**changes))


def test_varlen_feature_arguments_are_checked_too():
    with pytest.raises(ValueError, match=r"\(batch, heads_q\) = \(2, 2\)"):
        sparktune.varlen_attention(**_varlen_args(), alibi_slopes=torch.ones(3, 2))
    with pytest.raises(ValueError, match="window left"):
        sparktune.varlen_attention(**_varlen_args(), window=(-3, 1))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(scale=math.nan), ValueError, r"scale must be a finite positive number, got nan"),
        (dict(scale=-1.0), ValueError, r"scale must be a finite positive number, got -1.0"),
        (dict(scale="0.1"), TypeError, r"scale must be a real number or None"),
        (dict(config="math"), ValueError, r"config= needs backend="),
        (dict(backend="nope"), ValueError, r"unknown backend 'nope'; known backends:"),
    ],
)
@pytest.mark.parametrize("empty", ["keys", "queries"])
def test_varlen_with_nothing_to_compute_still_checks_its_arguments(kw, exc, match, empty):
    """A batch with no key (or no query) anywhere gives zeros without planning a kernel: the
    arguments planning checks raise all the same, as for any other lengths."""
    args = _varlen_args()
    if empty == "keys":
        args.update(k=args["k"][:0], v=args["v"][:0], max_seqlen_k=0,
                    cu_seqlens_k=torch.zeros(3, dtype=I32))
    else:
        args.update(q=args["q"][:0], max_seqlen_q=0, cu_seqlens_q=torch.zeros(3, dtype=I32))
    sparktune.varlen_attention(**args)  # the lengths alone are fine
    with pytest.raises(exc, match=match):
        sparktune.varlen_attention(**args, **kw)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(max_seqlen_k=None), r"varlen needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k"),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 10])), r"cu_seqlens_q must be a contiguous 1-d int32 tensor, got torch.int64"),
        (dict(cu_seqlens_k=torch.tensor([0, 5, 12], dtype=I32, device="meta")), r"cu_seqlens_k is on meta, q on cpu"),
        (dict(cu_seqlens_q=torch.zeros(0, dtype=I32), cu_seqlens_k=torch.zeros(0, dtype=I32)), r"cu_seqlens_q must have batch \+ 1 entries"),
        (dict(cu_seqlens_k=torch.tensor([0, 5, 5, 12], dtype=I32)), r"cu_seqlens_q \(3,\) and cu_seqlens_k \(4,\) must have the same length"),
        (dict(max_seqlen_q=-1), r"max_seqlen_q and max_seqlen_k must be >= 0"),
    ],
)
def test_kernel_backends_check_packed_arguments_alike(changes, match):
    """The packed-sequence arguments as the Triton and spark backends take them (one check,
    ``_checks.check_packed_boundaries``): each bad one named."""
    from sparktune._checks import check_packed_boundaries

    good = {k: v for k, v in _varlen_args().items() if k not in ("k", "v")}
    assert check_packed_boundaries(**good) == (2, 6, 7)
    with pytest.raises(ValueError, match=match):
        check_packed_boundaries(**{**good, **changes})


def test_boundaries_are_read_once_per_tensor_and_version(monkeypatch):
    from sparktune import _checks

    reads = []
    real = torch.Tensor.tolist

    def counting(self):
        reads.append(self.numel())
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    args = _varlen_args()
    cu_q, cu_k = args["cu_seqlens_q"], args["cu_seqlens_k"]
    ref = sparktune.varlen_attention(**args)
    assert len(reads) == 2  # each boundary tensor once
    again = sparktune.varlen_attention(**args)
    assert len(reads) == 2  # the same tensors, unchanged: nothing read
    torch.testing.assert_close(again, ref)
    # an in-place change is seen (the version moves), and checked like a new tensor
    cu_q[1] = 6
    changed = sparktune.varlen_attention(**args)
    assert len(reads) == 3
    assert not torch.equal(changed, ref)
    cu_q[1] = 11
    with pytest.raises(ValueError, match="non-decreasing"):
        sparktune.varlen_attention(**args)
    # an equal tensor that is another object is read again
    sparktune.varlen_attention(**{**args, "cu_seqlens_q": torch.tensor([0, 4, 10], dtype=I32)})
    assert len(reads) == 5
    # nothing is kept alive
    import gc
    import weakref

    gone = weakref.ref(cu_k)
    del args, cu_k
    gc.collect()
    assert gone() is None
    assert all(entry[0]() is not None for entry in _checks._CU_CACHE.values())
    with torch.inference_mode():  # no version counter: read every time
        cu = torch.tensor([0, 4, 10], dtype=I32)
        n = len(reads)
        assert _checks.cu_values(cu) == (0, 4, 10) and _checks.cu_values(cu) == (0, 4, 10)
        assert len(reads) == n + 2


# --------------------------------------------------------------------------- key and dispatch


def _problem(**kw):
    base = dict(op="fwd", dtype="float16", batch=2, heads_q=8, heads_kv=2, seqlen_q=100,
                seqlen_k=120, head_dim=64, causal=False)
    base.update(kw)
    return Problem(**base)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(window_left=64, window_right=-1, causal=True),
        dict(window_left=-1, window_right=8),
        dict(softcap=True),
        dict(alibi=True, dropout=True),
        dict(op="bwd", deterministic=True, softcap=True),
        dict(varlen=True, total_q=150, total_k=200),
        dict(window_left=3, window_right=4, softcap=True, alibi=True, dropout=True, varlen=True,
             total_q=101, total_k=240, op="bwd", deterministic=True),
    ],
)
def test_problem_key_round_trips_with_features(kw):
    p = _problem(**kw)
    key = problem_key(p)
    assert parse_problem_key(key) == p
    if not kw:
        assert key == "fwd:float16:b2:h8/2:n100/120:d64:full:acc32"  # unchanged


def test_problem_feature_fields_are_checked():
    with pytest.raises(ValueError, match="window_left must be an integer >= -1"):
        _problem(window_left=-2)
    with pytest.raises(ValueError, match="causal problem has window_right -1"):
        _problem(causal=True, window_right=0)
    with pytest.raises(ValueError, match="only a 'bwd' problem"):
        _problem(deterministic=True)
    with pytest.raises(ValueError, match="total_q is for varlen problems only"):
        _problem(total_q=5)
    with pytest.raises(ValueError, match="total_k .* must be between"):
        _problem(varlen=True, total_q=150, total_k=10)
    assert _problem().features == frozenset()
    assert _problem(window_left=3, alibi=True).features == {"window", "alibi"}


def test_window_flops_count_the_visible_area():
    full = _problem(seqlen_q=1000, seqlen_k=1000)
    win = _problem(seqlen_q=1000, seqlen_k=1000, causal=True, window_left=99)
    assert win.flops() == pytest.approx(full.flops() * (100 * 1000 - 99 * 100 / 2) / 1e6)


class _PlainBackend(Backend):
    """A backend that declares no feature and would win every default."""

    name = "plainonly"

    def configs(self, op="fwd"):
        return ("default",)

    def not_supported_reasons(self, problem, config=None, device=None):
        return []

    def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True):
        raise AssertionError("a problem with features must never reach this backend")


@pytest.fixture
def plain_backend(monkeypatch):
    import importlib

    from sparktune import dispatch

    _resolve = importlib.import_module("sparktune.dispatch._resolve")
    registry.register_backend(_PlainBackend(), replace=True)
    monkeypatch.setattr(_resolve, "DEFAULT_ORDER", ("plainonly", *_resolve.DEFAULT_ORDER))
    dispatch.reload()
    yield
    registry.unregister_backend("plainonly")
    dispatch.reload()


def test_dispatch_never_picks_a_backend_lacking_a_feature(plain_backend):
    from sparktune import dispatch

    plain = _problem()
    assert dispatch.select(plain, None).candidate.backend == "plainonly"
    for kw in (dict(window_left=4), dict(softcap=True), dict(alibi=True), dict(dropout=True),
               dict(varlen=True, total_q=150, total_k=200)):
        sel = dispatch.select(_problem(**kw), None)
        assert sel.candidate.backend != "plainonly", kw
    bwd = _problem(op="bwd", deterministic=True)
    assert dispatch.select(bwd, None).candidate.backend != "plainonly"
    with pytest.raises(dispatch.NoKernelError, match="does not support the feature 'softcap'"):
        dispatch.select(_problem(softcap=True), None, backend="plainonly")
    reasons = registry.get_backend("plainonly").runnable_reasons(_problem(softcap=True, alibi=True))
    assert reasons == [
        "backend 'plainonly' does not support the feature 'alibi'",
        "backend 'plainonly' does not support the feature 'softcap'",
    ]
    q, k, v = _qkv()
    out = sparktune.attention(q, k, v, softcap=2.0)  # runs elsewhere (never AssertionError)
    assert out.shape == q.shape


def test_explain_shows_the_features_in_the_key():
    q, k, v = _qkv()
    ex = sparktune.explain(q, k=k, causal=True, window=(3, -1), softcap=2.0,
                           alibi_slopes=torch.ones(4), dropout_p=0.1)
    p = ex.problem
    assert (p.window_left, p.window_right, p.softcap, p.alibi, p.dropout) == (3, -1, True, True, True)
    text = str(ex)
    assert ":w3/-1:softcap:alibi:dropout" in text
    bwd = sparktune.explain(q, k=k, op="bwd", deterministic=True)
    assert bwd.problem.deterministic and ":det" in str(bwd)


# --------------------------------------------------------------------------- the torch backend


@pytest.mark.parametrize(
    "config,kw",
    [
        ("math", dict(window=(4, 2))),
        ("math", dict(causal=True, window=(3, -1), alibi="bh")),
        ("auto", dict(alibi="h")),
        ("auto", dict(causal=True, window=(0, -1))),
        ("flex", dict(softcap=2.0)),
        ("flex", dict(causal=True, window=(5, -1), softcap=3.0, alibi="h")),
        ("flex", dict(window=(2, 6), alibi="bh")),
    ],
)
@pytest.mark.parametrize("shape", [(2, 4, 2, 19, 13, 16), (1, 2, 1, 7, 24, 16)])
def test_torch_backend_features_forward_and_gradients(config, kw, shape):
    kw = dict(kw)
    b, hq = shape[:2]
    if "alibi" in kw:
        kw["alibi_slopes"] = torch.rand(hq) if kw.pop("alibi") == "h" else torch.rand(b, hq)
    q, k, v = _inputs(shape, torch.float16, grad=True)
    out, lse = sparktune.attention(q, k, v, backend="torch", config=config, return_lse=True, **kw)
    want, want_lse = oracle(q, k, v, **_oracle_kw(kw))
    torch.testing.assert_close(out.double(), want, atol=3e-3, rtol=0)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=2e-3, rtol=1e-3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    wants = torch.autograd.grad(want, (q, k, v), dout.double())
    for name, g, w in zip("qkv", grads, wants, strict=True):
        torch.testing.assert_close(
            g.double(), w.double(), atol=3e-2, rtol=0, msg=lambda m, n=name: f"d{n}: {m}"
        )


def test_torch_configs_name_the_features_they_lack():
    from sparktune.backends.torch_sdpa import TorchSDPABackend

    tb = TorchSDPABackend()
    softcap = _problem(softcap=True)
    assert tb.not_supported_reasons(softcap, "math") == ["math does not take the feature 'softcap'"]
    assert tb.not_supported_reasons(softcap, "flash") == ["flash does not take the feature 'softcap'"]
    assert tb.not_supported_reasons(softcap, "flex") == []
    assert "for problems with features only" in tb.not_supported_reasons(_problem(), "flex")[0]
    assert tb.not_supported_reasons(_problem(dropout=True), "flex") == [
        "flex does not take the feature 'dropout'"
    ]
    assert tb.runnable_reasons(_problem(dropout=True)) == [
        "backend 'torch' does not support the feature 'dropout'"
    ]
    assert tb.default_config(_problem(window_left=3)) == "math"
    assert tb.default_config(softcap) == "flex"


@pytest.mark.parametrize("kw", [dict(causal=True, window=(2, -1), softcap=2.0), dict(alibi="bh")])
def test_varlen_on_flex(kw):
    cq = torch.tensor([0, 6, 6, 19, 21], dtype=torch.int32)
    ck = torch.tensor([0, 9, 11, 15, 15], dtype=torch.int32)
    hq, hk, d = 4, 2, 16
    kw = dict(kw)
    if "alibi" in kw:
        kw.pop("alibi")
        kw["alibi_slopes"] = torch.rand(4, hq)
    q = torch.randn(21, hq, d, dtype=torch.float16, requires_grad=True)
    k = torch.randn(15, hk, d, dtype=torch.float16, requires_grad=True)
    v = torch.randn(15, hk, d, dtype=torch.float16, requires_grad=True)
    out, lse = sparktune.varlen_attention(
        q, k, v, cq, ck, 13, 9, backend="torch", config="flex", return_lse=True, **kw
    )
    want, want_lse = varlen_oracle(q, k, v, cq, ck, **_oracle_kw(kw))
    torch.testing.assert_close(out.double(), want, atol=3e-3, rtol=0)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    wants = torch.autograd.grad(want, (q, k, v), dout.double())
    for g, w in zip(grads, wants, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=3e-2, rtol=0)


def test_triton_features_follow_the_kernel_signatures(monkeypatch):
    import types

    from sparktune.backends import triton as tb

    def fwd(q, k, v, out, lse=None, *, config, causal, scale, window=(-1, -1), softcap=0.0):
        pass

    def bwd(dout, q, k, v, out, lse, dq, dk, dv, *, config, causal, scale, window=(-1, -1),
            softcap=0.0, alibi_slopes=None, deterministic=False):
        pass

    monkeypatch.setattr(tb, "_kernels", lambda: types.SimpleNamespace(
        attention_forward=fwd, attention_backward=bwd))
    monkeypatch.setattr(tb, "_triton_import_error", lambda: None)
    tb.kernel_features.cache_clear()
    try:
        # alibi only in the backward: not declared; decode: the kernels of triton_decode
        assert tb.TritonBackend().features == {"window", "softcap", "deterministic", "decode"}
    finally:
        tb.kernel_features.cache_clear()
    monkeypatch.undo()
    assert isinstance(tb.TritonBackend().features, frozenset)
    tb.kernel_features.cache_clear()


def test_features_under_torch_compile_become_the_feature_op_in_one_graph():
    q, k, v = _inputs((1, 4, 2, 9, 11, 16), torch.float16, grad=True)
    slopes = torch.rand(4)

    def f(q, k, v):
        plain = sparktune.attention(q, k, v, causal=True, window=(-1, -1), softcap=0.0)
        feat = sparktune.attention(
            q, k, v, causal=True, window=(3, -1), softcap=2.0, alibi_slopes=slopes
        )
        return plain, feat

    torch._dynamo.reset()
    try:
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm.code)
            return gm.forward

        compiled = torch.compile(f, backend=backend, fullgraph=True)
        got, want = compiled(q, k, v), f(q, k, v)
        assert any("attention_features_fwd" in g for g in graphs)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        ga = torch.autograd.grad(got[1].sum(), (q, k, v))
        gb = torch.autograd.grad(want[1].sum(), (q, k, v))
        for a, b in zip(ga, gb, strict=True):
            assert torch.equal(a, b)
        # dropout runs eagerly (a graph break), with a mask per call
        g = torch.Generator().manual_seed(5)
        drop = torch.compile(
            lambda q, k, v: sparktune.attention(q, k, v, dropout_p=0.5, generator=g, backend="reference"),
            backend="eager",
        )
        with torch.no_grad():
            assert not torch.equal(drop(q, k, v), drop(q, k, v))
    finally:
        torch._dynamo.reset()


def test_opcheck_the_feature_op():
    from sparktune import _ops

    q, k, v = _inputs((1, 4, 2, 7, 9, 16), torch.float16, grad=True)
    args = (q, k, v, torch.rand(4), [2, -1], 2.0, False, True, None, "bhnd", "reference", None,
            False, True)
    result = torch.library.opcheck(
        torch.ops.sparktune.attention_features_fwd.default, args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    assert all(v == "SUCCESS" for v in result.values()), result
    out, lse = _ops.attention_features_fwd(*args)
    want, want_lse = oracle(q, k, v, causal=True, window=(2, -1), softcap=2.0, alibi=args[3])
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=0)


# --------------------------------------------------------------------------- on a GPU


def _gpu_backends_with(feature):
    out = []
    for name in ("triton", "torch"):
        try:
            b = registry.get_backend(name)
        except Exception:  # noqa: BLE001
            continue
        if feature in b.features and not b.unavailable_reasons():
            out.append(name)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=True, window=(64, -1)),
        dict(causal=True, softcap=5.0),
        dict(causal=True, alibi=True),
        dict(window=(32, 16), softcap=3.0, alibi=True),
    ],
)
def test_gpu_backends_with_the_features_match_the_definition(kw):
    kw = dict(kw)
    b, hq, hk, n, d = 2, 8, 2, 300, 64
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(hq, device="cuda")
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (hq, hk, hk))
    needed = {"window" if "window" in kw else None, "softcap" if "softcap" in kw else None,
              "alibi" if "alibi_slopes" in kw else None} - {None}
    names = [n_ for n_ in ("triton", "torch") if all(n_ in _gpu_backends_with(f) for f in needed)]
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    okw = _oracle_kw({k2: (v2.cpu() if isinstance(v2, torch.Tensor) else v2) for k2, v2 in kw.items()})
    want, _ = oracle(*cpu, **okw)
    dout = torch.randn_like(want)
    wants = torch.autograd.grad(want, cpu, dout)
    for name in names:
        out = sparktune.attention(q, k, v, backend=name, **kw)
        torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=0)
        grads = torch.autograd.grad(out, (q, k, v), dout.to(out))
        for g, w in zip(grads, wants, strict=True):
            torch.testing.assert_close(g.double().cpu(), w.double(), atol=5e-2, rtol=0)


@pytest.mark.gpu
def test_gpu_dropout_is_statistical_and_replays():
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    g = torch.Generator(device="cuda").manual_seed(11)
    state = g.get_state()
    out = sparktune.attention(q, k, v, dropout_p=0.3, generator=g)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    g.set_state(state)
    again = sparktune.attention(q, k, v, dropout_p=0.3, generator=g)
    assert torch.equal(out, again)  # the same (seed, offset): the same mask
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(again.float().sum(), (q, k, v)), strict=True))
    other = sparktune.attention(q, k, v, dropout_p=0.3, generator=g)
    assert not torch.equal(out, other)  # the generator advanced
    plain = sparktune.attention(q, k, v).double()
    mean = sum(sparktune.attention(q, k, v, dropout_p=0.3, generator=g).double() for _ in range(64)) / 64
    assert (mean - plain).abs().mean().item() < 0.05


def test_triton_refuses_dq_atomic_configs_for_deterministic_backwards():
    from sparktune.backends.triton import TritonBackend

    tb = TritonBackend()
    det = _problem(op="bwd", deterministic=True)
    reasons = tb.not_supported_reasons(det, "tbwd_m64n128_w8s2_dqatomic")
    assert any("not bitwise reproducible" in r for r in reasons)
    assert not any(
        "bitwise" in r for r in tb.not_supported_reasons(det, "tbwd_m64n128_w8s2")
    )


def test_a_repeated_call_with_features_reuses_its_plan_but_not_its_tensors(monkeypatch):
    import importlib

    from sparktune import dispatch

    mod = importlib.import_module("sparktune.attention")
    q, k, v = _inputs((1, 4, 2, 9, 12, 16), torch.float16)
    s1, s2 = torch.rand(4), torch.rand(4) + 1
    kw = dict(causal=True, window=(3, -1), softcap=2.0, backend="reference")
    first = sparktune.attention(q, k, v, alibi_slopes=s1, **kw)

    def no_checks(*a, **k):
        raise AssertionError("a repeated call is not checked again")

    monkeypatch.setattr(mod, "check_features", no_checks)
    again = sparktune.attention(q, k, v, alibi_slopes=s1, **kw)
    other = sparktune.attention(q, k, v, alibi_slopes=s2, **kw)  # the call's own slopes
    assert torch.equal(first, again) and not torch.equal(first, other)
    want, _ = oracle(q, k, v, causal=True, window=(3, -1), softcap=2.0, alibi=s2)
    torch.testing.assert_close(other.double(), want, atol=2e-3, rtol=0)
    dispatch.reload()  # forgotten with dispatch's selections
    with pytest.raises(AssertionError, match="not checked again"):
        sparktune.attention(q, k, v, alibi_slopes=s1, **kw)

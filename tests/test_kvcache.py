"""``sparktune.attention_with_kvcache`` on CPU: the reference path (float64 inputs: exact to
rounding) and the SDPA path against a float64 implementation written from the definitions
(tests/_decode_oracle.py), contiguous and paged, appends, ragged lengths, empty caches, pages
shared out of order; every bad input a clear error."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import sparktune
from sparktune import _kvcache
from tests._decode_cases import make_case
from tests._decode_oracle import decode_oracle, expected_caches


def _run_and_compare(case, backend="reference", tol=1e-10, seqlens_as_int=False, lse=True):
    args, kw = case.call_args(seqlens_as_int=seqlens_as_int)
    got = sparktune.attention_with_kvcache(*args, **kw, backend=backend, return_lse=lse)
    out, lse_got = got if lse else (got, None)
    slopes = kw.get("alibi_slopes")
    ref, ref_lse = decode_oracle(
        case.q, case.k_cache, case.v_cache, case.k, case.v, seqlens=case.seqlens,
        table=case.table, batch_idx=case.batch_idx, causal=kw.get("causal", True),
        scale=kw.get("scale"), window=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0),
        slopes=slopes,
    )
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"max error {err} > {tol}"
    if lse:
        assert lse_got.shape == (case.q.shape[0], case.q.shape[2], case.q.shape[1])
        assert lse_got.dtype == torch.float32
        both_inf = torch.isinf(ref_lse) & torch.isinf(lse_got.double())
        assert torch.equal(torch.isinf(ref_lse), torch.isinf(lse_got.double()))
        diff = (lse_got.double() - ref_lse).masked_fill(both_inf, 0).abs().max().item()
        assert diff <= 1e-5
    # the caches after the call hold the appended tokens, and nothing else changed
    kc_exp, vc_exp = expected_caches(case.k_cache, case.v_cache, case.k, case.v, case.seqlens,
                                     case.table, case.batch_idx)
    assert torch.equal(args[1], kc_exp) and torch.equal(args[2], vc_exp)
    return out


CASES = {
    "contiguous": dict(),
    "contiguous_nq3_full": dict(nq=3, causal=False),
    "contiguous_nq4_causal_short": dict(nq=4, seqlens=(2, 0, 9)),
    "mqa": dict(hq=6, hkv=1),
    "append1": dict(appends=1),
    "append3_speculative": dict(nq=3, appends=3, seqlens=(0, 11, 44)),
    "append_full_capacity": dict(appends=2, seqlens=(46, 0, 3)),
    "batch_idx": dict(batch_idx=True, appends=2),
    "paged": dict(page_size=8, seqlens=(9, 0, 40)),
    "paged_append_cross_page": dict(page_size=8, appends=3, seqlens=(7, 0, 30)),
    "paged_shared_pages": dict(page_size=4, share_pages=True, seqlens=(9, 6, 17)),
    "paged_page1": dict(page_size=1, appends=1, seqlens=(3, 0, 5), capacity=8),
    "all_empty": dict(seqlens=(0, 0, 0)),
    "window": dict(nq=2, window=(5, -1), seqlens=(20, 3, 40)),
    "window_full_attention": dict(nq=2, causal=False, window=(4, 1), seqlens=(20, 3, 40)),
    "softcap": dict(softcap=2.0, scale=0.7),
    "alibi_per_head": dict(nq=2, appends=1, alibi="heads"),
    "alibi_per_batch": dict(page_size=8, alibi="batch"),
    "everything": dict(nq=2, appends=2, page_size=8, window=(9, -1), softcap=3.0, alibi="heads",
                       seqlens=(20, 0, 30)),
}


def _case(name, dtype=torch.float64, **extra):
    spec = dict(CASES[name])
    spec.update(extra)
    alibi = spec.pop("alibi", None)
    case = make_case(dtype=dtype, **spec)
    if alibi:
        b, hq = case.q.shape[0], case.q.shape[2]
        shape = (hq,) if alibi == "heads" else (b, hq)
        case.kwargs["alibi_slopes"] = torch.rand(*shape, generator=torch.Generator().manual_seed(1))
    return case


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_definition(name):
    _run_and_compare(_case(name))


def test_int_cache_seqlens():
    _run_and_compare(make_case(seqlens=(13, 13, 13), appends=2), seqlens_as_int=True)


@pytest.mark.parametrize("as_int", [np.int32, np.int64, np.uint16])
def test_numpy_int_cache_seqlens(as_int):
    _run_and_compare(make_case(seqlens=(13, 13, 13), appends=2), seqlens_as_int=as_int)
    case = _case("contiguous")
    _bad(case, r"cache_seqlens \(49\) \+ new tokens \(0\) must be between 0 and",
         kw=dict(cache_seqlens=as_int(49)))


def test_bool_cache_seqlens_is_refused():
    _bad(_case("contiguous"), "cache_seqlens must be an int32 tensor, got bool", TypeError,
         kw=dict(cache_seqlens=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["contiguous", "paged_append_cross_page", "window", "batch_idx",
                                  "contiguous_nq4_causal_short"])
def test_low_precision_paths(name, dtype):
    """float16/bfloat16 through the reference (float32 math) and SDPA (forced) paths: within
    twice the error of the definition computed in that precision, plus a small floor."""
    case = _case(name, dtype=dtype)
    ref, _ = decode_oracle(case.q, case.k_cache, case.v_cache, case.k, case.v,
                           seqlens=case.seqlens, table=case.table, batch_idx=case.batch_idx,
                           **_oracle_kw(case.kwargs))
    low, _ = decode_oracle(case.q, case.k_cache, case.v_cache, case.k, case.v,
                           seqlens=case.seqlens, table=case.table, batch_idx=case.batch_idx,
                           math_dtype=torch.float32, **_oracle_kw(case.kwargs))
    base = (low.to(dtype).double() - ref).abs().max().item()
    for backend in ("reference", "torch"):
        args, kw = case.call_args()
        out = sparktune.attention_with_kvcache(*args, **kw, backend=backend)
        err = (out.double() - ref).abs().max().item()
        assert err <= 2 * base + 2e-3, f"{backend}: error {err}, baseline {base}"


def _oracle_kw(kw):
    return dict(causal=kw.get("causal", True), scale=kw.get("scale"),
                window=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0),
                slopes=kw.get("alibi_slopes"))


def test_cpu_default_is_the_reference_or_triton():
    case = _case("paged", dtype=torch.float16)
    key = _kvcache.check_kvcache(*case.call_args()[0], **case.call_args()[1]).key
    name, _ = _kvcache.select_decode(key, torch.device("cpu"))
    assert name in ("reference", "triton")


def test_key_fields():
    case = _case("everything", dtype=torch.float16)
    args, kw = case.call_args()
    key = _kvcache.check_kvcache(*args, **kw).key
    assert key.key() == "dec:float16:b3:h4/2:q2:c64:d32:causal:page8:new2:w9/-1:softcap:alibi"
    assert key.paged and key.features == {"window", "softcap", "alibi"}
    assert _kvcache.cache_bucket(8192) == 8192 and _kvcache.cache_bucket(8193) == 16384


def test_inference_only():
    case = _case("contiguous", dtype=torch.float32)
    args, kw = case.call_args()
    q = args[0].requires_grad_()
    with pytest.raises(ValueError, match="inference only"):
        sparktune.attention_with_kvcache(q, *args[1:], **kw)
    with torch.no_grad():
        sparktune.attention_with_kvcache(q, *args[1:], **kw, backend="reference")


# ---------------------------------------------------------------------------------------------
# bad inputs


def _bad(case, match, exc=ValueError, **changes):
    args, kw = case.call_args()
    kw.update(changes.pop("kw", {}))
    args = list(args)
    for i, t in changes.pop("args", {}).items():
        args[i] = t
    kc_before = args[1].clone()
    with pytest.raises(exc, match=match):
        sparktune.attention_with_kvcache(*args, **kw, backend="reference")
    assert torch.equal(args[1], kc_before), "a failed call changed the cache"


def test_bad_pages_out_of_range():
    case = _case("paged", appends=1)
    case.table[2][3] = 10_000
    _bad(case, r"block_table\[2, 3\] = 10000 is not a page")
    case.table[2][3] = -1
    _bad(case, r"block_table\[2, 3\] = -1 is not a page")


def test_unused_table_entries_are_not_checked():
    case = _case("paged")  # sequence 1 is empty: its table is never read
    case.table[1] = [-1] * len(case.table[1])
    _run_and_compare(case)


def test_bad_lengths():
    case = _case("contiguous", appends=2)
    case.seqlens[2] = 47  # + 2 > 48
    _bad(case, r"cache_seqlens\[2\] = 47 \(\+ 2 new tokens\) is outside 0..48")
    case.seqlens[2] = -1
    _bad(case, r"cache_seqlens\[2\] = -1")
    case = _case("contiguous")
    _bad(case, r"cache_seqlens \(49\) \+ new tokens \(0\) must be between 0 and", kw=dict(cache_seqlens=49))
    _bad(case, "cache_seqlens must be int32", TypeError,
         kw=dict(cache_seqlens=torch.tensor([1, 2, 3])))
    _bad(case, r"cache_seqlens must have shape \(3,\)", kw=dict(cache_seqlens=torch.tensor([1, 2], dtype=torch.int32)))


def test_bad_shapes_and_types():
    case = _case("contiguous", dtype=torch.float16)
    q, kc, vc = case.call_args()[0]
    _bad(case, r"multiple of the cache's heads \(3\)", args={1: torch.zeros(3, 48, 3, 32, dtype=torch.float16),
                                                              2: torch.zeros(3, 48, 3, 32, dtype=torch.float16)})
    _bad(case, "k_cache has dtype torch.float32", TypeError, args={1: kc.float()})
    _bad(case, "same shape", args={2: vc[:, :40]})
    _bad(case, "head_dim 16, q 32", args={1: kc[..., :16].contiguous(), 2: vc[..., :16].contiguous()})
    _bad(case, "the cache has 2 sequences, q 3", args={1: kc[:2], 2: vc[:2]})
    _bad(case, "contiguous last dimension", args={0: q.transpose(-1, -2).contiguous().transpose(-1, -2)})
    with pytest.raises(ValueError, match="k and v are appended together"):
        sparktune.attention_with_kvcache(q, kc, vc, torch.zeros(3, 1, 2, 32, dtype=torch.float16),
                                         cache_seqlens=1)
    _bad(case, "window must be a pair", TypeError, kw=dict(window=(3,)))
    _bad(case, "softcap must be", kw=dict(softcap=-1.0))
    with pytest.raises(TypeError, match="q has dtype torch.int64; supported: float16, bfloat16"):
        sparktune.attention_with_kvcache(q.long(), kc, vc, cache_seqlens=1)


def test_bad_appends_and_tables():
    case = _case("paged", dtype=torch.float16, appends=1)
    args, kw = case.call_args()
    with pytest.raises(ValueError, match=r"k must be \(batch=3, Nnew, heads_kv=2, head_dim=32\)"):
        sparktune.attention_with_kvcache(args[0], args[1], args[2], args[3][:, :, :1], args[4][:, :, :1], **kw)
    with pytest.raises(TypeError, match="block_table must be int32"):
        sparktune.attention_with_kvcache(*args, **{**kw, "block_table": kw["block_table"].long()})
    with pytest.raises(ValueError, match=r"block_table must be \(batch=3"):
        sparktune.attention_with_kvcache(*args, **{**kw, "block_table": kw["block_table"][:2]})
    with pytest.raises(ValueError, match="cache_batch_idx is for a contiguous cache"):
        sparktune.attention_with_kvcache(*args, **kw, cache_batch_idx=torch.zeros(3, dtype=torch.int32))
    case = _case("batch_idx")
    case.batch_idx[0] = 5
    _bad(case, r"cache_batch_idx\[0\] = 5 is not a row of the cache \(0..4\)")


def test_forced_backend_that_cannot_run_says_why():
    case = _case("softcap", dtype=torch.float16)
    args, kw = case.call_args()
    with pytest.raises(ValueError, match="SDPA has no softcap"):
        sparktune.attention_with_kvcache(*args, **kw, backend="torch")
    with pytest.raises(ValueError, match="unknown decode backend 'nope'"):
        sparktune.attention_with_kvcache(*args, **kw, backend="nope")


def test_no_nan_for_rows_that_see_nothing():
    out = _run_and_compare(_case("contiguous_nq4_causal_short"))
    assert not torch.isnan(out).any()
    assert out[1].abs().max() == 0  # an empty cache: zeros
    assert math.isfinite(out.abs().max().item())


def test_bad_strides_of_index_tensors_and_appends():
    """The Triton path reads cache_seqlens, cache_batch_idx, each block_table row and the
    appended k/v rows as dense (entry b at offset b): a strided one would give another
    sequence's lengths, pages or values with no error, and write them into the cache. Refused
    on every path, naming the tensor and its strides."""
    case = _case("contiguous", dtype=torch.float16, appends=2)
    lens = torch.tensor(case.seqlens, dtype=torch.int32)
    strided = torch.stack([lens, lens + 1], 1)[:, 0]  # the same values, stride 2
    _bad(case, r"cache_seqlens must be contiguous \(stride 1\), got stride \(2,\)",
         kw=dict(cache_seqlens=strided))
    _bad(case, r"cache_seqlens must be contiguous", kw=dict(cache_seqlens=lens[:1].expand(3)))
    k, v = case.call_args()[0][3:]
    k2, v2 = (torch.stack([t, torch.zeros_like(t)], -1).flatten(-2)[..., ::2] for t in (k, v))
    assert torch.equal(k2, k)
    _bad(case, r"k must have a contiguous last dimension, got strides \(256, 128, 64, 2\)",
         args={3: k2, 4: v2})
    _bad(case, r"v must have a contiguous last dimension", args={4: v2})

    case = _case("batch_idx", dtype=torch.float16)
    bidx = torch.tensor(case.batch_idx, dtype=torch.int32)
    _bad(case, r"cache_batch_idx must be contiguous \(stride 1\)",
         kw=dict(cache_batch_idx=torch.stack([bidx, bidx], 1)[:, 0]))

    case = _case("paged", dtype=torch.float16)
    table = torch.tensor(case.table, dtype=torch.int32)
    _bad(case, r"block_table must have a contiguous last dimension \(stride 1\), got strides "
         r"\(1, 3\)", kw=dict(block_table=table.t().contiguous().t()))
    # a row stride of its own is fine (a slice of a wider table)
    wide = torch.cat([table, torch.zeros_like(table)], 1)[:, : table.shape[1]]
    args, kw = case.call_args()
    out = sparktune.attention_with_kvcache(*args, **{**kw, "block_table": wide},
                                           backend="reference")
    torch.testing.assert_close(out, sparktune.attention_with_kvcache(*case.call_args()[0],
                                                                     **kw, backend="reference"))


def test_scale_softcap_and_window_are_checked_as_for_attention():
    """scale a finite positive number (as sparktune.attention), and NumPy's numbers taken as
    Python's for scale, softcap and window."""
    case = _case("contiguous", dtype=torch.float16)
    q = torch.zeros(1, 2, 4, 32, dtype=torch.float16)
    bad_args = [dict(scale=bad) for bad in (0.0, -0.5, math.inf, math.nan, "0.1", True)]
    bad_args += [dict(softcap=bad) for bad in (np.float32(-1.0), math.nan, "1", True)]
    bad_args += [dict(window=bad) for bad in ((np.int64(-2), -1), (3,), (1.5, -1), "ab")]
    for kw in bad_args:
        # the error sparktune.attention gives for the same argument
        with pytest.raises((TypeError, ValueError)) as want:
            sparktune.attention(q, q, q, causal=True, **kw)
        _bad(case, re.escape(str(want.value)), want.type, kw=kw)
    args, kw = case.call_args()
    want = sparktune.attention_with_kvcache(*args, **kw, scale=0.25, softcap=3.0, window=(7, -1),
                                            backend="reference")
    got = sparktune.attention_with_kvcache(*args, **kw, scale=np.float32(0.25),
                                           softcap=np.float32(3.0),
                                           window=(np.int64(7), np.int32(-1)), backend="reference")
    assert torch.equal(got, want)


def test_zero_head_dim_is_refused():
    case = _case("contiguous", dtype=torch.float16)
    q, kc, vc = case.call_args()[0]
    _bad(case, r"q must not be empty \(every dimension at least 1\), got shape \(3, 1, 4, 0\)",
         args={0: q[..., :0], 1: kc[..., :0], 2: vc[..., :0]})

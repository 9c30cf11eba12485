"""The split-KV Triton decode kernels under Triton's CPU interpreter, on small shapes, against
the float64 definition (tests/_decode_oracle.py) with FlashAttention's 2x rule: the kernel's
max error is at most twice that of the definition computed in float32 and rounded to the input
dtype, plus a small floor. Contiguous and paged (pages out of order, shared), appends, ragged
and empty lengths, Nq 1 and 4, one split and several (the combine), windows, softcap, ALiBi,
and bad device-resident values with no host check: nothing read or written out of range.

As tests/test_triton_features.py, the ``test_interp_*`` tests run once in a child pytest with
``TRITON_INTERPRET=1`` (chosen before triton is imported) and each reports the child's outcome.
"""

from __future__ import annotations

import sys

import pytest
import torch

from sparktune.kernels import triton_decode_space as space
from tests._decode_cases import make_case
from tests._decode_oracle import decode_oracle, expected_caches
from tests._interp import delegated, in_child, run_child

_CHILD_FLAG = "_SPARKTUNE_TRITON_DECODE_INTERPRETED"
IN_CHILD = in_child(_CHILD_FLAG)
_CHILD_TIMEOUT_S = 1200
FLOOR = 2e-3


@pytest.fixture(scope="module")
def child_report(tmp_path_factory):
    return run_child(__file__, _CHILD_FLAG, tmp_path_factory, timeout_s=_CHILD_TIMEOUT_S, what="decode tests")


def _delegated(request) -> bool:
    return delegated(request, IN_CHILD)


def _check(case, config, lse=True):
    import sparktune

    args, kw = case.call_args()
    out, lse_got = sparktune.attention_with_kvcache(*args, **kw, backend="triton", config=config,
                                                   return_lse=True)
    okw = dict(seqlens=case.seqlens, table=case.table, batch_idx=case.batch_idx,
               causal=kw.get("causal", True), scale=kw.get("scale"),
               window=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0),
               slopes=kw.get("alibi_slopes"))
    ref, ref_lse = decode_oracle(case.q, case.k_cache, case.v_cache, case.k, case.v, **okw)
    low, _ = decode_oracle(case.q, case.k_cache, case.v_cache, case.k, case.v,
                           math_dtype=torch.float32, **okw)
    base = (low.to(case.q.dtype).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * base + FLOOR, f"{config}: error {err}, baseline {base}"
    assert torch.equal(torch.isinf(lse_got.double()), torch.isinf(ref_lse))
    fin = ~torch.isinf(ref_lse)
    assert (lse_got.double()[fin] - ref_lse[fin]).abs().max().item() <= 2e-2 if fin.any() else True
    kc_exp, vc_exp = expected_caches(case.k_cache, case.v_cache, case.k, case.v, case.seqlens,
                                     case.table, case.batch_idx)
    assert torch.equal(args[1], kc_exp) and torch.equal(args[2], vc_exp)


CONFIGS = ("tdec_n16_w1s1_p1", "tdec_n16_w1s1_p3", "tdec_n32_w1s1_x2")

CASES = {
    "contiguous": dict(),
    "nq4_gqa2": dict(nq=4, hq=4, hkv=2, appends=4, seqlens=(1, 0, 30)),
    "mqa_group8": dict(hq=8, hkv=1, seqlens=(17, 3, 40)),
    "paged_shared_append": dict(page_size=8, appends=2, seqlens=(9, 8, 33), share_pages=True),
    "paged_page4_nq4": dict(page_size=4, nq=4, appends=1, seqlens=(0, 6, 47)),
    "batch_idx": dict(batch_idx=True, appends=1),
    "window_softcap_alibi": dict(nq=2, window=(7, -1), softcap=2.5, alibi=True, seqlens=(20, 1, 44)),
    "full_window_right": dict(nq=3, causal=False, window=(6, 1), seqlens=(20, 1, 44)),
    "hd64": dict(d=64, hq=2, hkv=1, page_size=16, seqlens=(12, 0, 40)),
    "empty": dict(seqlens=(0, 0, 0)),
    "page32_window_tiles_in_one_page": dict(page_size=32, capacity=64, window=(5, -1), nq=2,
                                            appends=2, seqlens=(40, 0, 50)),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_interp_decode_matches_definition(request, name, dtype):
    if _delegated(request):
        return
    spec = dict(CASES[name])
    alibi = spec.pop("alibi", False)
    case = make_case(dtype=getattr(torch, dtype), seed=hash(name) % 1000, **spec)
    if alibi:
        case.kwargs["alibi_slopes"] = torch.rand(case.q.shape[2],
                                                 generator=torch.Generator().manual_seed(3))
    for config in CONFIGS:
        _check(case, config)


def test_interp_default_path_and_int_lengths(request):
    if _delegated(request):
        return
    import sparktune
    from sparktune import _kvcache

    case = make_case(dtype=torch.float16, seqlens=(21, 21, 21), appends=1)
    args, kw = case.call_args(seqlens_as_int=True)
    key = _kvcache.check_kvcache(*args, **kw).key
    assert _kvcache.select_decode(key, torch.device("cpu"))[0] == "triton"
    out = sparktune.attention_with_kvcache(*args, **kw)
    ref, _ = decode_oracle(case.q, case.k_cache, case.v_cache, case.k, case.v, seqlens=case.seqlens)
    assert (out.double() - ref).abs().max().item() <= 5e-3


def test_interp_bad_values_never_go_out_of_range(request):
    """With no host check, lengths past the capacity are clamped and bad pages/rows never
    read or written outside the cache (the interpreter would fault or the sentinel change)."""
    if _delegated(request):
        return
    import sparktune

    case = make_case(dtype=torch.float16, page_size=8, appends=2, seqlens=(5, 0, 30))
    args, kw = case.call_args()
    # a cache with sentinel pages around it: views into a bigger buffer
    blocks = args[1].shape[0]
    big_k = torch.full((blocks + 2, *args[1].shape[1:]), 7.0, dtype=torch.float16)
    big_v = big_k.clone()
    big_k[1:-1] = args[1]
    big_v[1:-1] = args[2]
    table = kw["block_table"].clone()
    table[0, 0] = blocks + 5  # out of range
    table[2, 3] = -4
    lens = torch.tensor([5, 1000, 30], dtype=torch.int32)  # past the capacity
    out = sparktune.attention_with_kvcache(
        args[0], big_k[1:-1], big_v[1:-1], args[3], args[4], cache_seqlens=lens,
        block_table=table, backend="triton", config="tdec_n16_w1s1_p3", check_bounds=False)
    assert torch.isfinite(out).all()
    assert (big_k[0] == 7).all() and (big_k[-1] == 7).all()
    assert (big_v[0] == 7).all() and (big_v[-1] == 7).all()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 1000 \(\+ 2 new tokens\) is outside"):
        sparktune.attention_with_kvcache(
            args[0], big_k[1:-1], big_v[1:-1], args[3], args[4], cache_seqlens=lens,
            block_table=table, backend="triton", check_bounds=True)
    lens[1] = 0
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = \d+ is not a page"):
        sparktune.attention_with_kvcache(
            args[0], big_k[1:-1], big_v[1:-1], args[3], args[4], cache_seqlens=lens,
            block_table=table, backend="triton", check_bounds=True)


def test_config_space_names_round_trip():
    for name in space.DECODE_SPACE + space.BENCH_SPACE:
        assert space.parse_decode_config(name).name == name
    assert space.parse_decode_config("tdec_n16_w1s1_p3").splits == 3
    with pytest.raises(ValueError, match="not a decode config name"):
        space.parse_decode_config("tfwd_m16n16_w1s1")
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        space.parse_decode_config("tdec_n24_w4s2_x2")


def test_split_rule():
    cfg = space.parse_decode_config("tdec_n64_w4s2_x2")
    # batch 1, 8 kv heads, 132 SMs, 128k cache: ceil(2 * 132 / 8) = 33 splits
    assert space.num_splits(cfg, 1, 8, 132, 131072) == 33
    # batch 64: one split; a short cache: no more splits than tiles
    assert space.num_splits(cfg, 64, 8, 132, 131072) == 1
    assert space.num_splits(cfg, 1, 8, 132, 100) == 2
    assert space.num_splits(space.parse_decode_config("tdec_n64_w4s2_p200".replace("200", "100")),
                            1, 1, 1, 10**6) == 100


def test_interp_repeated_calls_reuse_the_plan_and_stay_exact(request, monkeypatch):
    """Calls of one signature after the first reuse its checked plan and launcher; new length
    values (the same signature) and new caches still give the definition's answer."""
    if _delegated(request):
        return
    from sparktune import _kvcache

    checked = []
    real = _kvcache.check_kvcache
    monkeypatch.setattr(_kvcache, "check_kvcache", lambda *a, **k: checked.append(1) or real(*a, **k))
    _kvcache._plans.clear()  # the earlier tests planned calls of this signature
    for i, seqlens in enumerate(((9, 8, 33), (40, 0, 12), (1, 46, 2))):
        case = make_case(dtype=torch.float16, seed=i, page_size=8, appends=2, seqlens=seqlens)
        _check(case, "tdec_n16_w1s1_p3")
    assert len(checked) == 1


def test_interp_tuner_checks_and_stores_triton_decode_candidates(request, tmp_path):
    """The tuner lists the decode configs, checks each candidate against the reference before
    it is timed and stores the records; dispatch then runs the winner."""
    if _delegated(request):
        return
    from sparktune import dispatch
    from sparktune.db import Store
    from sparktune.problem import DeviceInfo, Problem
    from sparktune.tune import CostTimer, Tuner

    dev = DeviceInfo("interpreter stand-in", (9, 0), 4)
    p = Problem("decode", "float16", 2, 4, 2, 2, 64, 32, True, page_size=16, appends=1)

    def cost(cand, problem):
        return 0.5 if cand is not None and cand.label == "triton:tdec_n64_w4s2_x4" else 1.0

    with Store(tmp_path / "t.sqlite3") as store:
        tuner = Tuner(device=dev, torch_device="cpu", store=store, backends=["triton", "torch"],
                      timer=CostTimer(cost), trials=3, screen_timer=False, baseline=False)
        result = tuner.tune(p)
        assert {m.status for m in result.measurements} == {"ok"}, [m.message for m in result.measurements]
        labels = [m.candidate.label for m in result.measurements]
        assert labels[:2] == ["triton:tdec_n64_w4s2_x4", "torch:auto"] and len(labels) == 3
        assert all(m.error <= m.error_limit for m in result.measurements)
        assert result.best.candidate.label == "triton:tdec_n64_w4s2_x4"
        assert len(store.records(problem=p)) == 3
        dispatch.configure(store.url)
        try:
            sel = dispatch.select(p, dev)
            assert (sel.candidate.label, sel.source) == ("triton:tdec_n64_w4s2_x4", "tuned")
        finally:
            dispatch.configure(None)


#: Python calls of a repeated call on the Triton path at most (measured: 15 with a tensor of
#: lengths, 16 with an int, 17 with appends; bench/decode_host_overhead.py prints them)
MAX_HIT_PYTHON_CALLS = 20
#: never on a repeated call: the checks, the choice, a Problem, a launcher or dispatch made again
HIT_FORBIDDEN = {"check_kvcache", "choose_decode", "decode_problem", "__post_init__", "select",
                 "_resolve", "check_values", "_config", "splits_for"}


def test_interp_repeated_call_host_work(request, monkeypatch):
    """A repeated call (same signature) runs the stored plan: a few Python calls, none of the
    checks or the choice (the kernels are stubbed: what is counted is sparktune's own work)."""
    if _delegated(request):
        return
    import sparktune
    from sparktune.kernels import triton_decode

    launched = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(grid)

    for name in ("_append_kernel", "_decode_kernel", "_combine_kernel"):
        monkeypatch.setattr(triton_decode, name, Stub())
    case = make_case(dtype=torch.float16, page_size=8, appends=1, seqlens=(9, 8, 33))
    args, kw = case.call_args()
    kw["check_bounds"] = False  # the default of CUDA tensors on this path
    kw.update(backend="triton", config="tdec_n16_w1s1_p3")
    sparktune.attention_with_kvcache(*args, **kw)
    launched.clear()
    names = []

    def prof(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        sparktune.attention_with_kvcache(*args, **kw)
    finally:
        sys.setprofile(None)
    assert len(launched) == 3  # append, split-KV, combine
    assert len(names) <= MAX_HIT_PYTHON_CALLS, names
    assert not HIT_FORBIDDEN & set(names), names

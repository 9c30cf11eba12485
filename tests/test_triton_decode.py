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


def test_split_rule_fills_whole_waves_once_the_occupancy_is_known():
    x4 = space.parse_decode_config("tdec_n64_w4s2_x4")
    # batch 8 x 8 kv heads: ceil(4 * 132 / 64) = 9 splits, 576 programs; resident 4 to an SM
    # (528 a wave) they would need a second wave for 48 programs: 8 splits, one whole wave
    assert space.num_splits(x4, 8, 8, 132, 32768) == 9
    assert space.num_splits(x4, 8, 8, 132, 32768, blocks_per_sm=4) == 8
    # resident 7 to an SM (924 a wave) the 576 fit one wave: unchanged
    assert space.num_splits(x4, 8, 8, 132, 32768, blocks_per_sm=7) == 9
    # batch 64: 2 splits are 1024 programs, one more than a wave of 924: one split
    assert space.num_splits(x4, 64, 8, 132, 32768, blocks_per_sm=7) == 1
    # an exact number of waves, or fewer programs than one wave, stays
    assert space.num_splits(x4, 66, 1, 132, 32768, blocks_per_sm=4) == 8
    # fixed splits are taken as they are
    p3 = space.parse_decode_config("tdec_n64_w4s2_p3")
    assert space.num_splits(p3, 64, 8, 132, 32768, blocks_per_sm=1) == 3


def test_blocks_per_sm_counts_registers_shared_memory_and_threads():
    # sm_90 (65536 registers, 2048 threads, 228 KB): 72 registers x 4 warps -> 7 blocks,
    # 105 (allocated as 112) -> 4; shared memory and threads can be the limit instead
    assert space.blocks_per_sm(72, 4, 0) == 7
    assert space.blocks_per_sm(105, 4, 0) == 4
    assert space.blocks_per_sm(32, 4, 100 * 1024) == 2
    assert space.blocks_per_sm(16, 8, 0) == 8
    assert space.blocks_per_sm(0, 4, 0) is None  # unknown (the interpreter)


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
#: lengths, 16 with an int, 17 with appends, bench/decode_host_overhead.py prints them; then one
#: more per launch, 18-20: the plan's launch object, which on a GPU calls the compiled kernel
#: past Triton's JITFunction.run)
MAX_HIT_PYTHON_CALLS = 23
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


class _FakeCompiled:
    """What a first JIT launch returns, as far as the direct launch reads it."""

    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self, runs):
        self.runs = runs

    def run(self, *args):
        self.runs.append(args)


class _FakeJit:
    """A JITFunction stand-in: ``fn[grid](*args, **kw)`` records a JIT launch."""

    arg_names = ["A", "B", "n", "x", "BLOCK", "FLAG"]

    def __init__(self):
        self.jit, self.runs = [], []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.jit.append((grid, args, kw))
            return _FakeCompiled(self.runs)

        return launch


def test_direct_launch_engages_only_when_safe(monkeypatch):
    """The plan's launch object calls the compiled kernel's launcher after the first (JIT)
    launch with JITFunction.run's argument list (tensors, scalars, constexprs in parameter
    order, no launch metadata or hooks), and goes back to the JIT path when a launch hook is
    set (None or a non-empty HookChain), a tensor's alignment changes, the device differs or
    DIRECT_LAUNCH is off."""
    from triton import knobs

    from sparktune.kernels import triton_decode as td

    monkeypatch.setattr(td, "INTERPRET", False)
    monkeypatch.setattr(td, "_current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    fn = _FakeJit()
    launch = td._Launch(fn, (3, 2), (7, 0.5), {"BLOCK": 64, "FLAG": True, "num_warps": 4},
                        torch.device("cuda", 0))
    a, b = torch.zeros(64), torch.zeros(64)
    launch(a, b)
    assert len(fn.jit) == 1 and fn.runs == [] and launch.direct == 0
    launch(a, b)
    assert len(fn.jit) == 1 and launch.direct == 1
    assert fn.runs[-1] == (3, 2, 1, 1234, "fn-handle", "meta", None, None, None, a, b, 7, 0.5, 64, True)
    # a view 4 bytes off: the kernel was specialised on 16-byte alignment
    launch(a[1:], b)
    assert len(fn.jit) == 2 and launch.direct == 1
    # a profiler's hook (Triton 3.6: a HookChain with a function in it)
    hook = lambda *args: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(a, b)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(fn.jit) == 3 and launch.direct == 1
    assert td._hook_idle(None) and td._hook_idle(knobs.runtime.launch_exit_hook)
    assert not td._hook_idle(hook)
    monkeypatch.setattr(td, "_current_device", lambda: 1)
    launch(a, b)
    assert len(fn.jit) == 4 and launch.direct == 1
    monkeypatch.setattr(td, "_current_device", lambda: 0)
    monkeypatch.setattr(td, "DIRECT_LAUNCH", False)
    launch(a, b)
    assert len(fn.jit) == 5 and launch.direct == 1
    monkeypatch.setattr(td, "DIRECT_LAUNCH", True)
    launch(a, b)
    assert len(fn.jit) == 5 and launch.direct == 2
    # checked=1: only the first tensor's alignment is compared (the others are the plan's own
    # allocations); the first tensor's still sends the launch back to the JIT path
    part = td._Launch(fn, (3, 2), (7, 0.5), {"BLOCK": 64, "FLAG": True}, torch.device("cuda", 0),
                      checked=1)
    part(a, b)
    part(a, b[1:])
    assert part.direct == 1 and part.aligned == (True,)
    jit = len(fn.jit)
    part(a[1:], b)
    assert len(fn.jit) == jit + 1 and part.direct == 1
    # constexprs that are not the last parameters: never direct
    odd = td._Launch(fn, (1,), (7,), {"n": 3, "BLOCK": 64}, torch.device("cuda", 0))
    assert odd.tail is None
    odd(a, b)
    odd(a, b)
    assert odd.direct == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_split_count_follows_the_compiled_kernels_occupancy():
    """On the GPU: after its first launch a plan's split count is the rule's for the compiled
    kernel's occupancy (whole waves; batch 64 here is one wave more than whole at the rule's
    count on an H200), its grid launches that many splits, and the calls before and after
    both pass the 2x rule against the float64 definition."""
    import sparktune
    from sparktune import _kvcache
    from sparktune.kernels import triton_decode as td

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for batch in (8, 64):
        _kvcache._plans.clear()
        case = make_case(dtype=torch.bfloat16, seed=5, batch=batch, seqlens=(1024,) * batch, capacity=1024,
                         hq=32, hkv=8, d=128)
        args, kw = case.call_args(device="cuda")
        kw.update(backend="triton")
        outs = [sparktune.attention_with_kvcache(*args, **kw)]
        (plan,) = _kvcache._plans.values()
        launcher = plan.launcher
        assert launcher.fitted
        outs.append(sparktune.attention_with_kvcache(*args, **kw))
        decode = launcher.launches[1]
        per_sm = td._occupancy(decode.compiled, dev)
        assert per_sm is not None and per_sm >= 1
        assert decode.grid[0] == launcher.splits
        rule = space.num_splits(launcher.cfg, batch, 8, sms, 1024)
        assert launcher.splits <= rule
        wave = sms * per_sm
        if launcher.splits < rule:  # rounded down to the whole waves of the rule's programs
            assert launcher.splits * batch * 8 <= (rule * batch * 8 // wave) * wave
        ref, _ = decode_oracle(case.q, case.k_cache, case.v_cache, None, None, seqlens=list(case.seqlens))
        low, _ = decode_oracle(case.q, case.k_cache, case.v_cache, None, None, seqlens=list(case.seqlens),
                               math_dtype=torch.float32)
        base = (low.to(case.q.dtype).double() - ref).abs().max().item()
        for out in outs:
            assert (out.double().cpu() - ref).abs().max().item() <= 2 * base + FLOOR, batch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_direct_launch_gives_the_jit_paths_bits():
    """On the GPU: later calls of a plan launch directly (counted), and give the same bits as
    the JIT path (DIRECT_LAUNCH off) for contiguous, paged, appending and ALiBi calls."""
    import sparktune
    from sparktune import _kvcache
    from sparktune.kernels import triton_decode as td

    for kw in ({}, {"page_size": 16}, {"appends": 2, "page_size": 16}, {"alibi": True}):
        outs = {}
        for direct in (False, True):
            td.DIRECT_LAUNCH = direct
            try:
                _kvcache._plans.clear()
                opts = {k: v for k, v in kw.items() if k != "alibi"}
                case = make_case(dtype=torch.bfloat16, seed=3, seqlens=(700, 33, 2000), capacity=2048,
                                 hq=8, hkv=2, d=128, **opts)
                args, call_kw = case.call_args(device="cuda")
                if kw.get("alibi"):
                    call_kw["alibi_slopes"] = torch.linspace(0.05, 0.6, 8, device="cuda")
                call_kw.update(backend="triton", return_lse=True)
                res = [sparktune.attention_with_kvcache(*args, **call_kw) for _ in range(4)]
                caches = (args[1].clone(), args[2].clone())
                torch.cuda.synchronize()
            finally:
                td.DIRECT_LAUNCH = True
            (plan,) = _kvcache._plans.values()
            used = [x for x in plan.launcher.launches if x is not None]
            assert sum(x.direct for x in used) == (3 * len(used) if direct else 0), (kw, direct)
            outs[direct] = (res, caches)
        for (o0, l0), (o1, l1) in zip(outs[False][0], outs[True][0], strict=True):
            assert torch.equal(o0, o1) and torch.equal(l0, l1), kw
        assert all(torch.equal(x, y) for x, y in zip(outs[False][1], outs[True][1], strict=True)), kw


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pdl_gives_the_stream_orders_bits():
    """On the GPU: plans launched with programmatic dependent launch (``PDL``, sm_90 and later)
    give the bits of plans launched in plain stream order, eager and replayed from a CUDA graph,
    call after call (a kernel reading before its predecessor's writes are visible would move
    them), for one split and several, contiguous and paged, with appends and ALiBi; and pass
    the 2x rule against the float64 definition."""
    import sparktune
    from sparktune import _kvcache
    from sparktune.kernels import triton_decode as td

    pdl_there = torch.cuda.get_device_capability()[0] >= 9
    cases = (
        dict(batch=1, seqlens=(8192,), capacity=8192, config="tdec_n64_w4s2_x4"),
        dict(batch=8, seqlens=(8192, 33, 4000, 1, 8191, 700, 5000, 2), capacity=8192,
             page_size=256, config=None),
        dict(batch=3, seqlens=(700, 33, 2000), capacity=2048, appends=2, page_size=16,
             config="tdec_n32_w2s1_p7"),
        dict(batch=3, seqlens=(700, 33, 2000), capacity=2048, alibi=True, config="tdec_n64_w4s2_p1"),
    )
    for spec in cases:
        spec = dict(spec)
        cfg = spec.pop("config")
        alibi = spec.pop("alibi", False)
        case = make_case(dtype=torch.bfloat16, seed=spec["batch"], hq=32, hkv=8, d=128, **spec)
        args, kw = case.call_args(device="cuda")
        if alibi:
            kw["alibi_slopes"] = torch.linspace(0.05, 0.6, 32, device="cuda")
        kw.update(backend="triton", config=cfg, return_lse=True)
        runs = {}
        for pdl in (False, True):
            td.PDL = pdl
            try:
                _kvcache._plans.clear()
                eager = [sparktune.attention_with_kvcache(*args, **kw) for _ in range(3)]
                (plan,) = _kvcache._plans.values()
                assert plan.launcher.pdl == (pdl and pdl_there), spec
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    sparktune.attention_with_kvcache(*args, **kw)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    g_out, g_lse = sparktune.attention_with_kvcache(*args, **kw)
                replays = []
                for _ in range(20):
                    graph.replay()
                    replays.append((g_out.clone(), g_lse.clone()))
                torch.cuda.synchronize()
            finally:
                td.PDL = True
                _kvcache._plans.clear()
            runs[pdl] = (eager, replays, (args[1].clone(), args[2].clone()))
        (e0, r0, c0), (e1, r1, c1) = runs[False], runs[True]
        first = e0[-1]
        for out, lse in [*e0[1:], *e1[1:], *r0, *r1]:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), spec
        assert torch.equal(c0[0], c1[0]) and torch.equal(c0[1], c1[1]), spec
        slopes = kw["alibi_slopes"].cpu() if alibi else None
        ref, _ = decode_oracle(case.q, case.k_cache, case.v_cache, case.k, case.v,
                               seqlens=list(case.seqlens), table=case.table, slopes=slopes)
        low, _ = decode_oracle(case.q, case.k_cache, case.v_cache, case.k, case.v,
                               seqlens=list(case.seqlens), table=case.table, slopes=slopes,
                               math_dtype=torch.float32)
        base = (low.to(case.q.dtype).double() - ref).abs().max().item()
        assert (first[0].double().cpu() - ref).abs().max().item() <= 2 * base + FLOOR, spec


@pytest.mark.parametrize("pdl", [True, False])
def test_pdl_kernels_wait_before_their_first_memory_access(monkeypatch, pdl):
    """The three decode kernels of a plan (append, split-KV, combine), compiled for sm_90 with
    Triton's compiler and no GPU: with programmatic dependent launch each waits
    (griddepcontrol.wait) before its first global load, store or atomic in the PTX, and the
    append and split-KV kernels let the next kernel be scheduled; without it, no griddepcontrol
    at all. (A kernel that touched memory before the wait could read what the kernel before it
    has not yet written, or overwrite what it still reads.)"""
    import os
    import re

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: this process has no compiler-backed kernels")
    from sparktune import _kvcache
    from sparktune.kernels import triton_attn
    from sparktune.kernels import triton_decode as td

    monkeypatch.setattr(td, "_pdl_for", lambda device: pdl)
    case = make_case(dtype=torch.bfloat16, batch=2, seqlens=(300, 77), capacity=512, hq=8, hkv=2,
                     d=128, appends=1, page_size=16)
    args, kw = case.call_args()
    inp = _kvcache.check_kvcache(*args, **kw)
    launcher = td.DecodeLauncher(inp, "tdec_n64_w4s2_p3")  # three splits: the combine runs
    assert launcher.pdl == pdl
    append, decode, combine = launcher.launches
    seqlens = _kvcache.seqlens_tensor(inp)
    out = torch.empty(inp.q.shape, dtype=inp.q.dtype)
    ws = torch.empty(launcher.ws_size, dtype=torch.float32)
    tensors = {
        "append": (append, (inp.k, inp.v, inp.k_cache, inp.v_cache, seqlens, inp.block_table, seqlens)),
        "split-KV": (decode, (inp.q, inp.k_cache, inp.v_cache, seqlens, inp.block_table, seqlens,
                              seqlens, out, ws)),
        "combine": (combine, (ws, out)),
    }
    memory = re.compile(r"\b(?:ld|st|atom|red)\.global|\bcp\.async")
    for name, (launch, ts) in tensors.items():
        compiled = triton_attn.compile_launch_offline(launch.fn, (*ts, *launch.scalars), launch.kw, 90)
        ptx = compiled.asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        first_access = memory.search(body)
        assert first_access is not None, name
        if not pdl:
            assert "griddepcontrol" not in ptx, name
            continue
        assert compiled.metadata.launch_pdl, name
        wait = body.find("griddepcontrol.wait")
        assert 0 <= wait < first_access.start(), (name, body[first_access.start() - 200:first_access.end()])
        assert ("griddepcontrol.launch_dependents" in body) == (name != "combine"), name

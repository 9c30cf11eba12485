#!/usr/bin/env python3
"""Check every compiled Hopper (fwd_sm90_*) kernel on an H100/H200, then time it.

    . tools/device_prep.sh 'fwd_sm90_*' && python3 tools/gpu_check_sm90.py
    python3 tools/gpu_check_sm90.py --kernels 'fwd_sm90_f16_d128_*' --no-speed

Correctness: for each kernel, odd shapes (seqlen 1, 17, 128, 1000, 4097; seqlen_q != seqlen_k
both ways, with rows that see no key under the causal mask; GQA 4:1 and MQA; (B,H,N,D) and
(B,N,H,D) strided views), causal and not, in the kernel's dtype and head dim, against attention
in float64. The rule is FlashAttention's: the max abs error is at most twice PyTorch's own error
in the same precision (the larger of plain matmul-softmax-matmul and math SDPA) plus 1e-5; the
log-sum-exp likewise against the lse of the rounded scores, with -inf exactly where a row sees
no key. A second run on the same inputs must give bit-identical output and lse.

Attention features (docs/FEATURES.md; ``--no-features`` skips them): sliding windows (one
side, both sides, wider than the sequence, left 0, with causal, seqlen_q != seqlen_k both ways,
whole row blocks whose band holds no key), softcap, ALiBi (Hq,) and (B, Hq), combinations,
GQA, and packed sequences with a window, softcap and ALiBi, for each kernel, against
sparktune's reference math in float64 with the same rule, PyTorch's own error from the
definitions in the inputs' dtype (tests/_features_baseline.py); repeat runs bit-identical.

Speed: the ANCHORS sweep points (head dims 64 and 128, causal and not, seqlen 2k/4k/8k/16k at
16k tokens, 12 heads, fp16), TFLOP/s of each sm90 kernel against torch SDPA's cuDNN and flash
backends measured in the same run, round-robin. Then, unless ``--no-features``, the features'
points (bf16, 1 x 16 heads x 16k tokens, head dim 128: causal, causal + window 4k, causal +
softcap 50, causal + ALiBi), TFLOP/s of the visible area, each bf16 d128 kernel next to the
Triton family's default config, round-robin.

Exit status: 1 on any correctness failure, 0 otherwise.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparktune.backends.reference import reference_attention  # noqa: E402
from sparktune.backends.spark import SparkBackend, load_extension  # noqa: E402
from tests._features_baseline import feature_attention  # noqa: E402
from tests._oracle import lowp_attention  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: (batch, heads_q, heads_kv, seqlen_q, seqlen_k, layout)
SHAPES = (
    (2, 4, 4, 1, 1, "bhnd"),
    (2, 4, 4, 17, 17, "bnhd"),
    (2, 4, 4, 128, 128, "bhnd"),
    (1, 4, 1, 1000, 1000, "bnhd"),  # MQA
    (1, 8, 2, 4097, 4097, "bhnd"),  # GQA 4:1
    (2, 4, 4, 100, 1000, "bhnd"),   # seqlen_q < seqlen_k
    (2, 4, 4, 1000, 100, "bnhd"),   # seqlen_q > seqlen_k: causal rows with no key
    (1, 4, 4, 17, 4097, "bnhd"),
    (1, 8, 4, 300, 300, "bhnd_slice"),  # a slice of a packed qkv-like buffer
    (6, 12, 4, 1000, 1000, "bnhd"),  # 576-864 tiles: several per block of a persistent kernel
    (3, 12, 12, 777, 1500, "bhnd"),  # uneven causal tiles, several per block
    (1, 8, 8, 200, 20000, "bhnd"),  # few rows, long K/V: a persistent kernel walks 4-8 sections
)
FLOOR = 1e-5


def make(b, h, n, d, layout, dtype, gen):
    if layout == "bhnd":
        return torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
    if layout == "bnhd":
        return torch.randn(b, n, h, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
    # every other head of a (B, N, 2H, D) buffer: strided heads
    buf = torch.randn(b, n, 2 * h, d, device="cuda", dtype=dtype, generator=gen)
    return buf[:, :, ::2].transpose(1, 2)


def max_err(a, ref):
    return float((a.double() - ref).abs().max()) if a.numel() else 0.0


def judge(out, out2, lse, lse2, ref, ref_lse, keep, empty, base, lse_base, rows_out=None):
    """(out error, lse error, reasons a check fails) of one kernel's two runs against the
    reference: the 2x rule on out and on the lse of the rows that see a key, the rows without
    one exactly those with lse -inf (and, given their view ``rows_out``, zeros there), and the
    two runs bit-identical."""
    err = max_err(out, ref)
    lerr = max_err(lse[keep], ref_lse[keep])
    why = []
    if not math.isfinite(err) or err > 2 * base + FLOOR:
        why.append(f"out err {err:.3g} > bound {2 * base + FLOOR:.3g}")
    if not torch.equal(torch.isneginf(lse), empty):
        why.append("lse -inf rows differ")
    elif rows_out is not None and not bool((rows_out[empty] == 0).all()):
        why.append("rows without a key are not 0")
    if not math.isfinite(lerr) or lerr > 2 * lse_base + FLOOR:
        why.append(f"lse err {lerr:.3g} > bound {2 * lse_base + FLOOR:.3g}")
    if not (torch.equal(out, out2) and torch.equal(lse, lse2)):
        why.append("repeat run not bit-identical")
    return err, lerr, why


def check_kernels(spark, names, infos):
    failures, rows = [], []
    groups = {}
    for n in names:
        groups.setdefault((infos[n]["dtype"], infos[n]["head_dim"]), []).append(n)
    for (dtname, d), kernels in sorted(groups.items()):
        dtype = DTYPES[dtname]
        for shape in SHAPES:
            b, hq, hk, nq, nk, layout = shape
            gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((shape, d)).encode()))
            q = make(b, hq, nq, d, layout, dtype, gen)
            k = make(b, hk, nk, d, layout, dtype, gen)
            v = make(b, hk, nk, d, layout, dtype, gen)
            scale = 1.0 / math.sqrt(d)
            for causal in (False, True):
                with torch.no_grad():
                    ref, ref_lse = reference_attention(q, k, v, causal=causal, scale=scale)
                    lows = [lowp_attention(q, k, v, causal=causal, scale=scale, kind=kd)
                            for kd in ("plain", "sdpa")]
                base = max(max_err(o, ref) for o, _ in lows)
                empty = torch.isneginf(ref_lse)
                keep = ~empty
                lse_base = max_err(lows[0][1][keep], ref_lse[keep])
                for name in kernels:
                    label = f"{name} b{b} h{hq}/{hk} q{nq} k{nk} {layout} {'causal' if causal else 'full'}"
                    try:
                        out = torch.empty_like(q)
                        lse = spark.forward(q, k, v, out, config=name, causal=causal, scale=scale)
                        out2 = torch.empty_like(q)
                        lse2 = spark.forward(q, k, v, out2, config=name, causal=causal, scale=scale)
                        torch.cuda.synchronize()
                        err, lerr, why = judge(out, out2, lse, lse2, ref, ref_lse, keep, empty,
                                               base, lse_base)
                    except Exception as exc:  # one check fails, the rest run
                        err, lerr, why = float("nan"), float("nan"), [f"{type(exc).__name__}: {exc}"]
                    ok = not why
                    rows.append(f"{'PASS' if ok else 'FAIL'} {label:<78} err={err:.2e} "
                                f"(torch {base:.2e}) lse_err={lerr:.2e}" + ("" if ok else "  " + "; ".join(why)))
                    print(rows[-1], flush=True)
                    if not ok:
                        failures.append(rows[-1])
    return failures, rows


#: feature cases: (batch, heads_q, heads_kv, seqlen_q, seqlen_k, causal, window, softcap,
#: alibi (None, "h" (Hq,), "bh" (B, Hq)), scale (None: head_dim ** -0.5))
FEATURE_SHAPES = (
    (2, 4, 2, 1000, 1000, True, (255, -1), 0.0, None, None),
    (1, 4, 4, 1000, 1000, False, (100, 37), 0.0, None, None),
    (1, 4, 1, 777, 1000, False, (-1, 100), 0.0, None, None),
    (1, 4, 4, 1000, 777, False, (300, -1), 0.0, None, None),
    (2, 4, 4, 17, 17, True, (100, 100), 0.0, None, None),
    (1, 4, 4, 1000, 1000, True, (0, -1), 0.0, None, None),
    (2, 4, 4, 1000, 100, False, (0, 0), 0.0, None, None),  # row blocks with no key at all
    (1, 8, 2, 4097, 4097, True, (1023, -1), 0.0, None, None),
    (6, 12, 4, 1000, 1000, True, (127, -1), 0.0, None, None),  # several tiles per block
    (2, 8, 2, 1000, 1000, True, (-1, -1), 30.0, None, 0.5),
    (1, 4, 4, 17, 1000, False, (-1, -1), 50.0, None, 0.5),
    (2, 8, 8, 1000, 1000, True, (-1, -1), 0.0, "h", None),
    (2, 4, 2, 777, 1000, False, (-1, -1), 0.0, "bh", None),
    (1, 8, 2, 1537, 1537, True, (255, -1), 30.0, "bh", 0.4),
    (2, 4, 4, 1000, 517, False, (64, 16), 5.0, "h", None),
)
#: packed feature cases: (query lengths, key lengths, heads_q, heads_kv, causal, window,
#: softcap, alibi, scale)
FEATURE_VARLEN = (
    ((1, 17, 1000, 0, 4097, 128), (1, 17, 1000, 0, 4097, 128), 4, 4, True, (255, -1), 0.0, None, None),
    ((5, 300, 64, 9), (700, 3, 64, 0), 8, 2, False, (32, 16), 30.0, "bh", 0.5),
)


def check_features(spark, names, infos):
    """The feature cases for each kernel: out and lse against float64 with the 2x rule, -inf
    rows exact and their output 0, a repeat run bit-identical."""
    failures, rows = [], []
    groups = {}
    for n in names:
        groups.setdefault((infos[n]["dtype"], infos[n]["head_dim"]), []).append(n)
    cases = [(c, False) for c in FEATURE_SHAPES] + [(c, True) for c in FEATURE_VARLEN]
    for (dtname, d), kernels in sorted(groups.items()):
        dtype = DTYPES[dtname]
        for case, packed in cases:
            gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, d)).encode()))
            if packed:
                lq, lk, hq, hk, causal, window, softcap, alibi, scale = case
                batch = len(lq)
                cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda") for x in (lq, lk)]
                q = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype, generator=gen)
                k, v = (torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype, generator=gen)
                        for _ in range(2))
                extra = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max(lq),
                             max_seqlen_k=max(lk))
                label_shape = f"packed q{list(lq)} k{list(lk)} h{hq}/{hk}"
            else:
                batch, hq, hk, nq, nk, causal, window, softcap, alibi, scale = case
                q = make(batch, hq, nq, d, "bnhd", dtype, gen)
                k, v = (make(batch, hk, nk, d, "bnhd", dtype, gen) for _ in range(2))
                extra = {}
                label_shape = f"b{batch} h{hq}/{hk} q{nq} k{nk}"
            scale = 1.0 / math.sqrt(d) if scale is None else scale
            slopes = None
            if alibi is not None:
                shape = (hq,) if alibi == "h" else (batch, hq)
                slopes = torch.rand(shape, generator=gen, device="cuda") * 0.2
            kw = {"window": window}
            if softcap:
                kw["softcap"] = softcap
            if slopes is not None:
                kw["alibi_slopes"] = slopes
            ref_kw = dict(kw)
            if packed:
                ref_kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
            with torch.no_grad():
                ref, ref_lse = reference_attention(q, k, v, causal=causal, scale=scale, **ref_kw)
                low, low_lse = feature_attention(
                    q, k, v, scale=scale, causal=causal, window=window, softcap=softcap,
                    slopes=slopes, cu_q=cu[0].tolist() if packed else None,
                    cu_k=cu[1].tolist() if packed else None)
            base = max_err(low, ref)
            empty = torch.isneginf(ref_lse)
            keep = ~empty
            lse_base = max_err(low_lse[keep], ref_lse[keep])
            what = (f"{label_shape} {'causal' if causal else 'full'} window={window} "
                    f"softcap={softcap:g} alibi={alibi}")
            for name in kernels:
                label = f"{name} {what}"
                try:
                    runs = []
                    for _ in range(2):
                        out = torch.full_like(q, float("nan"))
                        lse = spark.forward(q, k, v, out, config=name, causal=causal, scale=scale,
                                            **extra, **kw)
                        runs.append((out, lse))
                    torch.cuda.synchronize()
                    (out, lse), (out2, lse2) = runs
                    rows_out = out.transpose(0, 1) if packed else out
                    err, lerr, why = judge(out, out2, lse, lse2, ref, ref_lse, keep, empty, base,
                                           lse_base, rows_out)
                except Exception as exc:  # one check fails, the rest run
                    err, lerr, why = float("nan"), float("nan"), [f"{type(exc).__name__}: {exc}"]
                ok = not why
                rows.append(f"{'PASS' if ok else 'FAIL'} {label} err={err:.2e} (torch {base:.2e}) "
                            f"lse_err={lerr:.2e}" + ("" if ok else "  " + "; ".join(why)))
                print(rows[-1], flush=True)
                if not ok:
                    failures.append(rows[-1])
    return failures, rows


def feature_speed(spark, names, infos, rounds, budget_s):
    """TFLOP/s of the visible area of each bf16 d128 sm90 kernel next to the Triton family's
    default forward, with the features of BENCHMARKS.md's Triton table."""
    from sparktune.problem import DeviceInfo, Problem

    ks = [n for n in names if infos[n]["head_dim"] == 128 and infos[n]["dtype"] == "bfloat16"]
    if not ks:
        return
    try:
        from sparktune.kernels import triton_attn as ta
        from sparktune.kernels import triton_space as space
    except Exception as exc:  # noqa: BLE001 - the table without the Triton column
        print(f"(no Triton column: {type(exc).__name__}: {exc})")
        ta = space = None
    t_end = time.time() + budget_s
    n, h, d = 16384, 16, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    out = torch.empty_like(q)
    slopes = torch.rand(h, device="cuda", generator=gen) * 0.1
    dev = DeviceInfo.from_torch("cuda")
    print("\nfeature speed (TFLOP/s of the visible area, bf16, 1 x 16 heads x 16k tokens, d128; "
          f"best of {rounds} round-robin rounds)")
    for label, kw in (("causal", {}), ("causal+window 4k", {"window": (4095, -1)}),
                      ("causal+softcap 50", {"softcap": 50.0}),
                      ("causal+alibi", {"alibi_slopes": slopes})):
        if time.time() > t_end:
            print("(time budget reached: feature speed table cut short)")
            return
        window = kw.get("window", (-1, -1))
        problem = Problem("fwd", "bfloat16", 1, h, h, n, n, d, True, window_left=window[0],
                          softcap="softcap" in kw, alibi="alibi_slopes" in kw)
        flops = problem.flops()
        cands = {}
        for name in ks:
            cands[name] = (lambda name=name, kw=kw: spark.forward(
                q, k, v, out, config=name, causal=True, scale=d ** -0.5, **kw))
        if ta is not None:
            cfg = space.default_config_name(problem, dev)
            cands[f"triton:{cfg}"] = (lambda cfg=cfg, kw=kw: ta.attention_forward(
                q, k, v, out, config=cfg, causal=True, scale=d ** -0.5, **kw))
        for fn in cands.values():
            fn()
        torch.cuda.synchronize()
        best = {c: math.inf for c in cands}
        for _ in range(rounds):
            for c, fn in cands.items():
                best[c] = min(best[c], time_fn(fn, 10))
        cells = "  ".join(f"{c.removeprefix('fwd_sm90_')}={flops / t / 1e12:.0f}" for c, t in best.items())
        print(f"{label:>18}  {cells}", flush=True)


def time_fn(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e-3


def measure_point(spark, kernels, d, n, causal, rounds):
    """TFLOP/s of SDPA cuDNN, SDPA flash and each kernel at one sweep point, timed round-robin
    (best of ``rounds`` rounds of 10 calls)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h = 16384 // n, 12
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    out = torch.empty_like(q)
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    def ours(name):
        def run():
            spark.forward(q, k, v, out, config=name, causal=causal, scale=d ** -0.5)
        return run

    cands = {}
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            sdpa(backend)()
            cands[label] = sdpa(backend)
        except Exception:
            pass
    for name in kernels:
        cands[name] = ours(name)
    for fn in cands.values():
        fn()
    torch.cuda.synchronize()
    best = {c: math.inf for c in cands}
    for _ in range(rounds):
        for c, fn in cands.items():
            best[c] = min(best[c], time_fn(fn, 10))
    return {c: flops / t / 1e12 for c, t in best.items()}


def speed(spark, names, infos, rounds, budget_s):
    t_end = time.time() + budget_s
    print("\nspeed (TFLOP/s, fp16, 12 heads, 16k tokens; best of", rounds, "round-robin rounds)")
    header = f"{'hd':>3} {'causal':>6} {'seqlen':>6} {'cudnn':>7} {'flash':>7}  sm90 kernels"
    print(header)
    for d in (64, 128):
        ks = [n for n in names if infos[n]["head_dim"] == d and infos[n]["dtype"] == "float16"]
        if not ks:
            continue
        for causal in (False, True):
            for n in (2048, 4096, 8192, 16384):
                if time.time() > t_end:
                    print("(time budget reached: speed table cut short)")
                    return
                tf = measure_point(spark, ks, d, n, causal, rounds)
                cells = "  ".join(f"{c.removeprefix('fwd_sm90_')}={tf[c]:.0f}"
                                  + (f" ({tf[c] / tf['cudnn']:.2f}x)" if "cudnn" in tf else "")
                                  for c in ks)
                print(f"{d:>3} {str(causal):>6} {n:>6} {tf.get('cudnn', float('nan')):>7.0f} "
                      f"{tf.get('flash', float('nan')):>7.0f}  {cells}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="fwd_sm90_*", help="shell patterns, comma-separated")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speed-budget", type=float, default=90.0, help="seconds for the speed table")
    ap.add_argument("--no-features", action="store_true",
                    help="skip the attention features' checks and speed points")
    args = ap.parse_args(argv)
    mod, err = load_extension()
    if mod is None:
        print(f"gpu_check_sm90: {err}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check_sm90: no CUDA GPU", file=sys.stderr)
        return 2
    cap = torch.cuda.get_device_capability()
    infos = {k["name"]: k for k in mod.kernels()}
    pats = [p.strip() for p in args.kernels.split(",") if p.strip()]
    names = sorted(n for n, k in infos.items() if k["family"] == 90
                   and any(fnmatch.fnmatchcase(n, p) for p in pats))
    print(f"device {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}; {len(names)} sm90 kernels")
    if not names:
        print("gpu_check_sm90: no fwd_sm90 kernel compiled (build with SPARKTUNE_CUDA_ARCHS=90)",
              file=sys.stderr)
        return 1
    if cap != (9, 0):
        print(f"gpu_check_sm90: sm_90a kernels need an sm_90 GPU, this is sm_{cap[0]}{cap[1]}",
              file=sys.stderr)
        return 2
    spark = SparkBackend()
    t0 = time.time()
    failures, rows = check_kernels(spark, names, infos)
    if not args.no_features:
        print("\nattention features")
        more_failures, more_rows = check_features(spark, names, infos)
        failures, rows = failures + more_failures, rows + more_rows
    print(f"\ncorrectness: {len(rows) - len(failures)} passed, {len(failures)} failed "
          f"({time.time() - t0:.0f} s)")
    for f in failures:
        print("  " + f)
    if not args.no_speed:
        speed(spark, names, infos, args.rounds, args.speed_budget)
        if not args.no_features:
            feature_speed(spark, names, infos, args.rounds, args.speed_budget)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

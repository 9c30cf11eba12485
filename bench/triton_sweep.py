#!/usr/bin/env python
"""FlashAttention-2's long-sequence sweep for the Triton family, next to torch's flash and cuDNN
SDPA.

    PYTHONPATH=. python bench/triton_sweep.py                 # default subset, about 3-4 minutes
    PYTHONPATH=. python bench/triton_sweep.py --all-configs   # every config that fits (long)
    PYTHONPATH=. python bench/triton_sweep.py --seqlens 4096,8192 --head-dims 128 --causal 0

By default 16k tokens per batch (batch = 16384 / seqlen), 12 heads; fp16, (B, H, N, D) inputs,
random normal. Forward TFLOP/s for each forward config; forward+backward TFLOP/s for each backward
config (run after the best forward config of that shape, as one function). FLOPs as
FlashAttention counts them: forward 4*B*H*N^2*D, halved when causal; forward+backward 3.5x.
Timing: ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")``.

Before timing, each config's output (and gradients) are compared with torch's flash on the
same inputs; a config off by more than a loose bound is marked ``BAD`` and never the best.
The machines are shared: compare the ratios measured in one run, not absolutes across runs.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F
from common import add_sweep_arguments, do_bench, sweep, tflops

from sparktune.backends.triton import TritonBackend, warmup_jobs
from sparktune.kernels.triton_space import BWD_SPACE, FWD_SPACE
from sparktune.problem import DeviceInfo, Problem

DEVICE = "cuda"
#: the default subset: the forward winners per (head dim, causal) at seqlen 8192 of an earlier
#: sweep of a minimal Triton forward on an H200, and neighbours; the backward defaults (no
#: spills on sm_90) and a few larger or atomic-dQ alternatives
DEFAULT_FWD = (
    "tfwd_m128n64_w4s3", "tfwd_m64n128_w4s3", "tfwd_m128n64_w8s3", "tfwd_m64n64_w4s3",
    "tfwd_m128n128_w8s3", "tfwd_m128n32_w4s3", "tfwd_m128n64_w8s2", "tfwd_m64n64_w4s2",
)
DEFAULT_BWD = (
    "tbwd_m32n128_w8s3", "tbwd_m32n128_w8s2", "tbwd_m32n128_w4s3", "tbwd_m64n128_w8s2",
    "tbwd_m32n64_w8s2", "tbwd_m128n128_w8s2", "tbwd_m64n128_w8s2_dqatomic",
)
#: a config whose max abs error versus torch's flash exceeds this (relative to the largest
#: reference value, plus an absolute part) is reported BAD instead of timed
_SANITY_REL, _SANITY_ABS = 2e-2, 2e-2


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    err = (got.float() - ref.float()).abs().max().item()
    return math.isfinite(err) and err <= _SANITY_REL * ref.float().abs().max().item() + _SANITY_ABS


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def _torch_runs(name, q, k, v, dout, causal):
    """(fwd, fwd+bwd) callables for one torch SDPA backend, plus its (out, dq, dk, dv)."""
    from torch.nn.attention import sdpa_kernel

    backend = _sdpa_backend(name)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        out.backward(dout)

    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    out.backward(dout)
    result = (out.detach(), qg.grad.clone(), kg.grad.clone(), vg.grad.clone())
    return fwd, fwd_bwd, (qg, kg, vg), result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(ap)
    ap.add_argument("--all-configs", action="store_true",
                    help="every config of the space that fits (default: a subset of "
                         f"{len(DEFAULT_FWD)} forward and {len(DEFAULT_BWD)} backward configs)")
    ap.add_argument("--configs", default="", help="regex: keep only configs whose name matches")
    ap.add_argument("--fwd-only", action="store_true", help="skip forward+backward")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's flash and cuDNN")
    ap.add_argument("--per-config", action="store_true",
                    help="print every config's TFLOP/s per shape, not only the best")
    ap.add_argument("--processes", type=int, default=min(16, os.cpu_count() or 1),
                    help="worker processes that compile ahead of time (1: compile lazily here)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 1
    import triton

    device = DeviceInfo.from_torch()
    print(f"device: {device.name} sm_{device.arch}; torch {torch.__version__}, triton "
          f"{triton.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    backend = TritonBackend()
    if backend.unavailable_reasons():
        print("triton backend unavailable: " + "; ".join(backend.unavailable_reasons()))
        return 1

    pick = re.compile(args.configs) if args.configs else None
    fwd_names = [c.name for c in FWD_SPACE] if args.all_configs else list(DEFAULT_FWD)
    bwd_names = [] if args.fwd_only else ([c.name for c in BWD_SPACE] if args.all_configs
                                          else list(DEFAULT_BWD))
    fwd_names = [n for n in fwd_names if pick is None or pick.search(n)]
    bwd_names = [n for n in bwd_names if pick is None or pick.search(n)]
    shapes = list(sweep(args))

    def problem(op, d, causal, n, b):
        return Problem(op, "float16", b, args.heads, args.heads, n, n, d, causal)

    def supported(op, names, d, causal, n, b):
        return [x for x in names if not backend.not_supported_reasons(problem(op, d, causal, n, b), x, device)]

    # compile up front (kernels depend on head dim and causal, not on the sequence length)
    first: dict[tuple[int, bool], tuple[int, int]] = {}
    for d, causal, n, b in shapes:
        first.setdefault((d, causal), (n, b))
    jobs = []
    for (d, causal), (n, b) in first.items():
        jobs += [(problem("fwd", d, causal, n, b), x) for x in supported("fwd", fwd_names, d, causal, n, b)]
        jobs += [(problem("bwd", d, causal, n, b), x) for x in supported("bwd", bwd_names, d, causal, n, b)]
    t0 = time.perf_counter()
    try:
        warmup_jobs(jobs, processes=args.processes)
        print(f"compiled {len(jobs)} (config, variant) pairs in {time.perf_counter() - t0:.1f} s")
    except Exception as exc:  # noqa: BLE001 - compile lazily instead
        print(f"ahead-of-time compilation failed ({type(exc).__name__}: {exc}); compiling lazily")

    rows = []
    for d, causal, n, b in shapes:
        torch.cuda.empty_cache()
        fwd_ok = supported("fwd", fwd_names, d, causal, n, b)
        bwd_ok = supported("bwd", bwd_names, d, causal, n, b)
        row, per_fwd, per_fb = _measure_shape(backend, d, causal, n, b, fwd_ok, bwd_ok, args)
        rows.append(row)
        _print_row(row)
        if args.per_config:
            for x, t in sorted(per_fwd.items()):
                print(f"      {x:28s} fwd {'BAD' if t is None else f'{t:6.1f}'}")
            for x, t in sorted(per_fb.items()):
                print(f"      {x:28s} fwd+bwd {'BAD' if t is None else f'{t:6.1f}'}")

    _print_table(rows, args)
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


def _measure_shape(backend, d, causal, n, b, fwd_names, bwd_names, args):
    """One row of the table: torch's backends and every given config on one shape."""
    heads = args.heads
    fwd_flops = Problem("fwd", "float16", b, heads, heads, n, n, d, causal).flops()
    fb_flops = 3.5 * fwd_flops
    gen = torch.Generator(device=DEVICE).manual_seed(n + d + causal)
    q, k, v, dout = (torch.randn(b, heads, n, d, device=DEVICE, dtype=torch.float16, generator=gen)
                     for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    row = {"d": d, "causal": causal, "n": n, "b": b}
    where = f"d{d} causal={int(causal)} n{n}"

    ref = None
    for name in () if args.no_torch else ("flash", "cudnn"):
        try:
            fwd, fwd_bwd, leaves, result = _torch_runs(name, q, k, v, dout, causal)
            ref = ref or result
            row[f"{name}_fwd"] = tflops(fwd_flops, do_bench(fwd))
            if not args.fwd_only:
                row[f"{name}_fb"] = tflops(fb_flops, do_bench(fwd_bwd, grad_to_none=list(leaves)))
        except Exception as exc:  # noqa: BLE001 - a missing torch backend is a blank cell
            print(f"  {name} {where}: {type(exc).__name__}: {str(exc)[:200]}")

    def run_fwd(config):
        out = torch.empty_like(q)
        lse = backend.forward(q, k, v, out, config=config, causal=causal, scale=scale)
        return out, lse

    def run_fwd_bwd(fwd_config, bwd_config):
        out, lse = run_fwd(fwd_config)
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        backend.backward(dout, q, k, v, out, lse, *grads, config=bwd_config, causal=causal,
                         scale=scale)
        return grads

    per_fwd: dict[str, float | None] = {}
    for x in fwd_names:
        try:
            out, _ = run_fwd(x)
            if ref is not None and not _close(out, ref[0]):
                per_fwd[x] = None
                continue
            per_fwd[x] = tflops(fwd_flops, do_bench(lambda x=x: run_fwd(x)))
        except Exception as exc:  # noqa: BLE001
            print(f"  {x} {where}: {type(exc).__name__}: {str(exc)[:200]}")
    good_fwd = {x: t for x, t in per_fwd.items() if t is not None}
    best_fwd = max(good_fwd, key=good_fwd.get) if good_fwd else None
    if best_fwd:
        row["triton_fwd"], row["triton_fwd_cfg"] = good_fwd[best_fwd], best_fwd

    per_fb: dict[str, float | None] = {}
    for x in bwd_names if best_fwd and not args.fwd_only else ():
        try:
            grads = run_fwd_bwd(best_fwd, x)
            if ref is not None and not all(_close(g, r) for g, r in zip(grads, ref[1:], strict=True)):
                per_fb[x] = None
                continue
            per_fb[x] = tflops(fb_flops, do_bench(lambda x=x: run_fwd_bwd(best_fwd, x)))
        except Exception as exc:  # noqa: BLE001
            print(f"  {x} {where}: {type(exc).__name__}: {str(exc)[:200]}")
    good_fb = {x: t for x, t in per_fb.items() if t is not None}
    if good_fb:
        best_fb = max(good_fb, key=good_fb.get)
        row["triton_fb"], row["triton_fb_cfg"] = good_fb[best_fb], best_fb
    return row, per_fwd, per_fb


def _fmt(x, width=6, digits=0) -> str:
    return f"{x:{width}.{digits}f}" if isinstance(x, float) else " " * (width - 1) + "-"


def _ratio(a, b) -> str:
    return f"{a / b:5.2f}" if isinstance(a, float) and isinstance(b, float) and b > 0 else "    -"


def _print_row(r) -> None:
    print(f"  d{r['d']} causal={int(r['causal'])} n{r['n']} b{r['b']}: triton fwd {_fmt(r.get('triton_fwd'))} "
          f"({r.get('triton_fwd_cfg', '-')}), fwd+bwd {_fmt(r.get('triton_fb'))} "
          f"({r.get('triton_fb_cfg', '-')}); flash {_fmt(r.get('flash_fwd'))}/{_fmt(r.get('flash_fb'))}, "
          f"cudnn {_fmt(r.get('cudnn_fwd'))}/{_fmt(r.get('cudnn_fb'))}", flush=True)


def _print_table(rows, args) -> None:
    print()
    print(f"TFLOP/s, fp16, {args.tokens} tokens, {args.heads} heads; ratios = triton / other")
    head = (f"{'hd':>3} {'c':>1} {'seqlen':>6} {'b':>3} | {'flash':>6} {'cudnn':>6} {'triton':>6} "
            f"{'/fl':>5} {'/cu':>5} {'best fwd':<20} | {'flash':>6} {'cudnn':>6} {'triton':>6} "
            f"{'/fl':>5} {'/cu':>5} {'best fwd+bwd':<26}")
    print(f"{'':17}| {'forward':^57} | {'forward + backward':^63}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['d']:>3} {int(r['causal']):>1} {r['n']:>6} {r['b']:>3} | "
              f"{_fmt(r.get('flash_fwd'))} {_fmt(r.get('cudnn_fwd'))} {_fmt(r.get('triton_fwd'))} "
              f"{_ratio(r.get('triton_fwd'), r.get('flash_fwd'))} {_ratio(r.get('triton_fwd'), r.get('cudnn_fwd'))} "
              f"{r.get('triton_fwd_cfg', '-'):<20} | "
              f"{_fmt(r.get('flash_fb'))} {_fmt(r.get('cudnn_fb'))} {_fmt(r.get('triton_fb'))} "
              f"{_ratio(r.get('triton_fb'), r.get('flash_fb'))} {_ratio(r.get('triton_fb'), r.get('cudnn_fb'))} "
              f"{r.get('triton_fb_cfg', '-'):<26}")


if __name__ == "__main__":
    sys.exit(main())

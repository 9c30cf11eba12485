"""Forward TFLOP/s of the spark kernels against PyTorch's flash and cuDNN SDPA on the
long-sequence sweep (16k tokens: seqlen 512..16384 at batch 16384/seqlen, 12 heads, fp16),
all measured in this run. A benchmark, not a test: it prints numbers.

    python bench/spark_fwd.py                      # default config per shape
    python bench/spark_fwd.py --configs all        # every compiled config, best per shape
    python bench/spark_fwd.py --seqlens 1024,8192 --head-dims 128 --causal 0
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from common import add_sweep_arguments, do_bench, sweep, tflops
from torch.nn.attention import SDPBackend, sdpa_kernel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    add_sweep_arguments(ap)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--configs", default="default", help="default | all | comma-separated names")
    args = ap.parse_args(argv)

    from sparktune.backends.spark import SparkBackend
    from sparktune.problem import DeviceInfo, Problem

    b = SparkBackend()
    if b.unavailable_reasons():
        print("spark unavailable:", b.unavailable_reasons())
        return 1
    dev = DeviceInfo.from_torch("cuda")
    dtype = getattr(torch, args.dtype)
    print(f"# {dev.name} sm_{dev.arch}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    rows = []
    hdr = f"{'hd':>3} {'causal':>6} {'seqlen':>6} {'batch':>5} | {'spark':>7} {'flash':>7} {'cudnn':>7} | {'x flash':>7} {'x cudnn':>7} | config"
    print(hdr)
    for d, causal, n, bs in sweep(args):
        p = Problem("fwd", args.dtype, bs, args.heads, args.heads, n, n, d, causal)
        flops = p.flops()
        q, k, v = (torch.randn(bs, args.heads, n, d, device="cuda", dtype=dtype) for _ in range(3))
        out = torch.empty_like(q)
        if args.configs == "default":
            names = [b.default_config(p, dev)]
        elif args.configs == "all":
            names = [c.config for c in b.candidates(p, dev)]
        else:
            names = [c for c in args.configs.split(",") if not b.not_supported_reasons(p, c, dev)]
        best_t, best_name = math.inf, None
        for name in names:
            if name is None:
                continue
            try:
                t = do_bench(lambda: b.forward(q, k, v, out, config=name, causal=causal, scale=d ** -0.5))
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: failed: {exc}", file=sys.stderr)
                continue
            if t < best_t:
                best_t, best_name = t, name
        res = {}
        for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    res[label] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            except Exception:  # noqa: BLE001
                res[label] = math.nan
        s, fl, cu = (tflops(flops, t) for t in (best_t, res["flash"], res["cudnn"]))
        rows.append((d, causal, n, s / fl, s / cu))
        print(f"{d:>3} {int(causal):>6} {n:>6} {bs:>5} | {s:7.1f} {fl:7.1f} {cu:7.1f} | {s / fl:7.3f} {s / cu:7.3f} | {best_name}", flush=True)
    if rows:
        gm = math.exp(sum(math.log(r[3]) for r in rows) / len(rows))
        print(f"# geometric mean x flash: {gm:.3f}; min x flash: {min(r[3] for r in rows):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

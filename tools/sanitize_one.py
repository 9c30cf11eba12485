#!/usr/bin/env python3
"""Run one compiled spark kernel once on a small problem, for compute-sanitizer:

    compute-sanitizer --tool racecheck python3 tools/sanitize_one.py fwd_sm90_f16_d128_m128n128_s2

A forward kernel runs forward; a backward kernel runs its forward's reference output and
log-sum-exp (float32 math) and then the backward (``--deterministic`` for the fixed dQ order).
The shape is small (sanitizers run kernels hundreds of times slower), with a query tail, a key
tail, GQA 2:1 and, with ``--causal``, the bottom-right mask. Exit status 0 when the kernel ran;
the sanitizer's own report and exit status say what it found.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from sparktune.backends.reference import reference_attention
from sparktune.backends.spark import SparkBackend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--seqlen-q", type=int, default=300)
    ap.add_argument("--seqlen-k", type=int, default=333)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    spark = SparkBackend()
    try:
        info = spark.kernel_info(args.config)
    except KeyError:
        print(f"sanitize_one: {args.config} is not compiled", file=sys.stderr)
        return 2
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[info["dtype"]]
    d, b, hq, hk = info["head_dim"], args.batch, 4, 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
               for h, n in ((hq, args.seqlen_q), (hk, args.seqlen_k), (hk, args.seqlen_k)))
    scale = 1.0 / math.sqrt(d)
    if info["op"] == "fwd":
        out = torch.empty_like(q)
        spark.forward(q, k, v, out, config=args.config, causal=args.causal, scale=scale)
    else:
        ref, lse = reference_attention(q, k, v, causal=args.causal, scale=scale)
        out = ref.to(dtype)
        dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=gen)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        spark.backward(dout, q, k, v, out, lse.float(), dq, dk, dv, config=args.config,
                       causal=args.causal, scale=scale, deterministic=args.deterministic)
    torch.cuda.synchronize()
    print(f"sanitize_one: {args.config} ran (causal={args.causal})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

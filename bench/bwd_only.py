"""Backward-only TFLOP/s of compiled spark backward kernels against cuDNN's backward, measured
in this run, round-robin. FLOPs as FlashAttention counts them: backward = 2.5x the forward's
4*B*H*N^2*D (halved when causal). The forward's output and log-sum-exp come from PyTorch's
flash kernel, so only the backward is timed; cuDNN's backward is autograd's on a retained graph
of its own forward. Family 90 kernels are also timed in deterministic mode ("det:").

    python bench/bwd_only.py                                   # every compiled fp16 backward
    python bench/bwd_only.py --kernels 'bwd_sm90_*' --seqlens 4096,16384 --head-dims 128
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os

import torch
import torch.nn.functional as F
from common import add_sweep_arguments, seconds_per_call, sweep
from torch.nn.attention import SDPBackend, sdpa_kernel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    add_sweep_arguments(ap)
    ap.add_argument("--kernels", default="bwd_*", help="shell patterns of backward configs, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--l2-mb", default="",
                    help="comma-separated L2 budgets (MB) of the family 90 backward's sectioned order "
                         "(SPARKTUNE_SM90_BWD_L2_MB, read at each launch; 0: key blocks of one pair "
                         "after another), each timed as its own candidate")
    args = ap.parse_args(argv)

    from sparktune.backends.spark import SparkBackend, load_extension

    mod, _ = load_extension()
    pats = args.kernels.split(",")
    infos = {k["name"]: k for k in mod.kernels()
             if k["op"] == "bwd" and k["dtype"] == "float16" and any(fnmatch.fnmatchcase(k["name"], p) for p in pats)}
    spark = SparkBackend()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; fp16, {args.heads} heads, "
          f"{args.tokens} tokens; backward-only TFLOP/s, best of {args.rounds} round-robin rounds")
    for d, causal, n, b in sweep(args):
        names = sorted(x for x, k in infos.items() if k["head_dim"] == d)
        if not names:
            continue
        h = args.heads
        q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(4))
        scale = d ** -0.5
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                       scale=scale)[:2]
        lse = lse.float().contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        cands = {"cudnn": lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)}
        for name in names:
            def run(name=name, det=False):
                spark.backward(dout, q, k, v, out, lse, dq, dk, dv, config=name, causal=causal,
                               scale=scale, **({"deterministic": True} if det else {}))
            cands[name] = run
            if infos[name]["family"] == 90:
                cands["det:" + name] = lambda run=run: run(det=True)
                for mb in filter(None, args.l2_mb.split(",")):
                    def with_budget(run=run, mb=mb, det=False):
                        before = os.environ.get("SPARKTUNE_SM90_BWD_L2_MB")
                        os.environ["SPARKTUNE_SM90_BWD_L2_MB"] = mb
                        try:
                            run(det=det)
                        finally:  # the caller's own setting for the other candidates
                            if before is None:
                                os.environ.pop("SPARKTUNE_SM90_BWD_L2_MB", None)
                            else:
                                os.environ["SPARKTUNE_SM90_BWD_L2_MB"] = before
                    cands[f"l2={mb}:{name}"] = with_budget
                    cands[f"det:l2={mb}:{name}"] = lambda f=with_budget: f(det=True)
        flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        best = {c: math.inf for c in cands}
        # each round starts one candidate further on, so that every candidate is timed after
        # each of the others (what ran just before moved a kernel's time by a few percent)
        order = list(cands)
        for r in range(args.rounds):
            for c in order[r % len(order):] + order[:r % len(order)]:
                best[c] = min(best[c], seconds_per_call(cands[c]))
        base = flops / best["cudnn"] / 1e12
        cells = "  ".join(f"{c.replace('bwd_', '')}={flops / t / 1e12:.0f} ({flops / t / 1e12 / base:.2f}x)"
                          for c, t in best.items() if c != "cudnn")
        print(f"hd {d} causal {int(causal)} seqlen {n}: cudnn {base:.0f}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

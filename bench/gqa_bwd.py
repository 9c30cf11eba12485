"""Backward-only TFLOP/s of the Hopper backward on GQA problems, with each group split
(SPARKTUNE_SM90_BWD_GROUP_SPLIT: ``1`` none, ``rule`` the choice of the rule of
sparktune/kernels/sm90_bwd_split.py) as its own candidate, against PyTorch's backward
in the same run: SDPA's own choice (``sdpa``) and cuDNN forced (``cudnn``), each on a retained
graph of its own forward with ``enable_gqa``. The spark candidates take the forward's output and
log-sum-exp from PyTorch's flash kernel on K and V repeated to the query heads. Medians of
alternating rounds, every round queued behind a GPU sleep (bench/common.py, time_alternating).
FLOPs as FlashAttention counts them: 2.5x the forward's 4*B*Hq*N^2*D, halved when causal.

    python bench/gqa_bwd.py --heads 16 --heads-kv 4 --seqlens 2048,4096,8192 --splits 1,rule
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from common import time_alternating
from torch.nn.attention import SDPBackend, sdpa_kernel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--heads-kv", type=int, default=4)
    ap.add_argument("--seqlens", default="2048,4096,8192")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--causal", default="1", help="comma-separated 0/1")
    ap.add_argument("--splits", default="1,rule", help="comma-separated splits; 'rule': the rule's")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    from sparktune.backends.spark import SparkBackend, load_extension
    from sparktune.kernels.sm90_bwd_split import group_split

    mod, err = load_extension()
    if mod is None:
        print(err, file=sys.stderr)
        return 2
    names = {k["name"] for k in mod.kernels() if k["op"] == "bwd"}
    spark = SparkBackend()
    dtype = getattr(torch, args.dtype)
    tag = "f16" if dtype == torch.float16 else "bf16"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    b, hq, hk = args.batch, args.heads, args.heads_kv
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.dtype}, batch {b}, "
          f"{hq}:{hk} heads; backward-only TFLOP/s, median of {args.rounds} alternating rounds")
    for d in (int(x) for x in args.head_dims.split(",")):
        config = f"bwd_sm90_{tag}_d{d}_m64n128_s2" + ("_kr1" if d == 64 else "")
        if config not in names:
            print(f"# {config} is not compiled: head dim {d} left out")
            continue
        info = spark.kernel_info(config)
        for causal in (x.strip() == "1" for x in args.causal.split(",")):
            for n in (int(x) for x in args.seqlens.split(",")):
                q, dout = (torch.randn(b, hq, n, d, device="cuda", dtype=dtype) for _ in range(2))
                k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=dtype) for _ in range(2))
                scale = d ** -0.5
                rep = hq // hk
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), 0.0, causal,
                    False, scale=scale)[:2]
                lse = lse.float().contiguous()
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                fns = {}
                for label, backend in (("sdpa", None), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                    try:
                        if backend is None:
                            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                               enable_gqa=True)
                        else:
                            with sdpa_kernel(backend):
                                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                                   enable_gqa=True)
                        torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)
                    except RuntimeError as exc:
                        print(f"# {label}: {str(exc).splitlines()[0]}")
                        continue
                    fns[label] = (lambda o=o, ins=(qg, kg, vg):
                                  torch.autograd.grad(o, ins, dout, retain_graph=True))
                chosen = group_split(b, hk, hq // hk, n, n, info["block_m"], info["block_n"], d,
                                     q.element_size(), causal, None, sms,
                                     environ={"SPARKTUNE_SM90_BWD_GROUP_SPLIT": "rule"})
                for split_arg in args.splits.split(","):
                    split_name = split_arg.strip()

                    def run(split=split_name):
                        before = os.environ.get("SPARKTUNE_SM90_BWD_GROUP_SPLIT")
                        os.environ["SPARKTUNE_SM90_BWD_GROUP_SPLIT"] = split
                        try:
                            spark.backward(dout, q, k, v, out, lse, dq, dk, dv, config=config,
                                           causal=causal, scale=scale)
                        finally:
                            os.environ.pop("SPARKTUNE_SM90_BWD_GROUP_SPLIT", None)
                            if before is not None:
                                os.environ["SPARKTUNE_SM90_BWD_GROUP_SPLIT"] = before
                    fns[f"split={split_name}"] = run
                ms = time_alternating(fns, args.rounds, args.reps, lead_ms=2.0)
                flops = 2.5 * 4 * b * hq * n * n * d * (0.5 if causal else 1.0)
                ref = ms.get("cudnn", ms.get("sdpa"))
                cells = "  ".join(f"{c}={flops / t / 1e9:.0f} ({ref / t:.2f}x)" for c, t in ms.items())
                print(f"hd {d} causal {int(causal)} seqlen {n} (rule: split {chosen}): {cells}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

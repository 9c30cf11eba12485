"""Forward+backward TFLOP/s of the spark kernels (default configs) against PyTorch's flash and
cuDNN SDPA on the 16k-token sweep, measured in this run. FLOPs as FlashAttention counts them:
forward+backward = 3.5x the forward's 4*B*H*N^2*D (halved when causal).

    python bench/spark_bwd.py
    python bench/spark_bwd.py --seqlens 2048,8192 --head-dims 128 --causal 0
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from common import add_sweep_arguments, do_bench, sweep, tflops
from torch.nn.attention import SDPBackend, sdpa_kernel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    add_sweep_arguments(ap)
    ap.add_argument("--all-bwd", action="store_true",
                    help="also time every compiled backward config that supports the shape "
                         "(with the default forward) and print the best")
    args = ap.parse_args(argv)

    from sparktune.backends.spark import SparkBackend
    from sparktune.problem import DeviceInfo, Problem

    b = SparkBackend()
    dev = DeviceInfo.from_torch("cuda")
    print(f"# {dev.name} sm_{dev.arch}, torch {torch.__version__}; fp16, fwd+bwd TFLOP/s")
    print(f"{'hd':>3} {'causal':>6} {'seqlen':>6} | {'spark':>7} {'flash':>7} {'cudnn':>7} | {'x flash':>7} {'x cudnn':>7} | fwd / bwd config")
    ratios = []
    for d, causal, n, bs in sweep(args):
        pf = Problem("fwd", "float16", bs, args.heads, args.heads, n, n, d, causal)
        fwd_cfg = b.default_config(pf, dev)
        bwd_cfg = b.default_config(pf.replace(op="bwd"), dev)
        flops = 3.5 * pf.flops()
        q, k, v = (torch.randn(bs, args.heads, n, d, device="cuda", dtype=torch.float16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        scale = d ** -0.5
        out = torch.empty_like(q)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))

        def spark():
            lse = b.forward(q, k, v, out, config=fwd_cfg, causal=causal, scale=scale)
            b.backward(dout, q, k, v, out, lse, dq, dk, dv, config=bwd_cfg, causal=causal, scale=scale)

        res = {}
        res["spark"] = do_bench(spark) if fwd_cfg and bwd_cfg else math.nan
        for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def torch_fb():
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                torch.autograd.grad(o, (q, k, v), dout)
            try:
                res[label] = do_bench(torch_fb)
            except Exception:  # noqa: BLE001
                res[label] = math.nan
        if args.all_bwd:
            for cand in b.candidates(pf.replace(op="bwd"), dev):
                cfg = cand.config

                def spark_cfg(cfg=cfg):
                    lse = b.forward(q, k, v, out, config=fwd_cfg, causal=causal, scale=scale)
                    b.backward(dout, q, k, v, out, lse, dq, dk, dv, config=cfg, causal=causal, scale=scale)

                t = do_bench(spark_cfg)
                print(f"#   {d:>3} {int(causal)} {n:>6} {cfg:<45} {tflops(flops, t):7.1f} TFLOP/s "
                      f"x flash {res['flash'] / t:6.3f}", flush=True)
        tf = {key: tflops(flops, t) for key, t in res.items()}
        r = tf["spark"] / tf["flash"]
        ratios.append(r)
        print(f"{d:>3} {int(causal):>6} {n:>6} | {tf['spark']:7.1f} {tf['flash']:7.1f} {tf['cudnn']:7.1f} | "
              f"{r:7.3f} {tf['spark'] / tf['cudnn']:7.3f} | {fwd_cfg} / {bwd_cfg}", flush=True)
    ok = [r for r in ratios if r == r]
    if ok:
        print(f"# geometric mean x flash: {math.exp(sum(map(math.log, ok)) / len(ok)):.3f}; min {min(ok):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

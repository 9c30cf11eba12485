"""PyTorch's private SDPA ops called directly (what a dispatch hit runs for the torch backend)
against F.scaled_dot_product_attention forced to the same backend: GPU time per call, with the
tuner's timer (L2 flushed between runs), in alternating rounds.

    python bench/sdpa_direct.py [--shapes B,H,N,D,CAUSAL;...]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparktune
from sparktune.tune import CudaEventTimer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2,12,8192,128,1;2,12,8192,128,0;4,12,4096,128,1;16,12,1024,64,1")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    timer = CudaEventTimer(warmup_ms=10, rep_ms=50)
    print(f"{'shape':<24} {'backend':<9} {'SDPA forced ms':>15} {'direct op ms':>13} {'direct/SDPA':>12} "
          f"{'attention() hit ms':>19} {'hit/SDPA':>9}")
    for spec in args.shapes.split(";"):
        b, h, n, d, causal = (int(x) for x in spec.split(","))
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        scale = d**-0.5
        for name, member, op, call in (
            ("cudnn", SDPBackend.CUDNN_ATTENTION, torch._scaled_dot_product_cudnn_attention,
             lambda op: op(q, k, v, None, False, 0.0, bool(causal), False, scale=scale)[0]),
            ("flash", SDPBackend.FLASH_ATTENTION, torch._scaled_dot_product_flash_attention,
             lambda op: op(q, k, v, 0.0, bool(causal), False, scale=scale)[0]),
        ):
            with torch.no_grad():
                def forced():
                    with sdpa_kernel(member):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), scale=scale)

                def hit():
                    return sparktune.attention(q, k, v, causal=bool(causal), scale=scale, backend="torch", config=name)

                a, c, e = forced(), call(op), hit()
                same = torch.equal(a, c) and torch.equal(a, e)
                sd, dr, ht = [], [], []
                for _ in range(args.rounds):
                    sd.append(timer.measure(forced).median_ms)
                    dr.append(timer.measure(lambda: call(op)).median_ms)
                    ht.append(timer.measure(hit).median_ms)
            s, r, t = statistics.median(sd), statistics.median(dr), statistics.median(ht)
            print(f"{spec:<24} {name:<9} {s:>15.4f} {r:>13.4f} {r / s:>12.3f} {t:>19.4f} {t / s:>9.3f}  "
                  f"bitwise equal: {same}")


if __name__ == "__main__":
    main()

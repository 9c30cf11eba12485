"""One attention layer's call through the transformers integration against transformers' own
``sdpa`` function: host time to issue a call and GPU time per call (CUDA events), for the
forward under autograd and for forward+backward, on (B, H, N, D) views of (B, N, H, D) storage
as a Llama layer passes them (grouped K/V, causal, bf16).

A benchmark, not a test: each loop issues ``--calls`` calls and the clock stops before the
synchronisation, so "host" is what issuing a call costs and "gpu" the device time per call
(where the two are equal the loop is bound by the host). Both functions are measured in
alternating rounds; the median is shown, with the path the sparktune call took (the native
SDPA pair or sparktune's autograd function) and the garbage collections the loops triggered.

    python bench/integration_call.py
    python bench/integration_call.py --shapes 4,16,4,1024,128 4,32,8,1024,64 --rounds 9
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch

DEFAULT_SHAPES = ("4,16,4,1024,128", "4,32,8,1024,64", "4,16,4,2048,128", "1,16,4,128,128")


class _Layer(torch.nn.Module):
    """What transformers' attention functions read from the calling module."""

    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.layer_idx = 0
        self.num_key_value_groups = groups


def _loop(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(host µs, GPU µs) per call over ``calls`` calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    end.record()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6, start.elapsed_time(end) / calls * 1e3


def _path(out: torch.Tensor) -> str:
    from sparktune._autograd import graph_node_names

    names = graph_node_names(out)
    if any("_AttentionFunction" in n for n in names):
        return "sparktune autograd function"
    sdpa = sorted(n for n in names if "ScaledDotProduct" in n)
    return sdpa[0] if sdpa else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                    help="batch,heads_q,heads_kv,seqlen,head_dim (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=50, help="calls per timed loop")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/integration_call.py needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        print("bench/integration_call.py needs Hugging Face transformers", file=sys.stderr)
        return 2
    from sparktune.integrations.transformers import attention_forward

    collections = [0]

    def count(phase: str, _info: dict) -> None:
        collections[0] += phase == "start"

    gc.callbacks.append(count)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, causal; "
          f"{args.rounds} alternating rounds of {args.calls} calls (median)")
    print(f"{'shape (B, Hq, Hkv, N, D)':<26} {'impl':<10} | {'fwd host':>8} {'gpu':>7} | "
          f"{'fwd+bwd host':>12} {'gpu':>7} | {'gc':>3} | sparktune's path")
    for text in args.shapes:
        b, hq, hk, n, d = (int(x) for x in text.split(","))

        def view(h: int, n: int = n, b: int = b, d: int = d) -> torch.Tensor:
            t = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
            return t.transpose(1, 2).requires_grad_()

        q, k, v = view(hq), view(hk), view(hk)
        dout = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
        layer = _Layer(hq // hk)
        impls = {"sdpa": sdpa_attention_forward, "sparktune": attention_forward}
        cases: dict[tuple[str, str], Callable[[], object]] = {}
        for name, f in impls.items():

            def fwd(f=f) -> torch.Tensor:
                return f(layer, q, k, v, None, dropout=0.0, scaling=d**-0.5, is_causal=True)[0]

            def both(fwd=fwd) -> None:
                torch.autograd.grad(fwd(), (q, k, v), dout)

            cases[(name, "fwd")] = fwd
            cases[(name, "both")] = both
        path = _path(cases[("sparktune", "fwd")]())
        for fn in cases.values():  # warm-up: caches, the allocator, dispatch's hits
            for _ in range(10):
                fn()
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in cases}
        gcs = dict.fromkeys(impls, 0)
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(cases)[::-1]
            for key in order:
                before = collections[0]
                samples[key].append(_loop(cases[key], args.calls))
                gcs[key[0]] += collections[0] - before
        for name in impls:
            row = []
            for what in ("fwd", "both"):
                got = samples[(name, what)]
                row += [statistics.median(h for h, _ in got), statistics.median(g for _, g in got)]
            print(f"{str((b, hq, hk, n, d)):<26} {name:<10} | {row[0]:8.1f} {row[1]:7.1f} | "
                  f"{row[2]:12.1f} {row[3]:7.1f} | {gcs[name]:>3} | {path if name == 'sparktune' else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

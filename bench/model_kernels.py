"""The GPU kernels one step of a transformers model launches, attention on sparktune against
transformers' sdpa (same weights and inputs), from torch.profiler: each kernel's count and
total time per implementation, the differences first, and the whole step's GPU and host time.

    python bench/model_kernels.py --preset llama --mode prefill --seqlen 2048
    python bench/model_kernels.py --preset llama --mode train --seqlen 1024 --batch 4
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sparktune.benchmark.models import PRESETS, _build, _step_fn
from sparktune.integrations import transformers as hf  # noqa: F401 - registers "sparktune"


def kernels(step, steps: int) -> tuple[dict[str, list[float]], float]:
    """(kernel name -> [count, total µs]) and host ms per step, over ``steps`` profiled steps."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
        torch.cuda.synchronize()
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = table[e.name[:90]]
            row[0] += 1 / steps
            row[1] += e.device_time_total / steps
    return dict(table), host_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama", choices=sorted(PRESETS))
    ap.add_argument("--mode", default="prefill", choices=("train", "prefill"))
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    model = _build(PRESETS[args.preset], args.seqlen, torch.bfloat16, torch.device("cuda"))
    ids = torch.randint(3, PRESETS[args.preset].vocab, (args.batch, args.seqlen), device="cuda")
    step = _step_fn(model, args.mode, ids)
    found = {}
    for impl in ("sdpa", "sparktune", "sdpa", "sparktune"):
        model.set_attn_implementation(impl)
        found[impl] = kernels(step, args.steps)
    (a, a_host), (b, b_host) = found["sdpa"], found["sparktune"]
    print(f"{args.preset} {args.mode} {args.batch}x{args.seqlen}: GPU us/step sdpa {sum(r[1] for r in a.values()):.0f}, "
          f"sparktune {sum(r[1] for r in b.values()):.0f}; host ms/step {a_host:.2f} / {b_host:.2f}")
    names = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, [0, 0])[1] - a.get(n, [0, 0])[1]))
    print(f"{'kernel':<90} {'n sdpa':>7} {'n st':>7} {'us sdpa':>9} {'us st':>9}")
    for n in names[:25]:
        ra, rb = a.get(n, [0, 0.0]), b.get(n, [0, 0.0])
        print(f"{n:<90} {ra[0]:>7.1f} {rb[0]:>7.1f} {ra[1]:>9.1f} {rb[1]:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

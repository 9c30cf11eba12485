"""Where the host time of one model step goes: sparktune against transformers' ``sdpa``.

A diagnosis tool, not a benchmark with a target. For one preset of
``sparktune.benchmark.models`` (a transformers model built from config), mode and sequence
length, each implementation gets warm-up steps and then:

- the host time to issue one step (the clock stopped before the synchronisation) and the step
  time on the device (CUDA events), median of ``--steps``;
- the synchronisations a step makes (``aten::item``/``_local_scalar_dense``, stream and device
  synchronisations, device-to-host copies), counted by torch.profiler;
- the operators with the most host time (torch.profiler, CPU activity, self time);
- for sparktune, the Python functions with the most cumulative time (cProfile), restricted to
  sparktune's and transformers' files.

    python bench/model_profile.py --preset llama --mode train --seqlen 2048
    python bench/model_profile.py --device cpu --preset tiny --seqlen 32 --steps 2   # wiring
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from sparktune.benchmark import models as bm
from sparktune.dtypes import TORCH_DTYPES

SYNC_NAMES = (
    "aten::item",
    "aten::_local_scalar_dense",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "aten::nonzero",
)


def _timed(step, steps: int, cuda: bool) -> tuple[float, float]:
    """(median host ms to issue a step, median device ms of a step)."""
    host, dev = [], []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        if cuda:
            b.record()
            torch.cuda.synchronize()
            dev.append(a.elapsed_time(b))
        host.append((t1 - t0) * 1e3)
    return statistics.median(host), (statistics.median(dev) if dev else float("nan"))


def _profile(step, steps: int, cuda: bool, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    lines = [f"  synchronising calls over {steps} steps:"]
    for e in events:
        if e.key in SYNC_NAMES or "Memcpy" in e.key and "DtoH" in e.key:
            lines.append(f"    {e.key:<40} {e.count:>6} calls  {e.cpu_time_total / 1e3:9.2f} ms host")
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    return "\n".join(lines)


def _python_profile(step, steps: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    stats.print_stats(r"sparktune|transformers/(integrations|masking|modeling_utils)", top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama", choices=sorted(bm.PRESETS))
    ap.add_argument("--mode", default="train", choices=("train", "prefill"))
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(TORCH_DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)

    import sparktune.integrations.transformers as hf  # registers "sparktune"

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset = bm.PRESETS[args.preset]
    model = bm._build(preset, args.seqlen, TORCH_DTYPES[args.dtype], device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, preset.vocab, (args.batch, args.seqlen), generator=gen).to(device)
    step = bm._step_fn(model, args.mode, ids)
    print(f"{preset.name} ({preset.describe()}) {args.mode} seqlen {args.seqlen} batch {args.batch} "
          f"{args.dtype} on {torch.cuda.get_device_name() if cuda else 'cpu'}")
    for name in bm.IMPLEMENTATIONS:
        model.set_attn_implementation(name)
        for _ in range(3):
            step()
        if cuda:
            torch.cuda.synchronize()
    # alternating rounds of the step timing
    results: dict[str, list[tuple[float, float]]] = {n: [] for n in bm.IMPLEMENTATIONS}
    for r in range(3):
        for name in bm.IMPLEMENTATIONS if r % 2 == 0 else bm.IMPLEMENTATIONS[::-1]:
            model.set_attn_implementation(name)
            results[name].append(_timed(step, args.steps, cuda))
    for name, rows in results.items():
        host = statistics.median(h for h, _ in rows)
        dev = statistics.median(d for _, d in rows)
        print(f"{name:<10} host {host:8.2f} ms to issue a step, device {dev:8.2f} ms per step")
    for name in bm.IMPLEMENTATIONS:
        model.set_attn_implementation(name)
        print(f"\n== {name}: torch.profiler")
        print(_profile(step, min(args.steps, 3), cuda, args.top))
    model.set_attn_implementation("sparktune")
    print("\n== sparktune: cProfile (cumulative, sparktune and transformers' attention files)")
    print(_python_profile(step, min(args.steps, 3), args.top))
    print("integration counters:", hf.counters())
    return 0


if __name__ == "__main__":
    sys.exit(main())

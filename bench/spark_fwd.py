"""Forward TFLOP/s of the spark kernels against PyTorch's flash and cuDNN SDPA on the
long-sequence sweep (16k tokens: seqlen 512..16384 at batch 16384/seqlen, 12 heads, fp16),
all measured in this run. A benchmark, not a test: it prints numbers.

    python bench/spark_fwd.py                      # default config per shape
    python bench/spark_fwd.py --configs all        # every compiled config, best per shape
    python bench/spark_fwd.py --seqlens 1024,8192 --head-dims 128 --causal 0
    python bench/spark_fwd.py --configs all --each --rounds 3   # every config's own row
    python bench/spark_fwd.py --configs NAMES --each --schedules static,dynamic

``--each`` prints every config's TFLOP/s and its ratio to cuDNN, cuDNN and the configs timed
in ``--rounds`` alternating rounds (the best round of each). ``--schedules`` (with ``--each``)
times the persistent sm90 kernels (``_ps1``) under each tile schedule in the same rounds, a row
per config and schedule (``name@static``, ``name@dynamic``; SPARKTUNE_SM90_DYNAMIC otherwise).
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
    ap.add_argument("--each", action="store_true", help="a row per config, alternating rounds")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of --each")
    ap.add_argument("--schedules", default="",
                    help="with --each: static,dynamic (or one): the _ps1 kernels' tile schedules, "
                         "each timed in the same rounds")
    args = ap.parse_args(argv)
    args.schedules = [x.strip() for x in args.schedules.split(",") if x.strip()]
    if any(x not in ("static", "dynamic") for x in args.schedules) or (args.schedules and not args.each):
        ap.error("--schedules takes static and/or dynamic, with --each")

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
        if args.each:
            _each(args, b, p, flops, names, q, k, v, out, causal, d, n, bs, rows)
            continue
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
    if rows and not args.each:
        gm = math.exp(sum(math.log(r[3]) for r in rows) / len(rows))
        print(f"# geometric mean x flash: {gm:.3f}; min x flash: {min(r[3] for r in rows):.3f}")
    if rows and args.each:
        best = {}
        for d, causal, n, _name, ratio in rows:
            best[(d, causal, n)] = max(best.get((d, causal, n), 0.0), ratio)
        gm = math.exp(sum(math.log(r) for r in best.values()) / len(best))
        print(f"# best config per shape x cudnn: geometric mean {gm:.3f}, min {min(best.values()):.3f}")
    return 0


def _each(args, b, p, flops, names, q, k, v, out, causal, d, n, bs, rows) -> None:
    """cuDNN and every config, timed in alternating rounds; one row per config (and per tile
    schedule of a persistent sm90 kernel with --schedules)."""
    from sparktune.backends import spark
    from sparktune.kernels.kernel_space import is_persistent_sm90_fwd

    def call(nm, dynamic=None):
        def run():
            if dynamic is not None:  # read by the backend at each call
                spark.SM90_DYNAMIC = dynamic
            b.forward(q, k, v, out, config=nm, causal=causal, scale=d ** -0.5)
        return run

    schedules = args.schedules  # parsed and checked by main
    calls = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    for name in names:
        if name is None:
            continue
        if schedules and is_persistent_sm90_fwd(name):
            for sched in schedules:
                calls[f"{name}@{sched}"] = call(name, sched == "dynamic")
        else:
            calls[name] = call(name)
    best = {label: math.inf for label in calls}
    for _ in range(args.rounds):
        for label, fn in list(calls.items()):
            try:
                if label == "cudnn":
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        t = do_bench(fn)
                else:
                    t = do_bench(fn)
            except Exception as exc:  # noqa: BLE001
                print(f"  {label}: failed: {exc}", file=sys.stderr)
                del calls[label]
                continue
            best[label] = min(best[label], t)
    cu = tflops(flops, best["cudnn"])
    for name in calls:
        if name == "cudnn":
            continue
        s = tflops(flops, best[name])
        rows.append((d, causal, n, name, s / cu))
        print(f"{d:>3} {int(causal):>6} {n:>6} {bs:>5} | {s:7.1f} {'':>7} {cu:7.1f} | {'':>7} {s / cu:7.3f} | {name}",
              flush=True)
    for name in calls:  # both schedules timed: the dynamic one's speed-up
        if name.endswith("@dynamic") and name.replace("@dynamic", "@static") in calls:
            gain = best[name.replace("@dynamic", "@static")] / best[name]
            print(f"# {d} {int(causal)} {n}: {name.removesuffix('@dynamic')} dynamic/static "
                  f"{gain:.3f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

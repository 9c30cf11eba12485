"""Host time of one ``sparktune.attention()`` call against calling PyTorch's SDPA directly.

A benchmark, not a test: it prints microseconds per call. The problem is tiny, so that the
GPU is never the bottleneck: each timed loop issues ``--calls`` calls (few enough that the
launch queue never fills) and synchronises only after the clock has stopped. Cases are
measured in interleaved rounds (drift on a busy machine hits them all alike); the median and
the best round are shown.

    python bench/host_overhead.py                   # on the GPU when there is one, else CPU
    python bench/host_overhead.py --device cpu      # sparktune's Python alone, on the CPU
    python bench/host_overhead.py --db PATH_OR_URL  # also: the winner that store dispatches to
    python bench/host_overhead.py --json out.json

On a GPU: plain SDPA, SDPA under ``sdpa_kernel(FLASH)``, ``attention()`` forced to torch:flash,
``attention()`` on a tuned hit whose winner is torch:flash (a temporary store holds that one
record), ``dispatch.select()`` alone, the torch backend's ``forward``/``forward_alloc``
directly, every other tunable backend's ``forward`` with its default config, and (``--db``)
the winner of that store. The target: a hit at most 5 us above calling plain SDPA
(``F.scaled_dot_product_attention`` with its own choice of kernel).
On the CPU: the same with torch's "math" backend, plus a backend whose forward does nothing,
reached forced and through a tuned hit on a stand-in device, so that what is left is
sparktune's own Python.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import sparktune
from sparktune import dispatch, registry
from sparktune.backends.base import Backend
from sparktune.problem import DeviceInfo, Problem

TARGET_US = 5.0


class NoopBackend(Backend):
    """Runs nothing: a call through it costs only sparktune's own Python."""

    name = "hostoverhead-noop"
    tunable = False

    def configs(self, op: str = "fwd"):
        return ("default",)

    def not_supported_reasons(self, problem, config=None, device=None):
        return [] if config in (None, "default") else [f"unknown config {config!r}"]

    def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True):
        return None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def measure(
    cases: dict[str, Callable[[], object]], device: str, calls: int, rounds: int, clock: str
) -> dict[str, dict[str, float]]:
    """Microseconds per call of each case: median and best of ``rounds`` interleaved rounds of
    ``calls`` calls, the clock stopped before the synchronisation."""
    now = CLOCKS[clock]
    for fn in cases.values():  # warm-up: caches, lazy imports, the allocator
        for _ in range(10):
            fn()
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            sync(device)
            t0 = now()
            for _ in range(calls):
                fn()
            t1 = now()
            sync(device)
            samples[name].append((t1 - t0) / calls / 1e3)
    return {n: {"median_us": statistics.median(s), "best_us": min(s)} for n, s in samples.items()}


def tuned_store(
    path: Path, problem: Problem, device: DeviceInfo, backend: str, config: str
) -> None:
    """A store holding one record: ``backend:config`` measured for ``problem`` on ``device``."""
    from sparktune.db import Record, Store

    with Store(path) as s:
        s.add(
            [
                Record(
                    problem,
                    device,
                    dispatch.build_id(),
                    backend,
                    config,
                    median_ms=1.0,
                    min_ms=1.0,
                    max_ms=1.0,
                    runs=1,
                )
            ]
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument(
        "--shape", default=None, help="batch,heads,seqlen,head_dim (1,4,128,64; CPU: 1,1,16,16)"
    )
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default=None,
        help="wall time (default on a GPU) or this thread's CPU time (default on the CPU: "
        "robust to a busy machine)",
    )
    ap.add_argument("--db", default=None, help="also measure the winner this store dispatches to")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    clock = args.clock or ("wall" if device == "cuda" else "cpu")
    if device == "cpu":
        torch.set_num_threads(1)  # the math backend's thread pool adds only noise here
    shape = args.shape or ("1,4,128,64" if device == "cuda" else "1,1,16,16")
    b, h, n, d = (int(x) for x in shape.split(","))
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(3))
    out = torch.empty_like(q)
    scale = d**-0.5
    problem = Problem("fwd", args.dtype, b, h, h, n, n, d, False)
    plan_mod = importlib.import_module("sparktune._plan")

    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_config = "flash" if device == "cuda" else "math"
    sdpa_member = SDPBackend.FLASH_ATTENTION if device == "cuda" else SDPBackend.MATH

    def sdpa_forced():
        with sdpa_kernel(sdpa_member):
            return F.scaled_dot_product_attention(q, k, v)

    torch_backend = registry.get_backend("torch")
    noop = NoopBackend()
    registry.register_backend(noop, replace=True)
    work = Path(tempfile.mkdtemp(prefix="sparktune-host-overhead-"))
    cases: dict[str, Callable[[], object]] = {
        "F.scaled_dot_product_attention (default choice)": lambda: F.scaled_dot_product_attention(
            q, k, v
        ),
        f"  under sdpa_kernel({sdpa_member.name})": sdpa_forced,
        f"torch backend forward(config={sdpa_config!r})": lambda: torch_backend.forward(
            q, k, v, out, config=sdpa_config, causal=False, scale=scale, need_lse=False
        ),
    }
    if hasattr(torch_backend, "forward_alloc"):
        cases[f"torch backend forward_alloc(config={sdpa_config!r})"] = lambda: (
            torch_backend.forward_alloc(
                q, k, v, config=sdpa_config, causal=False, scale=scale, need_lse=False
            )
        )
    cases[f"attention(), forced torch:{sdpa_config}"] = lambda: sparktune.attention(
        q, k, v, backend="torch", config=sdpa_config
    )
    cases["noop backend forward() directly"] = lambda: noop.forward(
        q, k, v, out, config="default", causal=False, scale=scale, need_lse=False
    )
    cases["attention(), forced noop backend"] = lambda: sparktune.attention(
        q, k, v, backend=noop.name
    )

    saved_device_info = plan_mod.device_info
    try:
        if device == "cuda":
            dev = DeviceInfo.from_torch(q.device)
            hit_label = "torch:flash"
            tuned_store(work / "hit.sqlite3", problem, dev, "torch", "flash")
        else:
            # a tuned hit needs a GPU fingerprint: a stand-in for the CPU tensors
            dev = DeviceInfo("host-overhead stand-in", (9, 0), 1)
            plan_mod.device_info = lambda _device: dev
            hit_label = f"{noop.name}:default"
            tuned_store(work / "hit.sqlite3", problem, dev, noop.name, "default")
        dispatch.configure(work / "hit.sqlite3")
        sel = dispatch.select(problem, dev)
        if (sel.source, sel.candidate.label) != ("tuned", hit_label):
            print(f"expected a tuned hit on {hit_label}, got {sel}", file=sys.stderr)
            return 1
        cases["dispatch.select() on a hit"] = lambda: dispatch.select(problem, dev)
        cases[f"attention(), tuned hit -> {hit_label}"] = lambda: sparktune.attention(q, k, v)
        with torch.no_grad():
            results = measure(cases, device, args.calls, args.rounds, clock)
        # inference without torch.no_grad(): grad mode on, inputs that need no gradient
        grad_mode = {
            "grad mode on: plain SDPA": lambda: F.scaled_dot_product_attention(q, k, v),
            f"grad mode on: attention(), tuned hit -> {hit_label}": lambda: sparktune.attention(
                q, k, v
            ),
        }
        results.update(measure(grad_mode, device, args.calls, args.rounds, clock))
        counters = dispatch.counters()

        extra: dict[str, Callable[[], object]] = {}
        if device == "cuda":
            for name, backend in registry.backends().items():
                if name in ("torch", noop.name) or not backend.tunable:
                    continue
                if backend.unavailable_reasons() or backend.not_supported_reasons(
                    problem, None, dev
                ):
                    continue
                cfg = backend.default_config(problem, dev)
                if cfg is not None:
                    extra[f"{name} backend forward({cfg}) directly"[:60]] = (
                        lambda be=backend, c=cfg: be.forward(
                            q, k, v, out, config=c, causal=False, scale=scale, need_lse=False
                        )
                    )
                    extra[f"  attention(), forced {name}:{cfg}"[:60]] = (
                        lambda n=name, c=cfg: sparktune.attention(q, k, v, backend=n, config=c)
                    )
            if args.db:
                dispatch.configure(args.db)
                w = dispatch.select(problem, dev)
                extra[f"attention(), --db {w.source} -> {w.candidate.label}"[:60]] = lambda: (
                    sparktune.attention(q, k, v)
                )
                wb = registry.get_backend(w.candidate.backend)
                extra["  its backend's forward() directly"] = lambda: wb.forward(
                    q,
                    k,
                    v,
                    out,
                    config=w.candidate.config,
                    causal=False,
                    scale=scale,
                    need_lse=False,
                )
        if extra:
            with torch.no_grad():
                results.update(measure(extra, device, args.calls, args.rounds, clock))
    finally:
        plan_mod.device_info = saved_device_info
        dispatch.configure(None)
        registry.unregister_backend(noop.name)

    what = torch.cuda.get_device_name(q.device) if device == "cuda" else "CPU (1 thread)"
    print(
        f"# host time per call ({clock} clock), {what}, torch {torch.__version__}, {args.dtype} "
        f"{(b, h, n, d)}, {args.calls} calls x {args.rounds} rounds"
    )
    print(f"{'case':<68} {'median us':>10} {'best us':>9}")
    for name, r in results.items():
        print(f"{name:<68} {r['median_us']:>10.2f} {r['best_us']:>9.2f}")

    def us(name: str) -> float:
        return results[name]["median_us"]

    base = us("F.scaled_dot_product_attention (default choice)")
    forced = us(f"  under sdpa_kernel({sdpa_member.name})")
    hit = us(f"attention(), tuned hit -> {hit_label}")
    forced_call = us(f"attention(), forced torch:{sdpa_config}")
    direct = us(f"torch backend forward(config={sdpa_config!r})")
    noop_direct = us("noop backend forward() directly")
    summary = {
        "forced torch minus SDPA under sdpa_kernel": forced_call - forced,
        "forced torch minus plain SDPA": forced_call - base,
        "forced torch minus the torch backend's forward": forced_call - direct,
        "noop: attention() forced minus forward()": us("attention(), forced noop backend")
        - noop_direct,
        "select() on a hit": us("dispatch.select() on a hit"),
    }
    if device == "cuda":
        summary["hit minus SDPA under sdpa_kernel(FLASH)"] = hit - forced
        summary["hit minus plain SDPA"] = hit - base
    else:
        summary["noop: attention() tuned hit minus forward()"] = hit - noop_direct
    print()
    for name, value in summary.items():
        print(f"{name:<68} {value:>10.2f}")
    met = None
    if device == "cuda":
        met = summary["hit minus plain SDPA"] <= TARGET_US
        print(
            f"target (a hit at most {TARGET_US:g} us above calling plain SDPA): "
            f"{'met' if met else 'MISSED'}"
        )
    print("dispatch counters:", counters)
    if hasattr(torch_backend, "forward_alloc"):
        with torch.no_grad():
            o, _ = torch_backend.forward_alloc(
                q, k, v, config=sdpa_config, causal=False, scale=scale, need_lse=False
            )
        print(
            f"torch {sdpa_config} output contiguous for (B, H, N, D) inputs: {o.is_contiguous()} "
            f"({'returned as it is' if o.is_contiguous() else 'attention() copies it once'})"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": what,
                    "torch": torch.__version__,
                    "shape": [b, h, n, d],
                    "dtype": args.dtype,
                    "calls": args.calls,
                    "rounds": args.rounds,
                    "clock": clock,
                    "results": results,
                    "summary": summary,
                    "target_met": met,
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if met in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())

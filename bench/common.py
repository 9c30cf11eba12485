"""What the kernel-family sweeps in bench/ share: the sweep's arguments, with the defaults of
``sparktune bench`` (FlashAttention-2's long-sequence benchmark: 16k tokens, batch = 16384 /
seqlen, seqlen 512 to 16384, 12 heads, head dim 64 and 128, causal and not), and the timing
(``triton.testing.do_bench``, the median of 100 ms of runs after 25 ms of warm-up).

A script in bench/ imports it as ``common`` (Python puts the script's directory on the path).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

from sparktune.benchmark import DEFAULT_HEAD_DIMS, DEFAULT_HEADS, DEFAULT_SEQLENS, DEFAULT_TOKENS


def add_sweep_arguments(ap: argparse.ArgumentParser) -> None:
    """--seqlens, --head-dims, --causal (0, 1, 0,1 or both), --heads, --tokens."""
    ap.add_argument("--seqlens", default=",".join(map(str, DEFAULT_SEQLENS)))
    ap.add_argument("--head-dims", default=",".join(map(str, DEFAULT_HEAD_DIMS)))
    ap.add_argument("--causal", default="0,1", help="0, 1, 0,1 or both (default: both)")
    ap.add_argument("--heads", type=int, default=DEFAULT_HEADS)
    ap.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                    help="tokens per batch: batch = max(1, tokens // seqlen)")


def causal_values(text: str) -> list[bool]:
    if text.strip() == "both":
        return [False, True]
    return [bool(int(x)) for x in text.split(",")]


def sweep(args: argparse.Namespace) -> Iterator[tuple[int, bool, int, int]]:
    """(head_dim, causal, seqlen, batch) of each shape, head dim outermost, seqlen innermost."""
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in causal_values(args.causal):
            for n in (int(x) for x in args.seqlens.split(",")):
                yield d, causal, n, max(1, args.tokens // n)


def do_bench(fn: Callable[[], object], grad_to_none: list | None = None) -> float:
    """Milliseconds per call of ``fn``: the median of Triton's do_bench."""
    from triton.testing import do_bench as triton_do_bench

    return triton_do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def seconds_per_call(fn: Callable[[], object], calls: int = 5) -> float:
    """Seconds per call of ``fn``: one warm-up call, then ``calls`` calls between two CUDA
    events (for the round-robin comparisons, which take the best of several rounds)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls / 1e3


def time_alternating(fns: dict[str, Callable[[], object]], rounds: int, reps: int,
                     lead_ms: float = 0.0) -> dict[str, float]:
    """Median milliseconds per call of each fn, measured in alternating rounds of ``reps``
    calls between two CUDA events (every fn called once first).

    With ``lead_ms`` > 0 the GPU first sleeps that long in each round, before the start event,
    while the host queues the round's calls behind the sleep: the events then time the GPU's
    work, and a call's host time counts only where the host cannot keep ahead of the GPU
    (without it, the first call's host time of every round is inside the timed interval)."""
    import statistics

    import torch

    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    sleep_cycles = int(lead_ms * gpu_cycles_per_ms()) if lead_ms > 0 else 0
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return {name: statistics.median(ts) for name, ts in times.items()}


_CYCLES_PER_MS: float | None = None


def gpu_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on the current GPU, measured once
    (a 10-million-cycle sleep between two events)."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        import torch

        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS = cycles / start.elapsed_time(end)
    return _CYCLES_PER_MS

"""The Python host cost of one eager ``sparktune.attention_with_kvcache`` call on the Triton
path, with the kernel launches stubbed out: what sparktune itself does per call (checks, the
choice, argument lists, allocations), without Triton's own launch cost or the GPU.

Runs on the CPU: ``TRITON_INTERPRET=1`` is set before anything is imported, so that the Triton
decode path is chosen for CPU tensors, and the three kernels are replaced by stubs that only
count their launches (nothing is interpreted). ``--source DIR`` imports sparktune from ``DIR``
instead of the installed one (e.g. an older checkout exported with ``git archive``), so that
two versions are measured by the same script::

    python bench/decode_host_overhead.py
    mkdir /tmp/before && git archive main sparktune | tar -x -C /tmp/before
    python bench/decode_host_overhead.py --source /tmp/before

Prints, per case, the median time per call (of ``--repeats`` runs of ``--calls`` calls) and the
Python function calls one call makes (counted with ``sys.setprofile``). The numbers are the
host's; on the GPU host add Triton's launch cost (about 2 x 20-100 us, docs/DECODING.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"


def _import_sparktune(source: str | None):
    if source:
        # the installed (editable) package's finder would win over sys.path: drop it
        sys.meta_path[:] = [f for f in sys.meta_path if "sparktune" not in type(f).__module__]
        sys.path.insert(0, os.path.abspath(source))
    import sparktune
    from sparktune.kernels import triton_decode

    return sparktune, triton_decode


class _Stub:
    """A Triton kernel stand-in: ``stub[grid](*args, **kw)`` counts and returns."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        self.launches += 1


def _cases(torch):
    def tensors(batch, cache, paged, ps=256, hq=32, hkv=8, d=128):
        dt = torch.bfloat16
        q = torch.randn(batch, 1, hq, d, dtype=dt)
        if paged:
            blocks = cache // ps
            kc = torch.zeros(batch * blocks, ps, hkv, d, dtype=dt)
            table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
        else:
            kc = torch.zeros(batch, cache, hkv, d, dtype=dt)
            table = None
        vc = torch.zeros_like(kc)
        lens = torch.full((batch,), cache - 1, dtype=torch.int32)
        # check_bounds=False: what a call on CUDA tensors does by default on the Triton path (no
        # host read of the device's values); on CPU tensors the default would read them
        return (q, kc, vc), {"cache_seqlens": lens, "block_table": table, "check_bounds": False}

    yield "b8 c8k contiguous", *tensors(8, 8192, False)
    yield "b8 c8k paged256", *tensors(8, 8192, True)
    args, kw = tensors(1, 4096, False)
    yield "b1 c4k int lengths", args, {**kw, "cache_seqlens": 4000}
    args, kw = tensors(8, 8192, False)
    kn = torch.randn(8, 1, 8, 128, dtype=torch.bfloat16)
    yield "b8 c8k append 1", (*args, kn, kn.clone()), {**kw, "cache_seqlens": kw["cache_seqlens"] - 1}


def _python_calls(fn) -> int:
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="import sparktune from this directory")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    sparktune, triton_decode = _import_sparktune(args.source)
    import torch

    stubs = {name: _Stub() for name in ("_append_kernel", "_decode_kernel", "_combine_kernel")}
    for name, stub in stubs.items():
        setattr(triton_decode, name, stub)
    call = sparktune.attention_with_kvcache
    print(f"sparktune from {os.path.dirname(sparktune.__file__)}; torch {torch.__version__}")
    print(f"{'case':<22} {'us/call':>8} {'py calls':>9} {'launches':>9}")
    with torch.no_grad():
        for name, targs, kw in _cases(torch):
            call(*targs, **kw)  # the first call: checks, choice, plan
            before = sum(s.launches for s in stubs.values())
            call(*targs, **kw)
            launches = sum(s.launches for s in stubs.values()) - before
            per = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call(*targs, **kw)
                per.append((time.perf_counter() - t0) / args.calls * 1e6)
            calls = _python_calls(lambda targs=targs, kw=kw: call(*targs, **kw))
            print(f"{name:<22} {statistics.median(per):>8.1f} {calls:>9d} {launches:>9d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

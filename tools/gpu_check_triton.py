#!/usr/bin/env python
"""Check every config of the Triton attention family on a GPU against a float64 reference.

    PYTHONPATH=. python tools/gpu_check_triton.py            # everything, about 2-4 minutes
    PYTHONPATH=. python tools/gpu_check_triton.py --configs 'm128n64' --quiet

For each config of the declared space (forward and backward) and each kernel variant
(dtype x head dim x causal, four combinations so that every dtype, head dim and mask kind
appears), odd shapes: seqlen 1, 17, 1000, 1537, 4097, seqlen_q != seqlen_k both ways (with
rows that see no key), GQA and MQA, (B, N, H, D) strided views. Head dims 32, 96 (padded to
128) and 256 are checked too, with their default configs only. The rule is FlashAttention's:
the kernel's max abs error against float64 is at most twice PyTorch's own error in the same
precision (the larger of math SDPA and plain matmul-softmax-matmul, both in fp16/bf16 on the
same inputs), plus 1e-5. Also checked exactly: rows that see no key have lse -inf, output 0 and
dq 0. The backward is given the reference's output and log-sum-exp, so forward and backward are
checked independently.

Kernels are compiled first, in parallel worker processes (``--processes``), into Triton's
on-disk cache.

``--offline 90,80`` needs no GPU: it compiles every config for those architectures with
Triton's compiler and checks the support rules against what the compiler allocates (a config
the rules accept must fit the architecture's shared memory; one they reject is reported as a
note when it would have fit), and reports registers and spills. Every check is isolated (an exception fails that check only). One line per
check, then the failures again, then ``N passed, M failed``; the exit status is 1 when anything
failed, 3 when the time budget stopped the run early, 0 otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from sparktune.backends.reference import causal_visible
from sparktune.backends.triton import TritonBackend, warmup_jobs
from sparktune.kernels.triton_space import (
    BWD_SPACE,
    FWD_SPACE,
    config_reasons,
    parse_config,
    smem_limit,
)
from sparktune.problem import DeviceInfo, Problem

#: (dtype, head_dim, causal): each dtype, head dim and mask kind appears, in four compiles
VARIANTS = (
    ("float16", 64, False),
    ("float16", 128, True),
    ("bfloat16", 64, True),
    ("bfloat16", 128, False),
)
#: (batch, heads_q, heads_kv, seqlen_q, seqlen_k, layout)
SHAPES = (
    (2, 4, 4, 1, 1, "bhnd"),
    (2, 6, 2, 17, 17, "bnhd"),  # GQA, strided view
    (1, 4, 1, 1000, 1000, "bhnd"),  # MQA
    (1, 2, 2, 4097, 4097, "bnhd"),
    (2, 4, 2, 1000, 1537, "bhnd"),  # more keys than queries
    (1, 4, 4, 1537, 1000, "bnhd"),  # more queries: causal rows 0..536 see no key
    (1, 2, 1, 17, 4097, "bhnd"),  # a few queries over a long context
)
#: other head dims (padded ones among them), checked with their default configs only
EXTRA_VARIANTS = (
    ("float16", 96, False),
    ("bfloat16", 96, True),
    ("bfloat16", 32, False),
    ("float16", 256, True),
    ("bfloat16", 256, False),
)
EXTRA_SHAPES = (
    (2, 6, 2, 17, 17, "bnhd"),
    (1, 4, 4, 1537, 1000, "bnhd"),
    (1, 2, 1, 1000, 1000, "bhnd"),
)
FLOOR = 1e-5
FACTOR = 2.0


# ------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------


def _visible(nq: int, nk: int, device) -> torch.Tensor:
    return causal_visible(nq, nk, device)


def _attention(q, k, v, causal: bool, scale: float, kind: str):
    """Attention in q's dtype: kind "exact" (float64 math), "plain" (matmul, softmax, matmul)
    or "sdpa" (torch's math SDPA). Returns (out, lse float32/64). Rows that see no key: 0, -inf."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    nq, nk = q.shape[2], k.shape[2]
    mask = _visible(nq, nk, q.device) if causal else None
    empty = None
    if mask is not None and nq > nk:
        empty = ~mask.any(-1)
        mask = mask | empty[:, None]  # opened here, zeroed below: no NaN anywhere
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s.detach() if kind == "exact" else s.detach().float(), -1)
    if kind == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        out = torch.softmax(s, -1) @ v
    if empty is not None:
        out = out.masked_fill(empty[:, None], 0.0)
        lse = lse.masked_fill(empty, -math.inf)
    return out, lse


def _grads(q, k, v, dout, causal, scale, kind):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out, lse = _attention(*leaves, causal, scale, kind)
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out.detach(), lse, grads


def _max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - ref.double()).abs().max())


class Case:
    """Inputs of one (variant, shape), the float64 reference and PyTorch's own errors."""

    def __init__(self, dtype: str, d: int, causal: bool, shape, device, seed: int):
        b, hq, hkv, nq, nk, layout = shape
        self.dtype, self.d, self.causal, self.shape = dtype, d, causal, shape
        self.scale = 1.0 / math.sqrt(d)
        tdtype = getattr(torch, dtype)
        gen = torch.Generator(device=device).manual_seed(seed)

        def make(h, n):
            if layout == "bnhd":
                t = torch.randn(b, n, h, d, generator=gen, device=device, dtype=tdtype)
                return t.transpose(1, 2)
            return torch.randn(b, h, n, d, generator=gen, device=device, dtype=tdtype)

        self.q, self.k, self.v = make(hq, nq), make(hkv, nk), make(hkv, nk)
        self.dout = make(hq, nq)
        out64, lse64, g64 = _grads(self.q.double(), self.k.double(), self.v.double(),
                                   self.dout.double(), causal, self.scale, "exact")
        self.ref = {"out": out64, "lse": lse64, "dq": g64[0], "dk": g64[1], "dv": g64[2]}
        base = {name: 0.0 for name in self.ref}
        for kind in ("plain", "sdpa"):
            out, lse, g = _grads(self.q, self.k, self.v, self.dout, causal, self.scale, kind)
            for name, t in (("out", out), ("dq", g[0]), ("dk", g[1]), ("dv", g[2])):
                base[name] = max(base[name], _max_err(t, self.ref[name]))
            if kind == "plain":
                keep = ~torch.isneginf(lse64)
                base["lse"] = _max_err(lse[keep], lse64[keep])
        self.baseline = base
        self.no_key = torch.isneginf(lse64)
        # what the backward is given: the reference forward, rounded as a kernel would store it
        self.out_lowp = out64.to(tdtype)
        self.lse32 = lse64.float()

    def problem(self, op: str) -> Problem:
        b, hq, hkv, nq, nk, _ = self.shape
        return Problem(op, self.dtype, b, hq, hkv, nq, nk, self.d, self.causal)

    @property
    def label(self) -> str:
        b, hq, hkv, nq, nk, layout = self.shape
        dt = "f16" if self.dtype == "float16" else "bf16"
        mask = "causal" if self.causal else "full"
        return f"{dt} d{self.d} {mask:6s} b{b} h{hq}/{hkv} q{nq} k{nk} {layout}"

    def compare(self, name: str, got: torch.Tensor) -> tuple[bool, str]:
        ref = self.ref[name]
        if name == "lse":
            if not torch.equal(torch.isneginf(got), self.no_key):
                return False, "lse: rows with -inf differ from the reference"
            keep = ~self.no_key
            err = _max_err(got[keep], ref[keep])
        else:
            err = _max_err(got, ref)
        bound = FACTOR * self.baseline[name] + FLOOR
        ok = math.isfinite(err) and err <= bound
        return ok, f"{name} {err:.2e}<={bound:.2e}" if ok else f"{name} {err:.2e}>{bound:.2e} !!"


def _poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).fill_(math.nan)


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def check_forward(backend: TritonBackend, case: Case, config: str) -> tuple[bool, str]:
    out = _poisoned_like(case.q)
    lse = backend.forward(case.q, case.k, case.v, out, config=config, causal=case.causal,
                          scale=case.scale)
    _sync(out)
    results = [case.compare("out", out), case.compare("lse", lse)]
    if case.no_key.any() and not bool((out[case.no_key] == 0).all()):
        results.append((False, "rows that see no key are not 0"))
    return all(ok for ok, _ in results), "  ".join(text for _, text in results)


def check_backward(backend: TritonBackend, case: Case, config: str) -> tuple[bool, str]:
    dq, dk, dv = (_poisoned_like(t) for t in (case.q, case.k, case.v))
    backend.backward(case.dout, case.q, case.k, case.v, case.out_lowp, case.lse32, dq, dk, dv,
                     config=config, causal=case.causal, scale=case.scale)
    _sync(dq)
    results = [case.compare("dq", dq), case.compare("dk", dk), case.compare("dv", dv)]
    if case.no_key.any() and not bool((dq[case.no_key] == 0).all()):
        results.append((False, "dq of rows that see no key is not 0"))
    return all(ok for ok, _ in results), "  ".join(text for _, text in results)


# ------------------------------------------------------------------------------------------
# offline: compile for a GPU that is not there, check the support rules
# ------------------------------------------------------------------------------------------


def _offline_one(problem: Problem, name: str, arch: int):
    from sparktune.kernels.triton_attn import compile_offline

    try:
        return compile_offline(problem, name, arch), None
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def offline(archs: list[int], configs: dict[str, list[str]], variants, processes: int,
            quiet: bool) -> int:
    import concurrent.futures
    import multiprocessing

    jobs = []
    for arch in archs:
        device = DeviceInfo(f"sm_{arch}", (arch // 10, arch % 10), 0)
        for dtype, d, causal in variants:
            for op, names in configs.items():
                for name in names:
                    probe = Problem(op, dtype, 1, 4, 2, 256, 256, d, causal)
                    jobs.append((arch, device, probe, name))
    print(f"offline: compiling {len(jobs)} (arch, variant, config) jobs with {processes} processes")
    passed, failed, notes = 0, [], []
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max(1, processes), mp_context=ctx) as pool:
        futures = {pool.submit(_offline_one, probe, name, arch): (arch, device, probe, name)
                   for arch, device, probe, name in jobs}
        for fut in concurrent.futures.as_completed(futures):
            arch, device, probe, name = futures[fut]
            limit = smem_limit(device)
            cfg = parse_config(name)
            reasons = config_reasons(cfg, probe, device)
            dt = "f16" if probe.dtype == "float16" else "bf16"
            head = (f"sm{arch} {probe.op} {name:28s} {dt} d{probe.head_dim} "
                    f"{'causal' if probe.causal else 'full  '}")
            try:
                kernels, error = fut.result()
            except Exception as exc:  # noqa: BLE001
                kernels, error = None, f"{type(exc).__name__}: {exc}"
            if kernels is None:
                line = f"FAIL {head} | does not compile: {error}"
                failed.append(line)
                print(line, flush=True)
                continue
            shared = max(k["shared"] for k in kernels)
            fits = shared <= limit
            detail = (f"shared {shared / 1024:.1f} KiB (estimate {cfg.smem_bytes(probe.head_dim) / 1024:.1f}) "
                      f"of {limit // 1024}; regs " + "/".join(str(k["regs"]) for k in kernels)
                      + "; spill " + "/".join(str(k["spilled"]) for k in kernels))
            if not reasons and not fits:
                line = f"FAIL {head} | accepted by the rules but does not fit: {detail}"
                failed.append(line)
                print(line, flush=True)
            elif reasons and fits:
                line = f"NOTE {head} | rejected ({'; '.join(reasons)}) but fits: {detail}"
                notes.append(line)
                passed += 1
                if not quiet:
                    print(line)
            else:
                passed += 1
                if not quiet:
                    status = "rejected, rightly" if reasons else "fits"
                    print(f"PASS {head} | {status}: {detail}")
    print()
    print(f"{len(notes)} configs rejected by the rules although they would fit")
    if failed:
        print(f"--- {len(failed)} failures ---")
        for line in failed[:60]:
            print(line)
    print(f"{passed} passed, {len(failed)} failed")
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="", help="regex: only configs whose name matches")
    ap.add_argument("--ops", default="fwd,bwd", help="fwd, bwd or both (default)")
    ap.add_argument("--shapes", default="", help="comma-separated indices into SHAPES (0-6)")
    ap.add_argument("--variants", default="", help="comma-separated indices into VARIANTS (0-3)")
    ap.add_argument("--processes", type=int, default=min(16, os.cpu_count() or 1),
                    help="worker processes that compile ahead of time (1: compile in this one)")
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="stop starting new checks after this many seconds (default 230)")
    ap.add_argument("--quiet", action="store_true", help="print failures only, not every pass")
    ap.add_argument("--no-extra", action="store_true",
                    help="skip head dims 32/96/256 (default configs only, on EXTRA_SHAPES)")
    ap.add_argument("--offline", default="",
                    help="no GPU: compile for these architectures (e.g. 90,80) and check the "
                         "support rules against the compiler's shared memory")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    pick = re.compile(args.configs) if args.configs else None
    ops = [op for op in ("fwd", "bwd") if op in args.ops.split(",")]
    space = {"fwd": FWD_SPACE, "bwd": BWD_SPACE}
    configs = {op: [c.name for c in space[op] if pick is None or pick.search(c.name)] for op in ops}
    variants = [VARIANTS[int(i)] for i in args.variants.split(",")] if args.variants else list(VARIANTS)
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else list(SHAPES)

    if args.offline:
        archs = [int(a) for a in args.offline.split(",")]
        status = offline(archs, configs, variants, args.processes, args.quiet)
        print(f"total {time.perf_counter() - t_start:.1f} s")
        return status

    if not torch.cuda.is_available():
        print("no CUDA GPU: this script checks the kernels on a GPU")
        print("0 passed, 1 failed")
        return 1
    import triton

    device = DeviceInfo.from_torch()
    print(f"device: {device.name} sm_{device.arch} ({device.sm_count} SMs); torch {torch.__version__}, "
          f"triton {triton.__version__}, CUDA {torch.version.cuda}")
    backend = TritonBackend()
    if backend.unavailable_reasons():
        print("triton backend unavailable: " + "; ".join(backend.unavailable_reasons()))
        print("0 passed, 1 failed")
        return 1

    print(f"configs: {sum(map(len, configs.values()))} ({', '.join(f'{len(v)} {k}' for k, v in configs.items())}); "
          f"{len(variants)} variants x {len(shapes)} shapes")

    # work: (variant, op) -> configs, and the shapes of each variant. The main variants run
    # every config; the extra head dims run their default configs
    runnable: dict[tuple, list[str]] = {}
    variant_shapes: dict[tuple, tuple] = {}
    skipped: list[str] = []
    for variant in variants:
        variant_shapes[variant] = tuple(shapes)
        dtype, d, causal = variant
        for op in ops:
            probe = Problem(op, dtype, 1, 4, 2, 256, 256, d, causal)
            for name in configs[op]:
                reasons = backend.not_supported_reasons(probe, name, device)
                if reasons:
                    skipped.append(f"SKIP {op} {name} {dtype} d{d}: {'; '.join(reasons)}")
                else:
                    runnable.setdefault((*variant, op), []).append(name)
    for variant in () if args.no_extra else EXTRA_VARIANTS:
        variant_shapes[variant] = EXTRA_SHAPES
        dtype, d, causal = variant
        for op in ops:
            probe = Problem(op, dtype, 1, 4, 2, 256, 256, d, causal)
            name = backend.default_config(probe, device)
            if name is None:
                reasons = backend.not_supported_reasons(probe, None, device)
                skipped.append(f"SKIP {op} default {dtype} d{d}: {'; '.join(reasons)}")
            elif pick is None or pick.search(name):
                runnable.setdefault((*variant, op), []).append(name)

    # compile everything up front, in parallel
    jobs = [(Problem(op, dtype, 1, 4, 2, 256, 256, d, causal), name)
            for (dtype, d, causal, op), names in runnable.items() for name in names]
    t0 = time.perf_counter()
    try:
        compiled = warmup_jobs(jobs, processes=args.processes)
        print(f"compiled {len(compiled)}/{len(jobs)} (config, variant) pairs in "
              f"{time.perf_counter() - t0:.1f} s with {args.processes} processes", flush=True)
    except Exception as exc:  # noqa: BLE001 - the checks compile on first use anyway
        print(f"ahead-of-time compilation failed ({type(exc).__name__}: {exc}); compiling lazily")

    passed, failed, not_run = 0, [], 0
    out_of_time = False
    for vi, (variant, vshapes) in enumerate(variant_shapes.items()):
        dtype, d, causal = variant
        cases = []
        for si, shape in enumerate(vshapes):
            try:
                cases.append(Case(dtype, d, causal, shape, "cuda", seed=1000 * vi + si))
            except Exception as exc:  # noqa: BLE001
                line = f"FAIL reference {dtype} d{d} causal={causal} {shape}: {type(exc).__name__}: {exc}"
                print(line)
                failed.append(line)
        for op in ops:
            check = check_forward if op == "fwd" else check_backward
            for name in runnable.get((*variant, op), []):
                for case in cases:
                    if time.perf_counter() - t_start > args.budget_s:
                        out_of_time = True
                        not_run += 1
                        continue
                    head = f"{op} {name:28s} {case.label}"
                    try:
                        ok, text = check(backend, case, name)
                    except Exception as exc:  # noqa: BLE001 - one check fails, the run goes on
                        ok = False
                        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                        if os.environ.get("SPARKTUNE_CHECK_TRACEBACK"):
                            traceback.print_exc()
                    line = f"{'PASS' if ok else 'FAIL'} {head} | {text}"
                    if ok:
                        passed += 1
                        if not args.quiet:
                            print(line)
                    else:
                        failed.append(line)
                        print(line, flush=True)
        del cases
        torch.cuda.empty_cache()

    print()
    for line in skipped:
        print(line)
    if failed:
        print(f"--- {len(failed)} failures ---")
        for line in failed[:60]:
            print(line)
        if len(failed) > 60:
            print(f"... and {len(failed) - 60} more")
    if out_of_time:
        print(f"time budget of {args.budget_s:.0f} s reached: {not_run} checks not run")
    print(f"total {time.perf_counter() - t_start:.1f} s; {len(skipped)} (config, variant) pairs "
          "skipped by the support rules")
    print(f"{passed} passed, {len(failed)} failed")
    if failed:
        return 1
    return 3 if out_of_time else 0


if __name__ == "__main__":
    sys.exit(main())

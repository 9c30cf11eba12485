#!/usr/bin/env python3
"""Check every compiled Hopper backward (bwd_sm90_*) kernel on an H100/H200, then time it.

    . tools/device_prep.sh 'bwd_sm90_*,default' \\
        && python3 tools/gpu_check_sm90_bwd.py --out "$OUT/bwd90.log"
    python3 tools/gpu_check_sm90_bwd.py --kernels 'bwd_sm90_f16_*' --no-speed   # first run

Correctness, one subprocess per kernel (a hang or a crash costs that kernel at most
--idle-timeout seconds without output, or --kernel-timeout in all, not the run; the kernels
left when --budget is spent are reported as not run): whole tiles first (128 x 128, one head:
a failure there is a layout or pipeline bug), then odd shapes (seqlen 1, 17, 1000, 4097;
seqlen_q != seqlen_k both ways, with rows that see no key under the causal mask; GQA 4:1 and
MQA; (B,H,N,D), (B,N,H,D) and strided-head views), causal and not, in the kernel's dtype and
head dim. A FAIL line is followed by where its first failing gradient is wrong: the worst
element's (batch, head, row, col) with its value and the reference's, and the batches, heads,
rows and columns holding elements over the bound, as index runs. The summary ends with the
first failure. The forward's output and log-sum-exp come from the float64 reference (so only
the backward is judged); dq, dk and dv are compared with float64 autograd by FlashAttention's
rule: the max abs error is at most twice PyTorch's own error in the same precision (the larger
of plain matmul-softmax-matmul and math SDPA autograd) plus 1e-5. A first pass over the shapes
checks the default mode ("def" lines; a second run on the same inputs must pass the same bound:
float atomics add dQ in any order), a second pass the deterministic mode ("det" lines: the same
bound, and three runs must give bit-identical gradients), so that a hang of the dQ counters
keeps the first pass's results. Then packed sequences (PACKED: odd lengths starting anywhere in
a tile, an empty sequence, queries without keys and keys without queries, seqlen_q != seqlen_k,
GQA; "pk def" and "pk det" lines), the same two modes and rules, the baseline the worst of each
sequence's own PyTorch error and the gradients compared over the packed rows (a FAIL's "row" is
the packed row); --no-packed leaves them out. Then the attention features (FEATURE_SHAPES and
FEATURE_VARLEN: sliding windows, soft-capping, ALiBi, together, packed; "ft def" and "ft det"
lines), against float64 autograd through tests/_features_baseline.py's definition, the
baseline the same definition's error in the kernel's dtype; --no-features leaves them out,
--features-only runs only them.

Speed (after correctness, within --speed-budget seconds, in its own subprocess): head dims 64
and 128, causal and not, seqlen 2k/4k/8k/16k at 16k tokens, 12 heads, fp16. TFLOP/s of
forward + backward (3.5x the forward's FLOPs: 2 GEMMs forward, 5 backward) of torch SDPA's
cuDNN backend against ours (the sm90 forward kernel of that head dim when one is compiled, else
the spark forward default, then each bwd_sm90 kernel), timed round-robin; the default
kernel's deterministic mode as well, with its slowdown.

Everything printed goes to --out as well. Exit status: 1 on any correctness failure (or a
kernel timeout), 2 when the check cannot run here, 0 otherwise.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: (batch, heads_q, heads_kv, seqlen_q, seqlen_k, layout). The first two are tiny on purpose:
#: whole tiles without a tail (a failure there is a layout or pipeline bug, not masking), then
#: seqlen 1 (every tile a tail); a hang shows at once.
SHAPES = (
    (1, 1, 1, 128, 128, "bhnd"),
    (2, 4, 4, 1, 1, "bhnd"),
    (2, 4, 4, 17, 17, "bnhd"),
    (2, 4, 4, 128, 128, "bhnd"),
    (1, 4, 1, 1000, 1000, "bnhd"),  # MQA
    (1, 8, 2, 4097, 4097, "bhnd"),  # GQA 4:1
    (2, 4, 4, 100, 1000, "bhnd"),   # seqlen_q < seqlen_k
    (2, 4, 4, 1000, 100, "bnhd"),   # seqlen_q > seqlen_k: causal rows with no key
    (1, 4, 4, 17, 4097, "bnhd"),
    (1, 4, 4, 4097, 17, "bhnd"),
    (1, 8, 4, 300, 300, "bhnd_slice"),  # every other head of a packed buffer
)
#: packed batches: (query lengths, key lengths, heads_q, heads_kv)
PACKED = (
    ([1, 17, 1000, 0, 4097, 129], [1, 17, 1000, 0, 4097, 129], 4, 4),
    ([5, 300, 64, 9, 0, 200], [700, 3, 64, 0, 33, 200], 8, 2),  # no key / no query; GQA 4:1
    ([333, 1], [129, 2048], 3, 1),  # MQA
)
#: attention features (docs/FEATURES.md): (batch, heads_q, heads_kv, seqlen_q, seqlen_k,
#: causal, window, softcap, alibi (None, "h" (Hq,), "bh" (B, Hq)), scale (None: head_dim ** -0.5));
#: windows on one side and on both, wider than the sequence, rows with no key at all (their
#: gradients exact zeros), left-only windows (the deterministic order ascending from a key
#: block past the first) and right-limited ones (descending), soft-capping, ALiBi, together
FEATURE_SHAPES = (
    (2, 4, 2, 1000, 1000, True, (255, -1), 0.0, None, None),
    (1, 4, 4, 1000, 1000, False, (100, 37), 0.0, None, None),
    (1, 4, 1, 777, 1000, False, (-1, 100), 0.0, None, None),
    (1, 4, 4, 1000, 777, False, (300, -1), 0.0, None, None),
    (2, 4, 4, 17, 17, True, (100, 100), 0.0, None, None),
    (2, 4, 4, 1000, 100, False, (0, 0), 0.0, None, None),
    (1, 8, 2, 4097, 4097, True, (1023, -1), 0.0, None, None),
    (2, 8, 2, 1000, 1000, True, (-1, -1), 30.0, None, 0.5),
    (1, 4, 4, 17, 1000, False, (-1, -1), 50.0, None, 0.5),
    (2, 8, 8, 1000, 1000, True, (-1, -1), 0.0, "h", None),
    (2, 4, 2, 777, 1000, False, (-1, -1), 0.0, "bh", None),
    (1, 8, 2, 1537, 1537, True, (255, -1), 30.0, "bh", 0.4),
    (2, 4, 4, 1000, 517, False, (64, 16), 5.0, "h", None),
)
#: packed feature cases: (query lengths, key lengths, heads_q, heads_kv, causal, window,
#: softcap, alibi, scale)
FEATURE_VARLEN = (
    ((1, 17, 1000, 0, 4097, 128), (1, 17, 1000, 0, 4097, 128), 4, 4, True, (255, -1), 0.0, None, None),
    ((5, 300, 64, 9), (700, 3, 64, 0), 8, 2, False, (32, 16), 30.0, "bh", 0.5),
)
FLOOR = 1e-5
DET_RUNS = 3


class Log:
    """print() to stdout and to the --out file."""

    def __init__(self, path: str | None):
        self.fh = open(path, "a") if path else None  # noqa: SIM115

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.fh is not None:
            self.fh.write(line + "\n")
            self.fh.flush()


# ---------------------------------------------------------------- worker: one kernel's checks
def _make(torch, b, h, n, d, layout, dtype, gen):
    if layout == "bhnd":
        return torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
    if layout == "bnhd":
        return torch.randn(b, n, h, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
    buf = torch.randn(b, n, 2 * h, d, device="cuda", dtype=dtype, generator=gen)
    return buf[:, :, ::2].transpose(1, 2)


def _max_err(a, ref) -> float:
    return float((a.double() - ref).abs().max()) if a.numel() else 0.0


def _run_bwd(torch, spark, name, dout, q, k, v, out, lse, causal, scale, deterministic,
             packed=None):
    """dq, dk, dv of one backward (``packed``: the cu_seqlens / max_seqlen arguments, and any
    feature arguments), as (B, H, N, D) views (packed: (1, H, total, D))."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kw = {"deterministic": True} if deterministic else {}
    spark.backward(dout, q, k, v, out, lse, dq, dk, dv, config=name, causal=causal, scale=scale,
                   **kw, **(packed or {}))
    torch.cuda.synchronize()
    if packed and "cu_seqlens_q" in packed:
        return tuple(t.transpose(0, 1).unsqueeze(0) for t in (dq, dk, dv))
    return dq, dk, dv


def _ranges(idx: list[int], most: int = 6) -> str:
    """[0, 1, 2, 5, 6, 9] -> "0-2,5-6,9" (the first ``most`` runs)."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:most])
    return text + (f",... ({len(runs)} runs)" if len(runs) > most else "")


def _where(g, ref, bound: float, rows: str) -> str:
    """Where a gradient (batch, heads, rows, head_dim) is wrong: the worst element's index and
    values, and which batches, heads, rows and columns have elements over ``bound``, as index
    runs, so that a layout bug (a column range, every other 8 rows, one warpgroup's keys) or a
    tail or mask bug (the last rows, the diagonal) can be told apart."""
    import torch

    err = (g.double() - ref).abs().nan_to_num(nan=math.inf)
    flat = int(err.argmax())
    b, h, r, c = (int(x) for x in torch.unravel_index(torch.tensor(flat), err.shape))
    bad = err > bound
    n_bad = int(bad.sum())
    n_nonfinite = int((~torch.isfinite(g)).sum())

    def runs(dim: int) -> str:  # the indices along ``dim`` that have a bad element
        others = [i for i in range(4) if i != dim]
        hit = bad.permute(dim, *others).reshape(bad.shape[dim], -1).any(dim=1)
        return _ranges(hit.nonzero().flatten().tolist()) or "none"

    return (f"worst at (batch {b}, head {h}, {rows} {r}, col {c}): got {float(g[b, h, r, c]):.4g}, "
            f"want {float(ref[b, h, r, c]):.4g}; {n_bad} of {g.numel()} over {bound:.3g} "
            f"({n_nonfinite} not finite); batches {runs(0)}, heads {runs(1)}, "
            f"{rows}s {runs(2)} of {g.shape[2]}, cols {runs(3)} of {g.shape[3]}")


def _judge(grads, refs, bases, what, why: list[str], detail: list[str] | None = None) -> list[float]:
    """Errors of (dq, dk, dv); a reason appended to ``why`` for each over its bound, and where
    it is wrong (:func:`_where`) to ``detail`` for the first failing gradient."""
    es = [_max_err(g, r) for g, r in zip(grads, refs, strict=True)]
    for i, (gname, e, base) in enumerate(zip(("dq", "dk", "dv"), es, bases, strict=True)):
        bound = 2 * base + FLOOR
        if not math.isfinite(e) or e > bound:
            why.append(f"{what} {gname} err {e:.3g} > bound {bound:.3g}")
            if detail is not None and not detail:
                rows = "query row" if gname == "dq" else "key row"
                detail.append(f"{what} {gname} {_where(grads[i], refs[i], bound, rows)}")
    return es


def worker_check(name: str, max_shapes: int, packed: bool = True, features: bool = True,
                 only_features: bool = False) -> int:
    """Print one PASS/FAIL line per (mode, shape, causal) for kernel ``name`` (the first
    ``max_shapes`` shapes), a FAIL line followed by where its first failing gradient is wrong;
    1 on any failure. Two passes over the shapes: the default mode (atomics in any order), then
    the deterministic one (dQ counters, which wait on other blocks), so that a hang of the
    second keeps every result of the first."""
    import torch

    from sparktune.backends.reference import reference_attention, reference_attention_backward
    from sparktune.backends.spark import SparkBackend, load_extension
    from tests._oracle import lowp_attention

    mod, err = load_extension()
    if mod is None:
        print(f"FAIL {name}: {err}", flush=True)
        return 1
    info = {k["name"]: k for k in mod.kernels()}[name]
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[info["dtype"]]
    d = info["head_dim"]
    spark = SparkBackend()
    failed = 0
    print(f"START {name}: {info['threads']} threads, {info['smem_bytes']} B shared memory",
          flush=True)
    cases: dict = {}  # (shape, causal) -> (args of _run_bwd, refs, bases), made in the first pass

    def case(shape, causal):
        if (shape, causal) not in cases:
            b, hq, hk, nq, nk, layout = shape
            gen = torch.Generator(device="cuda").manual_seed(
                zlib.crc32(repr((shape, d, name)).encode()))
            q = _make(torch, b, hq, nq, d, layout, dtype, gen)
            k = _make(torch, b, hk, nk, d, layout, dtype, gen)
            v = _make(torch, b, hk, nk, d, layout, dtype, gen)
            dout = _make(torch, b, hq, nq, d, layout, dtype, gen)
            scale = 1.0 / math.sqrt(d)
            with torch.no_grad():
                ref_out, ref_lse = reference_attention(q, k, v, causal=causal, scale=scale)
                refs = reference_attention_backward(dout, q, k, v, causal=causal, scale=scale)
            lowps = []
            for kind in ("plain", "sdpa"):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                with torch.enable_grad():
                    o, _ = lowp_attention(*leaves, causal=causal, scale=scale, kind=kind)
                    lowps.append(torch.autograd.grad(o, leaves, dout))
            bases = [max(_max_err(lp[i], refs[i]) for lp in lowps) for i in range(3)]
            args = (torch, spark, name, dout, q, k, v, ref_out.to(dtype),
                    ref_lse.float().contiguous(), causal, scale)
            cases[(shape, causal)] = (args, refs, bases)
        return cases[(shape, causal)]

    def packed_case(case, causal):
        """The (args of _run_bwd, refs, bases) of a packed batch: float64 gradients over the
        packed rows as (1, H, total, D) views, the baseline per gradient the worst of each
        sequence's own PyTorch error."""
        key = ("packed", repr(case), causal)
        if key not in cases:
            lq, lk, hq, hk = case
            gen = torch.Generator(device="cuda").manual_seed(
                zlib.crc32(repr((case, d, name)).encode()))
            q = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype, generator=gen)
            k = torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype, generator=gen)
            v = torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype, generator=gen)
            dout = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype, generator=gen)
            cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                               device="cuda") for n in (lq, lk)]
            kw = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
            scale = 1.0 / math.sqrt(d)
            with torch.no_grad():
                ref_out, ref_lse = reference_attention(q, k, v, causal, scale, **kw)
                refs = reference_attention_backward(dout, q, k, v, causal, scale, **kw)
            bases = [0.0, 0.0, 0.0]
            cq, ck = cu[0].tolist(), cu[1].tolist()
            view = lambda t, a, z: t[a:z].transpose(0, 1).unsqueeze(0)  # noqa: E731
            for s in range(len(lq)):
                q0, q1, k0, k1 = cq[s], cq[s + 1], ck[s], ck[s + 1]
                if q1 == q0 or k1 == k0:  # exact zeros there; no PyTorch error to measure
                    continue
                for kind in ("plain", "sdpa"):
                    leaves = [view(t, a, z).detach().requires_grad_()
                              for t, a, z in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
                    with torch.enable_grad():
                        o, _ = lowp_attention(*leaves, causal=causal, scale=scale, kind=kind)
                        lp = torch.autograd.grad(o, leaves, view(dout, q0, q1))
                    for i, (a, z) in enumerate(((q0, q1), (k0, k1), (k0, k1))):
                        bases[i] = max(bases[i], _max_err(lp[i], view(refs[i], a, z)))
            args = (torch, spark, name, dout, q, k, v, ref_out.to(dtype), ref_lse.float(), causal,
                    scale)
            extra = dict(**kw, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
            refs = tuple(t.transpose(0, 1).unsqueeze(0) for t in refs)
            cases[key] = (args, extra, refs, bases)
        return cases[key]

    def check(mode, label, made):
        """One line of the check: the backward of ``made()`` = (args of _run_bwd, its packed
        arguments or None, refs, bases) against the references, run twice (default mode) or
        DET_RUNS times and bit-identical (deterministic); True when it passed."""
        why: list[str] = []
        detail: list[str] = []
        errs = [float("nan")] * 3
        bases = [float("nan")] * 3
        try:
            args, extra, refs, bases = made()
            if mode == "default":
                errs = _judge(_run_bwd(*args, False, extra), refs, bases, mode, why, detail)
                _judge(_run_bwd(*args, False, extra), refs, bases, "default repeat", why, detail)
            else:
                det = [_run_bwd(*args, True, extra) for _ in range(DET_RUNS)]
                errs = _judge(det[0], refs, bases, mode, why, detail)
                for i in range(1, DET_RUNS):
                    if not all(torch.equal(a, c) for a, c in zip(det[0], det[i], strict=True)):
                        why.append(f"deterministic run {i + 1} not bit-identical to run 1")
                        break
        except Exception as exc:  # one check fails, the rest run
            why.append(f"{type(exc).__name__}: {exc}")
        ok = not why
        errs_s = " ".join(f"{n}={e:.2e}({bs:.2e})"
                          for n, e, bs in zip(("dq", "dk", "dv"), errs, bases, strict=True))
        print(f"{'PASS' if ok else 'FAIL'} {label:<84} {errs_s}"
              + ("" if ok else "  " + "; ".join(why)), flush=True)
        for line in detail:
            print(f"     {line}", flush=True)
        return ok

    def dense(shape, causal):
        args, refs, bases = case(shape, causal)
        return args, None, refs, bases

    def feature_case(fcase, is_packed):
        """(args of _run_bwd, the feature (and packed) arguments, refs, bases) of a feature
        case: float64 gradients by autograd through tests/_features_baseline.py's definition
        in float64, the baseline its error in the kernel's dtype; out and lse the float64
        forward's (dense (B, H, N, D) in the (B, N, H, D) layout; packed as (1, H, total, D)
        views)."""
        key = ("features", repr(fcase), is_packed)
        if key in cases:
            return cases[key]
        from tests._features_baseline import feature_attention

        gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((fcase, d, name)).encode()))
        if is_packed:
            lq, lk, hq, hk, causal, window, softcap, alibi, fscale = fcase
            batch = len(lq)
            cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                               device="cuda") for x in (lq, lk)]
            q = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype, generator=gen)
            k, v = (torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype, generator=gen)
                    for _ in range(2))
            dout = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype, generator=gen)
            extra = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max(lq),
                         max_seqlen_k=max(lk))
            cuts = dict(cu_q=cu[0].tolist(), cu_k=cu[1].tolist())
        else:
            batch, hq, hk, nq, nk, causal, window, softcap, alibi, fscale = fcase
            q = _make(torch, batch, hq, nq, d, "bnhd", dtype, gen)
            k, v = (_make(torch, batch, hk, nk, d, "bnhd", dtype, gen) for _ in range(2))
            dout = _make(torch, batch, hq, nq, d, "bnhd", dtype, gen)
            extra, cuts = {}, {}
        fscale = 1.0 / math.sqrt(d) if fscale is None else fscale
        slopes = None
        if alibi is not None:
            slopes = torch.rand((hq,) if alibi == "h" else (batch, hq), generator=gen,
                                device="cuda") * 0.2
        fkw = dict(window=window, softcap=softcap, slopes=slopes, **cuts)

        def grads(dt):
            leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                o, lse_ = feature_attention(*leaves, scale=fscale, causal=causal, **fkw)
                return o.detach(), lse_.detach(), torch.autograd.grad(o, leaves, dout.to(dt))

        ref_out, ref_lse, refs = grads(torch.float64)
        _, _, lowp = grads(dtype)
        bases = [_max_err(lowp[i], refs[i]) for i in range(3)]
        extra.update(window=window)
        if softcap:
            extra["softcap"] = softcap
        if slopes is not None:
            extra["alibi_slopes"] = slopes
        args = (torch, spark, name, dout, q, k, v, ref_out.to(dtype), ref_lse.float().contiguous(),
                causal, fscale)
        if is_packed:
            refs = tuple(t.transpose(0, 1).unsqueeze(0) for t in refs)
        cases[key] = (args, extra, refs, bases)
        return cases[key]

    for mode in ("default", "deterministic") if not only_features else ():
        for shape in SHAPES[:max_shapes]:
            b, hq, hk, nq, nk, layout = shape
            for causal in (False, True):
                label = (f"{mode[:3]} {name} b{b} h{hq}/{hk} q{nq} k{nk} {layout} "
                         f"{'causal' if causal else 'full'}")
                failed += not check(mode, label, lambda shape=shape, causal=causal: dense(shape, causal))
    for mode in ("default", "deterministic") if packed and not only_features else ():
        for case_ in PACKED:
            lq, lk, hq, hk = case_
            for causal in (False, True):
                label = (f"pk {mode[:3]} {name} h{hq}/{hk} q{lq} k{lk} "
                         f"{'causal' if causal else 'full'}")
                failed += not check(mode, label,
                                    lambda case_=case_, causal=causal: packed_case(case_, causal))
    fcases = [(c, False) for c in FEATURE_SHAPES] + [(c, True) for c in FEATURE_VARLEN if packed]
    for mode in ("default", "deterministic") if features else ():
        for fcase, is_packed in fcases:
            if is_packed:
                lq, lk, hq, hk, causal, window, softcap, alibi, _ = fcase
                shape = f"pk h{hq}/{hk} q{list(lq)} k{list(lk)}"
            else:
                b, hq, hk, nq, nk, causal, window, softcap, alibi, _ = fcase
                shape = f"b{b} h{hq}/{hk} q{nq} k{nk}"
            label = (f"ft {mode[:3]} {name} {shape} {'causal' if causal else 'full'} "
                     f"w={window} cap={softcap:g} alibi={alibi}")
            failed += not check(mode, label, lambda fcase=fcase, is_packed=is_packed:
                                feature_case(fcase, is_packed))
    return 1 if failed else 0


# ---------------------------------------------------------------- worker: the speed table
def _time(torch, fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e-3


def _cudnn_fwd_bwd(torch, qg, kg, vg, dout, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        torch.autograd.backward(o, dout)
    return run


def _ours_fwd_bwd(spark, fwd_name, bwd_name, tensors, causal, scale, deterministic=False):
    q, k, v, dout, out, dq, dk, dv = tensors
    kw = {"deterministic": True} if deterministic else {}

    def run():
        lse = spark.forward(q, k, v, out, config=fwd_name, causal=causal, scale=scale)
        spark.backward(dout, q, k, v, out, lse, dq, dk, dv, config=bwd_name, causal=causal,
                       scale=scale, **kw)
    return run


def worker_speed(names: list[str], rounds: int, budget_s: float) -> int:
    import torch

    from sparktune.backends.spark import SparkBackend, load_extension

    mod, _ = load_extension()
    infos = {k["name"]: k for k in mod.kernels()}
    spark = SparkBackend()
    t_end = time.time() + budget_s
    print(f"\nspeed: fwd+bwd TFLOP/s (3.5 x forward FLOPs), fp16, 12 heads, 16k tokens; best of "
          f"{rounds} round-robin rounds of 5 calls")
    for d in (64, 128):
        ks = [n for n in names if infos[n]["head_dim"] == d and infos[n]["dtype"] == "float16"]
        if not ks:
            continue
        fwds = sorted(n for n, k in infos.items() if k["op"] == "fwd" and k["head_dim"] == d
                      and k["dtype"] == "float16" and k["family"] in (80, 90))
        fwd_tail = spark._DEFAULTS90.get(("fwd", d), "")
        fwd90 = sorted((n for n in fwds if n.startswith("fwd_sm90_")),
                       key=lambda n: (not n.endswith("_" + fwd_tail), n))  # the default first
        fwd_name = (fwd90 or fwds or [None])[0]
        if fwd_name is None:
            print(f"hd {d}: no fp16 forward kernel compiled, skipped")
            continue
        tail = spark._DEFAULTS90.get(("bwd", d))
        det_name = next((n for n in ks if tail is not None and n.endswith("_" + tail)), ks[0])
        print(f"\nhd {d}: our forward {fwd_name}; deterministic timed with {det_name}")
        print(f"{'causal':>6} {'seqlen':>6} {'cudnn':>7}  ours (x cudnn)")
        for causal in (False, True):
            for n in (2048, 4096, 8192, 16384):
                if time.time() > t_end:
                    print("(time budget reached: speed table cut short)")
                    return 0
                b, h = 16384 // n, 12
                q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16)
                                 for _ in range(4))
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                flops = 3.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                scale = d ** -0.5
                tensors = (q, k, v, dout, torch.empty_like(q), torch.empty_like(q),
                           torch.empty_like(k), torch.empty_like(v))
                cands = {}
                cudnn = _cudnn_fwd_bwd(torch, qg, kg, vg, dout, causal)
                try:
                    cudnn()
                    cands["cudnn"] = cudnn
                except Exception as exc:  # noqa: BLE001
                    print(f"  cudnn unavailable: {type(exc).__name__}: {exc}")
                for name in ks:
                    cands[name] = _ours_fwd_bwd(spark, fwd_name, name, tensors, causal, scale)
                cands["det:" + det_name] = _ours_fwd_bwd(spark, fwd_name, det_name, tensors,
                                                         causal, scale, True)
                for fn in cands.values():
                    fn()
                torch.cuda.synchronize()
                best = {c: math.inf for c in cands}
                for _ in range(rounds):
                    for c, fn in cands.items():
                        best[c] = min(best[c], _time(torch, fn, 5))
                tf = {c: flops / t / 1e12 for c, t in best.items()}
                base = tf.get("cudnn")
                cells = "  ".join(
                    f"{c.replace('bwd_sm90_', '')}={tf[c]:.0f}"
                    + (f" ({tf[c] / base:.2f}x)" if base else "") for c in cands if c != "cudnn")
                slow = best["det:" + det_name] / best[det_name] - 1.0
                print(f"{str(causal):>6} {n:>6} {base or float('nan'):>7.0f}  {cells}  "
                      f"det slowdown {slow * 100:+.0f}%", flush=True)
    return 0


# ---------------------------------------------------------------- parent
def _run_worker(cmd, env, timeout: float, idle: float, log):
    """Run a worker, logging its output (stdout and stderr) line by line as it comes. It is
    killed after ``timeout`` seconds, or after ``idle`` seconds without a line (a hung kernel
    never returns, and the first shapes take seconds). Returns (stdout lines, exit status,
    why it was killed or None)."""
    import queue
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, bufsize=1)
    lines_q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines_q.put(line.rstrip("\n"))
        lines_q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    lines: list[str] = []
    start = last = time.time()
    why = None
    while True:
        now = time.time()
        wait = min(start + timeout - now, last + idle - now)
        if wait <= 0:
            why = (f"timed out after {timeout:.0f} s" if now >= start + timeout
                   else f"no output for {idle:.0f} s (hang?)")
            proc.kill()
            break
        try:
            line = lines_q.get(timeout=wait)
        except queue.Empty:
            continue
        if line is None:
            break
        last = time.time()
        lines.append(line)
        log(line)
    rc = proc.wait()
    return lines, rc, why


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="bwd_sm90_*", help="shell patterns, comma-separated")
    ap.add_argument("--out", help="also write the log here")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--speed-only", action="store_true", help="the speed table without the correctness pass")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speed-budget", type=float, default=120.0, help="seconds for the speed table")
    ap.add_argument("--kernel-timeout", type=float, default=240.0,
                    help="seconds for one kernel's correctness checks (its subprocess is killed)")
    ap.add_argument("--idle-timeout", type=float, default=90.0,
                    help="seconds a kernel's checks may print nothing before they count as hung")
    ap.add_argument("--budget", type=float, default=450.0,
                    help="seconds for the correctness checks of all kernels, a hard end (a "
                         "kernel's checks are cut there); the kernels left are reported as not run")
    ap.add_argument("--max-shapes", type=int, default=len(SHAPES),
                    help="check only the first N shapes of SHAPES (the first two are tiny)")
    ap.add_argument("--no-packed", action="store_true",
                    help="leave out the packed-sequence checks (PACKED)")
    ap.add_argument("--no-features", action="store_true",
                    help="leave out the attention-feature checks (FEATURE_SHAPES, FEATURE_VARLEN)")
    ap.add_argument("--features-only", action="store_true",
                    help="only the attention-feature checks")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--speed-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_check(args.worker, args.max_shapes, not args.no_packed,
                            not args.no_features, args.features_only)

    log = Log(args.out)
    try:
        import torch

        from sparktune.backends.spark import load_extension
    except ImportError as exc:
        log(f"gpu_check_sm90_bwd: cannot run: {exc}")
        return 2
    mod, err = load_extension()
    if mod is None:
        log(f"gpu_check_sm90_bwd: {err}")
        return 2
    if not torch.cuda.is_available():
        log("gpu_check_sm90_bwd: no CUDA GPU")
        return 2
    cap = torch.cuda.get_device_capability()
    infos = {k["name"]: k for k in mod.kernels()}
    pats = [p.strip() for p in args.kernels.split(",") if p.strip()]
    names = sorted(n for n, k in infos.items() if k["family"] == 90 and k["op"] == "bwd"
                   and any(fnmatch.fnmatchcase(n, p) for p in pats))
    if args.speed_worker:
        return worker_speed(names, args.rounds, args.speed_budget)
    log(f"device {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}; {len(names)} bwd_sm90 kernels")
    excluded = [e for e in mod.excluded() if e["name"].startswith("bwd_sm90_")]
    for e in excluded:
        log(f"  excluded by the rules: {e['name']}: {e['reason']}")
    if not names:
        log("gpu_check_sm90_bwd: no bwd_sm90 kernel compiled (build with SPARKTUNE_CUDA_ARCHS=90)")
        return 1
    if cap != (9, 0):
        log(f"gpu_check_sm90_bwd: sm_90a kernels need an sm_90 GPU, this is sm_{cap[0]}{cap[1]}")
        return 2

    env = dict(os.environ)
    me = [sys.executable, str(Path(__file__).resolve())]
    failures: list[str] = []
    first_fail: list[str] = []  # the first FAIL line and the lines that say where
    passed = 0
    t0 = time.time()
    deadline = t0 + args.budget  # a hard end: the last kernel gets what is left of it
    for i, name in enumerate(names if not args.speed_only else ()):
        left = deadline - time.time()
        if left < 30:
            failures.append(f"FAIL {name}: not run (the --budget of {args.budget:.0f} s is spent; "
                            f"also not run: {', '.join(names[i + 1:]) or 'none'})")
            log(failures[-1])
            break
        t1 = time.time()
        worker = [*me, "--worker", name, "--max-shapes", str(args.max_shapes)]
        if args.no_packed:
            worker.append("--no-packed")
        if args.no_features:
            worker.append("--no-features")
        if args.features_only:
            worker.append("--features-only")
        lines, rc, why = _run_worker(worker, env, min(args.kernel_timeout, left), args.idle_timeout,
                                     log)
        fails = [ln for ln in lines if ln.startswith("FAIL")]
        passed += sum(ln.startswith("PASS") for ln in lines)
        failures += fails
        if fails and not first_fail:
            at = lines.index(fails[0])
            first_fail = [lines[at]] + [ln for ln in lines[at + 1:at + 3] if ln.startswith("     ")]
        if why is not None:
            done = sum(ln.startswith(("PASS", "FAIL")) for ln in lines)
            failures.append(f"FAIL {name}: {why} after {done} checks; the one that hung is the "
                            "next (mode, shape, causal) after the last line printed")
            log(failures[-1])
            first_fail = first_fail or [failures[-1]]
        elif rc != 0 and not fails:
            failures.append(f"FAIL {name}: worker exited {rc}")
            log(failures[-1])
            first_fail = first_fail or [failures[-1]]
        log(f"  ({name}: {time.time() - t1:.0f} s)")
    if not args.speed_only:
        log(f"\ncorrectness: {passed} passed, {len(failures)} failed ({time.time() - t0:.0f} s)")
    for f in failures:
        log("  " + f)
    if first_fail:
        log("first failure:")
        for line in first_fail:
            log("  " + line.strip())
    if not args.no_speed:
        try:
            res = subprocess.run([*me, "--speed-worker", "--kernels", args.kernels,
                                  "--rounds", str(args.rounds),
                                  "--speed-budget", str(args.speed_budget)],
                                 capture_output=True, text=True, env=env, cwd=ROOT,
                                 timeout=args.speed_budget + 120)
            for line in res.stdout.splitlines():
                log(line)
            if res.returncode != 0:
                log(f"speed table failed (exit {res.returncode}): {res.stderr[-2000:]}")
        except subprocess.TimeoutExpired:
            log("speed table: timed out")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

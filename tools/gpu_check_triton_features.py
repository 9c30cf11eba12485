#!/usr/bin/env python
"""Check the Triton family's attention features on a GPU, then time them (docs/FEATURES.md).

    PYTHONPATH=$PWD python tools/gpu_check_triton_features.py            # about 2-3 minutes
    PYTHONPATH=$PWD python tools/gpu_check_triton_features.py --no-speed # correctness only

Calls the kernels of sparktune.kernels.triton_attn directly (not sparktune.attention), so it
needs neither the API's feature arguments nor the problem key's new fields.

Correctness: sliding windows (both sides, causal + left, rows with no key, wider than the
sequence), softcap, ALiBi ((Hq,) and (B, Hq) slopes), dropout, varlen (empty sequences, GQA,
combined with causal + window + softcap), fp16 and bf16, head dims 64 and 128, odd lengths,
forward (out, lse) and backward (dq, dk, dv) of the default configs (and an atomic-dQ config
on some cases), against float64 with FlashAttention's rule: max abs error at most twice
PyTorch's own error in the same precision (matmul, softmax in float32, matmul, intermediates
rounded to the dtype), plus 1e-5. Dropout is compared through the kernels' own keep mask
(``dropout_mask``), checked statistically (keep fraction within 5 sigma of 1 - p) and by
replay (the same seed and offset give bitwise the same output and gradients). The
deterministic backward must be bitwise identical over 3 runs.

Speed (bf16, 1 x 16 heads x 16k tokens x head dim 128): causal, sliding window 4k (causal,
left 4096), causal + ALiBi, causal + softcap 50, forward and forward+backward, in TFLOP/s of
the visible area (4 * D * visible pairs per head forward, 2.5x that backward), next to
FlexAttention (torch.compile'd flex_attention with the same mask and score modification) and
SDPA's cuDNN backend (causal), measured alternately in the same run (median of the rounds).

Kernels are compiled first in parallel worker processes (``--processes``), into Triton's
on-disk cache. One line per check, then ``N passed, M failed``; exit status 1 when a
correctness check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from common import time_alternating  # noqa: E402

from sparktune.backends.triton import warmup_jobs  # noqa: E402
from sparktune.kernels import triton_attn as ta  # noqa: E402
from sparktune.kernels import triton_space as space  # noqa: E402
from sparktune.problem import DeviceInfo, Problem, _visible_pairs  # noqa: E402
from tests._features_baseline import feature_attention  # noqa: E402

FACTOR = 2.0
FLOOR = 1e-5


@dataclass
class Case:
    name: str
    dtype: torch.dtype
    head_dim: int
    heads_q: int
    heads_kv: int
    #: dense: (batch, seqlen_q, seqlen_k); varlen: lists of lengths
    lens_q: tuple
    lens_k: tuple
    varlen: bool = False
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    #: None, "h" (Hq,) or "bh" (B, Hq)
    alibi: str | None = None
    dropout_p: float = 0.0
    scale: float | None = None
    #: also check this atomic-dQ backward config
    atomic: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.lens_q)

    def problem(self, op: str) -> Problem:
        left, right = self.window
        if self.causal:
            right = -1
        return Problem(
            op, str(self.dtype).replace("torch.", ""), self.batch, self.heads_q, self.heads_kv,
            max(self.lens_q), max(self.lens_k), self.head_dim, self.causal, window_left=left,
            window_right=right, softcap=self.softcap > 0, alibi=self.alibi is not None,
            dropout=self.dropout_p > 0, varlen=self.varlen,
            total_q=sum(self.lens_q) if self.varlen else 0,
            total_k=sum(self.lens_k) if self.varlen else 0)


F16, BF16 = torch.float16, torch.bfloat16

CASES = [
    Case("window(256,128) full", F16, 64, 4, 4, (1000, 1000), (1000, 1000), window=(256, 128),
         atomic=True),
    Case("causal+window(300)", BF16, 128, 4, 2, (1537,), (1537,), causal=True, window=(300, -1)),
    Case("window(64,16) nq>nk (rows without keys)", F16, 128, 4, 4, (1000,), (517,),
         window=(64, 16)),
    Case("window(-1,100) nk>nq", BF16, 64, 4, 1, (777,), (1000,), window=(-1, 100)),
    Case("causal+window wider than seq", F16, 64, 2, 2, (1000,), (1000,), causal=True,
         window=(5000, -1)),
    Case("softcap 30 causal GQA", BF16, 64, 8, 2, (1537,), (1537,), causal=True, softcap=30.0,
         scale=0.5),
    Case("softcap 50 full nq<nk", F16, 128, 4, 4, (1000,), (1537,), softcap=50.0, scale=0.5,
         atomic=True),
    Case("alibi (H,) causal", F16, 64, 8, 8, (1000, 1000), (1000, 1000), causal=True, alibi="h"),
    Case("alibi (B,H) full", BF16, 128, 4, 2, (777, 777), (1000, 1000), alibi="bh"),
    Case("dropout 0.1 causal", BF16, 64, 4, 4, (1000, 1000), (1000, 1000), causal=True,
         dropout_p=0.1),
    Case("dropout 0.2 full", F16, 128, 4, 2, (777,), (1000,), dropout_p=0.2),
    Case("causal+window+softcap+alibi GQA", F16, 128, 8, 2, (1537,), (1537,), causal=True,
         window=(255, -1), softcap=30.0, alibi="bh", scale=0.4),
    Case("varlen full", F16, 64, 4, 4, (17, 1000, 1, 517), (17, 1000, 1, 517), varlen=True),
    Case("varlen causal+window+softcap GQA (empty seqs)", BF16, 128, 8, 2,
         (1, 517, 0, 1000, 33), (1, 600, 12, 1000, 0), varlen=True, causal=True,
         window=(127, -1), softcap=30.0, scale=0.5, atomic=True),
    Case("varlen alibi+dropout", F16, 64, 4, 2, (300, 1001, 64), (333, 1001, 70), varlen=True,
         causal=True, alibi="bh", dropout_p=0.15),
    Case("varlen window both sides", BF16, 64, 4, 4, (129, 700), (129, 700), varlen=True,
         window=(33, 65)),
]


# ------------------------------------------------------------------------------------------
# the definitions, in float64 (exact) or in the inputs' dtype (PyTorch's own error)
# ------------------------------------------------------------------------------------------


def _attention(q, k, v, case: Case, scale, slopes, keep, cu_q, cu_k):
    return feature_attention(q, k, v, scale=scale, causal=case.causal, window=case.window,
                             softcap=case.softcap, slopes=slopes, keep=keep,
                             dropout_p=case.dropout_p, cu_q=cu_q, cu_k=cu_k)


def _max_err(a, ref, where=None) -> float:
    diff = (a.detach().double() - ref.detach().double()).abs()
    if where is not None:
        diff = diff[where]
    return float(diff.max()) if diff.numel() else 0.0


# ------------------------------------------------------------------------------------------
# one case
# ------------------------------------------------------------------------------------------


class Inputs:
    def __init__(self, case: Case, device, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.case = case
        d, hq, hk = case.head_dim, case.heads_q, case.heads_kv

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(case.dtype)

        if case.varlen:
            self.cu_q = [0]
            self.cu_k = [0]
            for a, c in zip(case.lens_q, case.lens_k, strict=True):
                self.cu_q.append(self.cu_q[-1] + a)
                self.cu_k.append(self.cu_k[-1] + c)
            # (total, H, D) rows of a packed QKV-like buffer: strided heads, no copies
            self.q = randn(self.cu_q[-1], hq, d)
            self.k = randn(self.cu_k[-1], hk, d)
            self.v = randn(self.cu_k[-1], hk, d)
            self.kw = dict(cu_seqlens_q=torch.tensor(self.cu_q, dtype=torch.int32, device=device),
                           cu_seqlens_k=torch.tensor(self.cu_k, dtype=torch.int32, device=device),
                           max_seqlen_q=max(case.lens_q), max_seqlen_k=max(case.lens_k))
        else:
            self.cu_q = self.cu_k = None
            b, nq, nk = case.batch, case.lens_q[0], case.lens_k[0]
            # (B, N, H, D) storage seen as (B, H, N, D): the layout models use
            self.q = randn(b, nq, hq, d).transpose(1, 2)
            self.k = randn(b, nk, hk, d).transpose(1, 2)
            self.v = randn(b, nk, hk, d).transpose(1, 2)
            self.kw = {}
        self.dout = randn(*self.q.shape) if case.varlen else randn(b, nq, hq, d).transpose(1, 2)
        self.scale = case.scale or 1.0 / math.sqrt(d)
        self.slopes = None
        if case.alibi is not None:
            shape = (hq,) if case.alibi == "h" else (case.batch, hq)
            self.slopes = torch.rand(shape, generator=gen, device=device) * 0.2
        self.kw.update(causal=case.causal, window=case.window, softcap=case.softcap,
                       alibi_slopes=self.slopes)
        self.keep = None
        if case.dropout_p > 0:
            self.seed, self.offset = 0x5EED_0000_0001 + seed, 2**32 + 4 * seed
            self.kw.update(dropout_p=case.dropout_p, seed=self.seed, offset=self.offset)
            if case.varlen:
                shape = (hq, self.q.shape[0], max(case.lens_k))
            else:
                shape = (case.batch, hq, case.lens_q[0], case.lens_k[0])
            self.keep = ta.dropout_mask(shape, case.dropout_p, self.seed, self.offset,
                                        device=device)

    def reference(self, dtype_kind: str):
        """(out, lse, (dq, dk, dv)) in float64 ("exact") or the inputs' dtype ("lowp")."""
        to = (lambda t: t.double()) if dtype_kind == "exact" else (lambda t: t)
        leaves = [to(t).detach().requires_grad_() for t in (self.q, self.k, self.v)]
        with torch.enable_grad():
            out, lse = _attention(*leaves, self.case, self.scale, self.slopes, self.keep,
                                  self.cu_q, self.cu_k)
            grads = torch.autograd.grad(out, leaves, to(self.dout))
        return out.detach(), lse, grads


def _shrunk(case: Case) -> Case:
    """``case`` with sequences and windows about 30x shorter and at most 4 query heads (the
    interpreter's smoke run)."""

    def short(n: int) -> int:
        return n if n <= 1 else max(2, n // 30)

    def side(w: int) -> int:
        return w if w < 0 else w // 30

    heads_kv = min(case.heads_kv, 2)
    return dataclasses.replace(
        case, lens_q=tuple(short(n) for n in case.lens_q), lens_k=tuple(short(n) for n in case.lens_k),
        window=(side(case.window[0]), side(case.window[1])), heads_q=heads_kv * min(2, case.heads_q // case.heads_kv),
        heads_kv=heads_kv)


def _poisoned(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).fill_(float("nan"))


def _configs(case: Case, device: DeviceInfo | None) -> tuple[str, list[str]]:
    if ta.INTERPRET:  # the CPU smoke run: tiny tiles
        return "tfwd_m16n16_w1s1", ["tbwd_m16n16_w1s1"] + (["tbwd_m16n16_w1s1_dqatomic"] if case.atomic else [])
    fwd = space.default_config_name(case.problem("fwd"), device)
    bwd = [space.default_config_name(case.problem("bwd"), device)]
    if case.atomic:
        bwd.append(bwd[0] + "_dqatomic")
    return fwd, bwd


def check_case(case: Case, device, devinfo: DeviceInfo, seed: int) -> list[tuple[bool, str]]:
    results = []
    t = Inputs(case, device, seed)
    out64, lse64, g64 = t.reference("exact")
    outlp, _, glp = t.reference("lowp")
    fwd_cfg, bwd_cfgs = _configs(case, devinfo)

    def check(name, got, ref, low, where=None):
        err, base = _max_err(got, ref, where), _max_err(low, ref, where)
        bound = FACTOR * base + FLOOR
        ok = math.isfinite(err) and err <= bound
        results.append((ok, f"{case.name} [{case.dtype} d{case.head_dim}] {name}: err {err:.3g} "
                             f"bound {bound:.3g} (torch {base:.3g})"))

    out = _poisoned(t.q)
    lse = ta.attention_forward(t.q, t.k, t.v, out, config=fwd_cfg, scale=t.scale, **t.kw)
    check(f"{fwd_cfg} out", out, out64, outlp)
    empty = torch.isinf(lse64)
    same_empty = torch.equal(torch.isneginf(lse), empty)
    lse_err = _max_err(lse, lse64, ~empty)
    results.append((same_empty and lse_err < 1e-3,
                    f"{case.name} [{case.dtype} d{case.head_dim}] {fwd_cfg} lse: err {lse_err:.3g}"
                    f", -inf rows {'match' if same_empty else 'DIFFER'}"))
    for cfg in bwd_cfgs:
        grads = [_poisoned(x) for x in (t.q, t.k, t.v)]
        ta.attention_backward(t.dout, t.q, t.k, t.v, out, lse, *grads, config=cfg,
                              scale=t.scale, **t.kw)
        for name, g, ref, low in zip(("dq", "dk", "dv"), grads, g64, glp, strict=True):
            check(f"{cfg} {name}", g, ref, low)

    if case.dropout_p > 0:
        p = case.dropout_p
        frac = t.keep.float().mean().item()
        sigma = math.sqrt(p * (1 - p) / t.keep.numel())
        results.append((abs(frac - (1 - p)) < 5 * sigma,
                        f"{case.name} keep fraction {frac:.5f} (expected {1 - p:.5f} +- "
                        f"{5 * sigma:.5f})"))
        again = _poisoned(t.q)
        ta.attention_forward(t.q, t.k, t.v, again, config=fwd_cfg, scale=t.scale, **t.kw)
        grads2 = [_poisoned(x) for x in (t.q, t.k, t.v)]
        ta.attention_backward(t.dout, t.q, t.k, t.v, out, lse, *grads2, config=bwd_cfgs[0],
                              scale=t.scale, **t.kw)
        grads1 = [_poisoned(x) for x in (t.q, t.k, t.v)]
        ta.attention_backward(t.dout, t.q, t.k, t.v, out, lse, *grads1, config=bwd_cfgs[0],
                              scale=t.scale, **t.kw)
        same = torch.equal(out, again) and all(torch.equal(a, b) for a, b in zip(grads1, grads2, strict=True))
        results.append((same, f"{case.name} replay (same seed/offset -> bitwise same out and grads)"))
        other = _poisoned(t.q)
        ta.attention_forward(t.q, t.k, t.v, other, config=fwd_cfg, scale=t.scale,
                             **dict(t.kw, offset=t.offset + 4))
        results.append((not torch.equal(out, other), f"{case.name} another offset, another mask"))
    return results


def check_deterministic(case: Case, device, devinfo: DeviceInfo) -> list[tuple[bool, str]]:
    t = Inputs(case, device, 99)
    fwd_cfg, bwd_cfgs = _configs(case, devinfo)
    out = torch.empty_like(t.q)
    lse = ta.attention_forward(t.q, t.k, t.v, out, config=fwd_cfg, scale=t.scale, **t.kw)
    runs = []
    for _ in range(3):
        grads = [torch.empty_like(x) for x in (t.q, t.k, t.v)]
        ta.attention_backward(t.dout, t.q, t.k, t.v, out, lse, *grads, config=bwd_cfgs[0],
                              scale=t.scale, deterministic=True, **t.kw)
        runs.append(grads)
    same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(r, runs[0], strict=True))
    results = [(same, f"{case.name} deterministic {bwd_cfgs[0]}: 3 runs bitwise identical")]
    try:
        ta.attention_backward(t.dout, t.q, t.k, t.v, out, lse, *runs[0],
                              config=bwd_cfgs[0] + "_dqatomic", scale=t.scale,
                              deterministic=True, **t.kw)
        results.append((False, f"{case.name} deterministic with an atomic config was not refused"))
    except ValueError:
        results.append((True, f"{case.name} deterministic refuses an atomic-dQ config"))
    return results


# ------------------------------------------------------------------------------------------
# compile ahead of time in workers
# ------------------------------------------------------------------------------------------


def precompile(jobs, processes: int) -> None:
    """Compile every (problem, config) job first, in ``processes`` workers (what the tuner's
    warm-up does), so that the checks and the timing do not wait for Triton."""
    jobs = list(dict.fromkeys(jobs))
    t0 = time.perf_counter()
    warmup_jobs(jobs, processes=processes)
    print(f"compiled {len(jobs)} (problem, config) jobs in {time.perf_counter() - t0:.1f} s "
          f"with up to {processes} processes", flush=True)


# ------------------------------------------------------------------------------------------
# speed
# ------------------------------------------------------------------------------------------


def speed(device, devinfo: DeviceInfo, rounds: int, flex: bool) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d = 1, 16, 16384, 128
    dtype = torch.bfloat16
    scale = 1.0 / math.sqrt(d)
    window, cap = 4096, 50.0
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen, device=device, dtype=dtype)
                     for _ in range(4))
    slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], device=device)
    variants = {
        "causal": dict(causal=True),
        f"window {window // 1024}k": dict(causal=True, window=(window, -1)),
        "causal+alibi": dict(causal=True, alibi_slopes=slopes),
        f"causal+softcap {cap:g}": dict(causal=True, softcap=cap),
    }
    flex_fn = None
    if flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex_fn = torch.compile(flex_attention, dynamic=False)
        except Exception as exc:  # noqa: BLE001 - the table says why the column is empty
            print(f"FlexAttention unavailable: {type(exc).__name__}: {exc}")

    def flex_mods(name):
        def causal_mask(bb, hh, qi, kj):
            return qi >= kj

        def window_mask(bb, hh, qi, kj):
            return (qi >= kj) & (qi - kj <= window)

        def alibi_mod(score, bb, hh, qi, kj):
            return score - slopes[hh] * (qi - kj).abs()

        def softcap_mod(score, bb, hh, qi, kj):
            return cap * torch.tanh(score / cap)

        mask = window_mask if name.startswith("window") else causal_mask
        score = alibi_mod if "alibi" in name else softcap_mod if "softcap" in name else None
        return create_block_mask(mask, None, None, n, n, device=device), score

    print(f"\nspeed: bf16, {b} x {h} heads x {n} tokens x d{d}, TFLOP/s of the visible area "
          f"(median of {rounds} alternating rounds)")
    print(f"{'variant':<22}{'ours fwd':>10}{'fwd+bwd':>10}{'flex fwd':>10}{'fwd+bwd':>10}"
          f"{'cudnn fwd':>11}{'fwd+bwd':>10}   configs")
    for name, kw in variants.items():
        left = kw.get("window", (-1, -1))[0]
        pairs = _visible_pairs(n, n, True, left, -1)
        flops_fwd = 4.0 * b * h * d * pairs
        flops_all = flops_fwd * 3.5
        prob = Case(name, dtype, d, h, h, (n,), (n,), causal=True, window=kw.get("window", (-1, -1)),
                    softcap=kw.get("softcap", 0.0), alibi="h" if "alibi_slopes" in kw else None)
        fwd_cfg, bwd_cfgs = _configs(prob, devinfo)
        out = torch.empty_like(q)
        lse = torch.empty(b, h, n, device=device, dtype=torch.float32)
        grads = [torch.empty_like(x) for x in (q, k, v)]

        def ours_fwd(kw=kw, fwd_cfg=fwd_cfg, out=out, lse=lse):
            ta.attention_forward(q, k, v, out, lse, config=fwd_cfg, scale=scale, **kw)

        def ours_all(kw=kw, fwd_cfg=fwd_cfg, bwd_cfg=bwd_cfgs[0], out=out, lse=lse, grads=grads):
            ta.attention_forward(q, k, v, out, lse, config=fwd_cfg, scale=scale, **kw)
            ta.attention_backward(dout, q, k, v, out, lse, *grads, config=bwd_cfg, scale=scale,
                                  **kw)

        fns = {"ours_fwd": ours_fwd, "ours_all": ours_all}
        if flex_fn is not None:
            try:
                block_mask, score_mod = flex_mods(name)
                ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))

                def flex_fwd(block_mask=block_mask, score_mod=score_mod):
                    with torch.no_grad():
                        flex_fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

                def flex_all(block_mask=block_mask, score_mod=score_mod, ql=ql, kl=kl, vl=vl):
                    o = flex_fn(ql, kl, vl, score_mod=score_mod, block_mask=block_mask, scale=scale)
                    torch.autograd.grad(o, (ql, kl, vl), dout)

                flex_fwd()
                flex_all()
                fns.update(flex_fwd=flex_fwd, flex_all=flex_all)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: FlexAttention failed: {type(exc).__name__}: {str(exc)[:200]}")
        if name == "causal":
            qc, kc, vc = (x.detach().clone().requires_grad_() for x in (q, k, v))

            def cudnn_fwd():
                with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

            def cudnn_all(qc=qc, kc=kc, vc=vc):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)
                    torch.autograd.grad(o, (qc, kc, vc), dout)

            try:
                cudnn_fwd()
                cudnn_all()
                fns.update(cudnn_fwd=cudnn_fwd, cudnn_all=cudnn_all)
            except Exception as exc:  # noqa: BLE001
                print(f"  cuDNN SDPA failed: {type(exc).__name__}: {str(exc)[:200]}")
        ms = time_alternating(fns, rounds, reps=3)

        def tf(key, flops, ms=ms):
            return f"{flops / (ms[key] * 1e-3) / 1e12:.0f}" if key in ms else "-"

        print(f"{name:<22}{tf('ours_fwd', flops_fwd):>10}{tf('ours_all', flops_all):>10}"
              f"{tf('flex_fwd', flops_fwd):>10}{tf('flex_all', flops_all):>10}"
              f"{tf('cudnn_fwd', flops_fwd):>11}{tf('cudnn_all', flops_all):>10}   "
              f"{fwd_cfg} {bwd_cfgs[0]}", flush=True)


# ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--processes", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--no-speed", action="store_true", help="correctness only")
    ap.add_argument("--no-flex", action="store_true", help="leave FlexAttention out of the table")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default="", help="only cases whose name contains this")
    args = ap.parse_args(argv)

    cases = [c for c in CASES if args.cases in c.name]
    if ta.INTERPRET:
        # a smoke run of this script on CPU under Triton's interpreter: short sequences, no
        # compilation, no timing (the checks are the same)
        device, devinfo = torch.device("cpu"), None
        cases = [_shrunk(c) for c in cases]
        args.no_speed, args.processes = True, 1
        print("TRITON_INTERPRET=1: CPU smoke run with shortened sequences", flush=True)
    elif not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        props = torch.cuda.get_device_properties(device)
        devinfo = DeviceInfo(props.name, (props.major, props.minor), props.multi_processor_count)
        print(f"{props.name} sm_{props.major}{props.minor}, torch {torch.__version__}, "
              f"triton {__import__('triton').__version__}", flush=True)
    t_start = time.perf_counter()

    det_cases = [c for c in cases if c.name.startswith(("causal+window(300)", "varlen causal"))]
    jobs = []
    for c in cases:
        fwd, bwds = _configs(c, devinfo)
        jobs.append((c.problem("fwd"), fwd))
        jobs += [(c.problem("bwd"), cfg) for cfg in bwds]
    if not args.no_speed:
        for kw in (dict(), dict(window=(4096, -1)), dict(alibi="h"), dict(softcap=50.0)):
            c = Case("speed", BF16, 128, 16, 16, (16384,), (16384,), causal=True, **kw)
            fwd, bwds = _configs(c, devinfo)
            jobs += [(c.problem("fwd"), fwd), (c.problem("bwd"), bwds[0])]
    if not ta.INTERPRET:
        precompile(jobs, args.processes)

    results: list[tuple[bool, str]] = []
    for i, case in enumerate(cases):
        try:
            for ok, line in check_case(case, device, devinfo, seed=i):
                results.append((ok, line))
                print(("  ok   " if ok else "  FAIL ") + line, flush=True)
        except Exception:  # noqa: BLE001 - one broken case fails that case only
            results.append((False, f"{case.name}: exception\n{traceback.format_exc()}"))
            print("  FAIL " + results[-1][1], flush=True)
    for case in det_cases:
        try:
            for ok, line in check_deterministic(case, device, devinfo):
                results.append((ok, line))
                print(("  ok   " if ok else "  FAIL ") + line, flush=True)
        except Exception:  # noqa: BLE001
            results.append((False, f"{case.name} deterministic: exception\n{traceback.format_exc()}"))
            print("  FAIL " + results[-1][1], flush=True)
    failed = [line for ok, line in results if not ok]
    print(f"\ncorrectness: {len(results) - len(failed)} passed, {len(failed)} failed "
          f"({time.perf_counter() - t_start:.0f} s)", flush=True)
    for line in failed:
        print("  FAIL " + line)

    if not args.no_speed:
        try:
            speed(device, devinfo, args.rounds, flex=not args.no_flex)
        except Exception:  # noqa: BLE001 - the table is information, not a check
            traceback.print_exc()
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

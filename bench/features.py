"""Attention features through ``sparktune.attention`` (dispatch, shipped records) against
FlexAttention and against the same kernels without the feature, measured in this run,
alternating rounds; TFLOP/s of the visible area (4 * B * H * D * visible query-key pairs;
forward+backward 3.5x the forward).

For each variant (sliding window, ALiBi, soft-capping, on top of causal attention) the table
gives: what dispatch runs for the forward and the backward, its forward and forward+backward
speed, FlexAttention's (``torch.compile``d ``flex_attention`` with the same mask and score
modification), and the same forward and backward kernels run on the plain causal problem
("own plain causal": ``Backend.forward`` / ``Backend.backward`` with the same configs), so that
"a feature costs almost nothing" is measured on the kernels that run it. The forward with the
feature is also timed through the same backend call as the plain one ("kernel called
directly", printed, not a target). cuDNN's plain causal attention is timed in the same rounds
for orientation.

Each round is queued behind a GPU sleep (``--lead-ms``, default 2 ms), so that the times are
the GPU's: without it the host time of each round's first call falls inside the timed
interval, which costs a call through ``sparktune.attention`` (dispatch, autograd) more than
the plain problem's direct backend call and a short problem more than a long one
(``--lead-ms 0`` times it that way).

    python bench/features.py                           # bf16, 1 x 16 heads x 16384 x d128
    python bench/features.py --variants window --seqlen 8192

Targets (the features issue): every feature at least 1.0x FlexAttention and at least 0.9x of
the own plain causal, forward and forward+backward. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from common import time_alternating

from sparktune.problem import _visible_pairs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--window", type=int, default=4096, help="left window of the window variant")
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--variants", default="window,alibi,softcap")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--lead-ms", type=float, default=2.0,
                    help="GPU sleep before each timed round while the host queues its calls "
                         "(0: the round's first host call is timed too)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/features.py needs a CUDA GPU", file=sys.stderr)
        return 2

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sparktune
    from sparktune.dispatch import explain
    from sparktune.registry import get_backend

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    b, h, n, d = args.batch, args.heads, args.seqlen, args.head_dim
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen, device=device, dtype=dtype)
                     for _ in range(4))
    slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], device=device)
    variants = {
        "window": (f"window {args.window}", dict(causal=True, window=(args.window, -1))),
        "alibi": ("causal+alibi", dict(causal=True, alibi_slopes=slopes)),
        "softcap": (f"causal+softcap {args.softcap:g}", dict(causal=True, softcap=args.softcap)),
    }
    chosen = [x.strip() for x in args.variants.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in variants]
    if unknown:
        print(f"unknown variants {unknown}; known: {sorted(variants)}", file=sys.stderr)
        return 2

    flex_fn = create_block_mask = None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex_fn = torch.compile(flex_attention, dynamic=False)
        except Exception as exc:  # noqa: BLE001 - the table says why the column is empty
            print(f"FlexAttention unavailable: {type(exc).__name__}: {exc}")

    def flex_mods(name: str, kw: dict):
        left = kw.get("window", (-1, -1))[0]

        def causal_mask(bb, hh, qi, kj):
            return qi >= kj

        def window_mask(bb, hh, qi, kj):
            return (qi >= kj) & (qi - kj <= left)

        def alibi_mod(score, bb, hh, qi, kj):
            return score - slopes[hh] * (qi - kj).abs()

        def softcap_mod(score, bb, hh, qi, kj):
            return args.softcap * torch.tanh(score / args.softcap)

        mask = window_mask if "window" in kw else causal_mask
        score = alibi_mod if "alibi_slopes" in kw else softcap_mod if "softcap" in kw else None
        return create_block_mask(mask, None, None, n, n, device=device), score

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.dtype}, "
          f"{b} x {h} heads x {n} tokens x d{d}; TFLOP/s of the visible area, median of "
          f"{args.rounds} alternating rounds of {args.reps} calls, "
          + (f"queued behind a {args.lead_ms:g} ms GPU sleep (GPU time)" if args.lead_ms > 0
             else "not queued ahead (the first call's host time in each round)"))
    missed = []
    for key in chosen:
        name, kw = variants[key]
        left = kw.get("window", (-1, -1))[0]
        flops_fwd = 4.0 * b * h * d * _visible_pairs(n, n, True, left, -1)
        flops_all = 3.5 * flops_fwd
        flops_plain_fwd = 4.0 * b * h * d * _visible_pairs(n, n, True, -1, -1)
        flops_plain_all = 3.5 * flops_plain_fwd
        feat = {x: y for x, y in kw.items() if x != "causal"}
        sel_f = explain(q, k=k, causal=True, **feat).selection
        sel_b = explain(q, k=k, causal=True, op="bwd", **feat).selection
        if sel_f is None or sel_b is None:
            print(f"\n{name}: dispatch has no kernel for it (sparktune.explain says why)")
            missed.append(f"{name}: no kernel")
            continue
        fwd_be, fwd_cfg = sel_f.candidate.backend, sel_f.candidate.config
        bwd_be, bwd_cfg = sel_b.candidate.backend, sel_b.candidate.config
        ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))

        def ours_fwd(kw=kw):
            with torch.no_grad():
                sparktune.attention(q, k, v, **kw)

        def ours_all(kw=kw, ql=ql, kl=kl, vl=vl):
            o = sparktune.attention(ql, kl, vl, **kw)
            torch.autograd.grad(o, (ql, kl, vl), dout)

        fb, bb = get_backend(fwd_be), get_backend(bwd_be)
        out = torch.empty_like(q)
        grads = [torch.empty_like(x) for x in (q, k, v)]

        def plain_fwd(fb=fb, fwd_cfg=fwd_cfg, out=out):
            return fb.forward(q, k, v, out, config=fwd_cfg, causal=True, scale=scale)

        def plain_all(fb=fb, bb=bb, fwd_cfg=fwd_cfg, bwd_cfg=bwd_cfg, out=out, grads=grads):
            lse = fb.forward(q, k, v, out, config=fwd_cfg, causal=True, scale=scale)
            bb.backward(dout, q, k, v, out, lse, *grads, config=bwd_cfg, causal=True, scale=scale)

        def kernel_fwd(fb=fb, fwd_cfg=fwd_cfg, out=out, feat=feat):
            return fb.forward(q, k, v, out, config=fwd_cfg, causal=True, scale=scale, **feat)

        fns = {"ours_fwd": ours_fwd, "ours_all": ours_all}
        if hasattr(fb, "forward") and fwd_cfg is not None:
            fns["plain_fwd"] = plain_fwd
            fns["kernel_fwd"] = kernel_fwd
            if bwd_cfg is not None and hasattr(bb, "backward") and bwd_be not in ("torch",):
                fns["plain_all"] = plain_all
        if flex_fn is not None:
            try:
                block_mask, score_mod = flex_mods(name, kw)
                qf, kf, vf = (x.detach().clone().requires_grad_() for x in (q, k, v))

                def flex_fwd(block_mask=block_mask, score_mod=score_mod):
                    with torch.no_grad():
                        flex_fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

                def flex_all(block_mask=block_mask, score_mod=score_mod, qf=qf, kf=kf, vf=vf):
                    o = flex_fn(qf, kf, vf, score_mod=score_mod, block_mask=block_mask, scale=scale)
                    torch.autograd.grad(o, (qf, kf, vf), dout)

                fns.update(flex_fwd=flex_fwd, flex_all=flex_all)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: FlexAttention failed: {type(exc).__name__}: {str(exc)[:200]}")
        qc, kc, vc = (x.detach().clone().requires_grad_() for x in (q, k, v))

        def cudnn_fwd():
            with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

        def cudnn_all(qc=qc, kc=kc, vc=vc):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)
            torch.autograd.grad(o, (qc, kc, vc), dout)

        fns.update(cudnn_fwd=cudnn_fwd, cudnn_all=cudnn_all)
        ok = {}
        for fname, fn in list(fns.items()):
            try:
                fn()
                ok[fname] = fn
            except Exception as exc:  # noqa: BLE001 - reported, left out of the timing
                print(f"  {name}: {fname} failed: {type(exc).__name__}: {str(exc)[:300]}")
        ms = time_alternating(ok, args.rounds, args.reps, lead_ms=args.lead_ms)
        plain_flops = {"plain_fwd": flops_plain_fwd, "plain_all": flops_plain_all,
                       "cudnn_fwd": flops_plain_fwd, "cudnn_all": flops_plain_all}
        tf = {x: (plain_flops.get(x) or (flops_fwd if x.endswith("fwd") else flops_all))
              / (t * 1e-3) / 1e12 for x, t in ms.items()}

        def cell(x):
            return f"{tf[x]:.0f}" if x in tf else "-"

        def ratio(a, c):
            return tf[a] / tf[c] if a in tf and c in tf else None

        print(f"\n{name}: forward {fwd_be}:{fwd_cfg} ({sel_f.source}); backward "
              f"{bwd_be}:{bwd_cfg} ({sel_b.source})")
        print(f"  ours fwd {cell('ours_fwd')}, fwd+bwd {cell('ours_all')} | flex {cell('flex_fwd')}"
              f", {cell('flex_all')} | own plain causal {cell('plain_fwd')}, {cell('plain_all')}"
              f" | cuDNN plain causal {cell('cudnn_fwd')}, {cell('cudnn_all')}")
        r = ratio("kernel_fwd", "plain_fwd")
        if r is not None:  # the call path left out: the same backend call on both problems
            print(f"  forward kernel called directly {cell('kernel_fwd')}: {r:.2f}x own plain causal")
        for what, a, c, target in (("fwd vs flex", "ours_fwd", "flex_fwd", 1.0),
                                   ("fwd+bwd vs flex", "ours_all", "flex_all", 1.0),
                                   ("fwd vs own plain causal", "ours_fwd", "plain_fwd", 0.9),
                                   ("fwd+bwd vs own plain causal", "ours_all", "plain_all", 0.9)):
            r = ratio(a, c)
            if r is None:
                print(f"  {what}: not measured")
                continue
            met = r >= target
            print(f"  {what}: {r:.2f} (target {target:.1f}: {'met' if met else 'MISSED'})")
            if not met:
                missed.append(f"{name} {what} {r:.2f}")
    if missed:
        print("\ntargets missed: " + "; ".join(missed))
        return 1
    print("\nevery target met")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Packed variable-length attention (``sparktune.varlen_attention``) against PyTorch SDPA, measured
in this run, round-robin; TFLOP/s of the visible area (4 * H * D * sum of each sequence's
visible query-key pairs; backward 2.5x the forward, forward+backward 3.5x).

Two comparisons, the targets of the features issue:
- equal lengths: 8 sequences of 2048 packed, against SDPA on the same tokens as one (8, H, 2048,
  D) batch, the ideal a varlen kernel can reach (target: at least 0.9x, forward and
  forward+backward);
- 50% padding: 8 sequences whose lengths sum to half of 8 x 2048 (drawn at random, seeded),
  packed, against SDPA on the padded (8, H, 2048, D) batch with a boolean mask of the valid keys
  (causal and padding), what code without varlen runs (target: at least 1.3x).

    python bench/varlen.py                       # bf16, 16 heads of 128, causal
    python bench/varlen.py --heads 12 --head-dim 64 --dtype float16

Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from common import seconds_per_call


def _lengths_half_padded(batch: int, max_len: int, gen: torch.Generator) -> list[int]:
    """``batch`` lengths in [1, max_len] summing to batch * max_len / 2."""
    target = batch * max_len // 2
    w = torch.rand(batch, generator=gen) + 0.25
    lens = [max(1, min(max_len, int(x))) for x in (w / w.sum() * target).tolist()]
    i = 0
    while sum(lens) != target:  # fix the rounding one token at a time
        step = 1 if sum(lens) < target else -1
        if 1 <= lens[i % batch] + step <= max_len:
            lens[i % batch] += step
        i += 1
    return lens


def _visible_pairs(lens: list[int], causal: bool) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default=None, help="force a sparktune backend (default: dispatch)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time, forward only: the Triton varlen kernel called below the API "
                         "(no checks, no dispatch), and (equal lengths) sparktune.attention on the "
                         "unpacked batch with the same backend")
    ap.add_argument("--config", default=None, help="with --breakdown: the Triton forward config "
                    "of the kernel-only column (default: the backend's default)")
    ap.add_argument("--spark-configs", default="",
                    help="with --breakdown: also time these spark forward kernels (comma-separated "
                         "names, family 90) through varlen_attention(backend='spark', config=...)")
    args = ap.parse_args(argv)

    import sparktune

    dtype = getattr(torch, args.dtype)
    h, d, causal = args.heads, args.head_dim, bool(args.causal)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.dtype}, {h} heads of "
          f"{d}, causal {int(causal)}; TFLOP/s of the visible area, best of {args.rounds} rounds; "
          f"sparktune backend: {args.backend or 'dispatch'}")
    ok = True
    for case, lens, target in (("equal lengths", [args.max_len] * args.batch, 0.9),
                               ("50% padding", _lengths_half_padded(args.batch, args.max_len, gen), 1.3)):
        total, n_max = sum(lens), max(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
        q, k, v, do = (torch.randn(total, h, d, device="cuda", dtype=dtype) for _ in range(4))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        # SDPA: the same sequences as a (batch, H, max_len, D) batch, padded where shorter
        pad = torch.zeros(args.batch, h, args.max_len, d, device="cuda", dtype=dtype)
        qb, kb, vb, dob = (pad.clone() for _ in range(4))
        for b, (s, n) in enumerate(zip(cu.tolist()[:-1], lens, strict=True)):
            for dst, src in ((qb, q), (kb, k), (vb, v), (dob, do)):
                dst[b, :, :n] = src[s:s + n].transpose(0, 1)
        qbg, kbg, vbg = (t.clone().requires_grad_() for t in (qb, kb, vb))
        if case == "equal lengths":
            def sdpa_fwd():
                return F.scaled_dot_product_attention(qbg, kbg, vbg, is_causal=causal)
        else:
            valid = torch.arange(args.max_len, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None]
            mask = valid[:, None, None, :] & valid[:, None, :, None]
            if causal:
                mask = mask & torch.ones(args.max_len, args.max_len, dtype=torch.bool, device="cuda").tril()
            mask = mask | ~valid[:, None, :, None]  # padded query rows see every key (no NaN)

            def sdpa_fwd():
                return F.scaled_dot_product_attention(qbg, kbg, vbg, attn_mask=mask)

        def ours_fwd():
            return sparktune.varlen_attention(qg, kg, vg, cu, cu, n_max, n_max, causal=causal,
                                              backend=args.backend)

        def fb(fwd, dout):
            def run():
                o = fwd()
                torch.autograd.backward(o, dout)
            return run

        def fo(fwd):
            def run():
                with torch.no_grad():
                    fwd()
            return run

        cands = {"ours fwd": fo(ours_fwd), "sdpa fwd": fo(sdpa_fwd),
                 "ours fwd+bwd": fb(ours_fwd, do), "sdpa fwd+bwd": fb(sdpa_fwd, dob)}
        if args.breakdown:
            cands.update(_breakdown(args, case, q, k, v, cu, n_max, qb, kb, vb, causal))
        flops = 4 * h * d * _visible_pairs(lens, causal)
        best = {c: math.inf for c in cands}
        for _ in range(args.rounds):
            for c, fn in cands.items():
                best[c] = min(best[c], seconds_per_call(fn))
        tf = {c: flops * (3.5 if "bwd" in c else 1.0) / t / 1e12 for c, t in best.items()}
        print(f"{case}: lengths {lens} ({total} tokens)")
        for part in ("fwd", "fwd+bwd"):
            ratio = tf[f"ours {part}"] / tf[f"sdpa {part}"]
            met = ratio >= target
            ok &= met
            print(f"  {part:>7}: sparktune {tf[f'ours {part}']:.0f}  sdpa {tf[f'sdpa {part}']:.0f}  "
                  f"ratio {ratio:.2f} (target {target}: {'met' if met else 'MISSED'})", flush=True)
        for c in cands:
            if c.startswith("breakdown"):
                print(f"  {c}: {tf[c]:.0f} ({best[c] * 1e3:.3f} ms)")
        if args.breakdown:
            print(f"  (ours fwd: {best['ours fwd'] * 1e3:.3f} ms; sdpa fwd: {best['sdpa fwd'] * 1e3:.3f} ms)")
    return 0 if ok else 1


def _breakdown(args, case, q, k, v, cu, n_max, qb, kb, vb, causal) -> dict:
    """Forward-only candidates that separate the varlen kernel from the API's host path."""
    import sparktune
    from sparktune.kernels import triton_attn
    from sparktune.kernels.triton_space import default_config_name
    from sparktune.problem import DeviceInfo, Problem

    d = q.shape[-1]
    problem = Problem("fwd", args.dtype, args.batch, q.shape[1], k.shape[1], n_max, n_max, d, causal)
    cfg = args.config or default_config_name(problem, DeviceInfo.from_torch("cuda"))
    out = torch.empty_like(q)
    scale = d ** -0.5

    def kernel_only():
        triton_attn.attention_forward(q, k, v, out, config=cfg, causal=causal, scale=scale,
                                      cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n_max,
                                      max_seqlen_k=n_max)

    cands = {f"breakdown kernel only ({cfg})": kernel_only}
    for name in filter(None, args.spark_configs.split(",")):
        def spark(name=name):
            with torch.no_grad():
                sparktune.varlen_attention(q, k, v, cu, cu, n_max, n_max, causal=causal,
                                           backend="spark", config=name)

        cands[f"breakdown spark {name}"] = spark
    if case == "equal lengths":
        backend = args.backend or "triton"

        def dense():
            with torch.no_grad():
                sparktune.attention(qb, kb, vb, causal=causal, backend=backend)

        cands[f"breakdown {backend} on the unpacked batch"] = dense
    return cands


if __name__ == "__main__":
    raise SystemExit(main())

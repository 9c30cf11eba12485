"""Decode bandwidth: GB/s of K and V read per decode step, sparktune's split-KV Triton kernels
(contiguous and paged caches) against PyTorch SDPA on the sliced contiguous cache, in one run.

Shapes: batch 1, 8, 64 x cache length 1k, 8k, 32k, 128k (where memory allows), head dim 128,
GQA 32:8, Nq = 1, bfloat16; every sequence at the full cache length. For each shape the configs
of ``--configs`` (default: ``triton_decode_space.BENCH_SPACE``) are timed once to pick the best
for the contiguous and the paged cache; then ``--rounds`` alternating rounds time SDPA, ours
contiguous and ours paged, and what a user's call gets with no backend named (dispatch: a
tuning record, shipped or the user's, else the default order), contiguous and paged (the
median of the rounds is reported). Bandwidth counts the K and V
bytes of the valid cache: ``2 * B * Hkv * L * D * 2``. Every candidate (SDPA too) is timed as a
CUDA graph replay by default, as serving engines run decode steps (the decode path has no host
sync and no host read of the lengths, so it captures); ``--eager`` times eager calls instead,
host launch cost included.

Targets (issue 18): ours >= 3400 GB/s at every batch with cache >= 8k; ours never below SDPA
(``--sdpa-slack``, default 0.97, allows timing noise), the dispatched calls included; paged
within 10% of contiguous. Exits 1 when one is missed.

    PYTHONPATH=/tmp/site:$PWD python3 bench/decode_bandwidth.py [--out $OUT/decode_bw.txt]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

import sparktune
from sparktune import _kvcache as _kv
from sparktune.kernels import triton_decode_space as space

TARGET_GBS = 3400.0


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def graphed(fn):
    """``fn`` captured in a CUDA graph (as serving engines run decode steps: no host work per
    step); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def timed(fn, graph: bool) -> float:
    return bench_ms(graphed(fn) if graph else fn)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--cache-lens", default="1024,8192,32768,131072")
    ap.add_argument("--heads", default="32,8", help="Hq,Hkv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--configs", default=",".join(space.BENCH_SPACE))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sdpa-slack", type=float, default=0.97)
    ap.add_argument("--out", default="")
    ap.add_argument("--eager", action="store_true",
                    help="time eager calls (host launch cost included) instead of CUDA graphs")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch the decode kernels in plain stream order, without programmatic "
                         "dependent launch (triton_decode.PDL; for an A/B)")
    args = ap.parse_args()
    if args.no_pdl:
        from sparktune.kernels import triton_decode

        triton_decode.PDL = False
    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    hq, hkv = (int(x) for x in args.heads.split(","))
    d = args.head_dim
    configs = args.configs.split(",")
    lines: list[str] = []

    def out(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    out(f"# {torch.cuda.get_device_name(dev)}, {args.dtype}, hd {d}, GQA {hq}:{hkv}, Nq 1, "
        f"page {args.page_size}, {'eager calls' if args.eager else 'CUDA graphs (all three)'}, "
        f"{'plain stream order' if args.no_pdl else 'PDL where the GPU has it'}")
    out(f"{'batch':>5} {'cache':>7} {'sdpa':>7} {'ours':>7} {'paged':>7} {'ours/sdpa':>9} "
        f"{'paged/ours':>10} {'disp':>7} {'disp_pg':>7} {'disp/sdpa':>9}  "
        f"best (contiguous | paged); dispatch's choice (contiguous | paged)")
    missed: list[str] = []
    for batch in (int(x) for x in args.batches.split(",")):
        for n in (int(x) for x in args.cache_lens.split(",")):
            torch.cuda.empty_cache()
            try:
                kc = torch.randn(batch, n, hkv, d, device=dev, dtype=dtype)
                vc = torch.randn_like(kc)
                ps = args.page_size
                blocks_per = -(-n // ps)
                perm = torch.randperm(batch * blocks_per, device=dev).to(torch.int32)
                table = perm.view(batch, blocks_per)
                kp = torch.empty(batch * blocks_per, ps, hkv, d, device=dev, dtype=dtype)
                vp = torch.empty_like(kp)
                # the same contents, paged: page table[b, i] holds keys i*ps .. of sequence b
                for b in range(batch):
                    kp[table[b].long()] = kc[b].view(blocks_per, ps, hkv, d)
                    vp[table[b].long()] = vc[b].view(blocks_per, ps, hkv, d)
            except torch.cuda.OutOfMemoryError:
                out(f"{batch:>5} {n:>7}  (out of memory: skipped)")
                continue
            q = torch.randn(batch, 1, hq, d, device=dev, dtype=dtype)
            lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

            def sdpa(qt=qt, kt=kt, vt=vt):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

            def ours(cfg, q=q, kc=kc, vc=vc, lens=lens):
                return lambda: sparktune.attention_with_kvcache(
                    q, kc, vc, cache_seqlens=lens, backend="triton", config=cfg)

            def paged(cfg, q=q, kp=kp, vp=vp, lens=lens, table=table):
                return lambda: sparktune.attention_with_kvcache(
                    q, kp, vp, cache_seqlens=lens, block_table=table, backend="triton",
                    config=cfg)

            def disp(q=q, kc=kc, vc=vc, lens=lens):
                return sparktune.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)

            def disp_paged(q=q, kp=kp, vp=vp, lens=lens, table=table):
                return sparktune.attention_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                        block_table=table)

            ref = sdpa().transpose(1, 2)
            choice = [_kv.choose_decode(_kv.check_kvcache(q, ck, cv, cache_seqlens=lens,
                                                          block_table=t).key, dev)
                      for ck, cv, t in ((kc, vc, None), (kp, vp, table))]
            graph = not args.eager
            best_c = min(configs, key=lambda c: timed(ours(c), graph))
            best_p = min(configs, key=lambda c: timed(paged(c), graph))
            for name, fn in (("contiguous", ours(best_c)), ("paged", paged(best_p)),
                             ("dispatch", disp), ("dispatch paged", disp_paged)):
                err = (fn().float() - ref.float()).abs().max().item()
                if err > 2e-2:
                    missed.append(f"b{batch} n{n}: {name} output differs from SDPA by {err:.3g}")
            times: dict[str, list[float]] = {"sdpa": [], "ours": [], "paged": [], "disp": [],
                                             "disp_pg": []}
            for _ in range(args.rounds):
                times["sdpa"].append(timed(sdpa, graph))
                times["ours"].append(timed(ours(best_c), graph))
                times["paged"].append(timed(paged(best_p), graph))
                times["disp"].append(timed(disp, graph))
                times["disp_pg"].append(timed(disp_paged, graph))
            gbytes = 2.0 * batch * hkv * n * d * kc.element_size() / 1e9
            bw = {k: gbytes / (statistics.median(v) * 1e-3) for k, v in times.items()}
            r_sdpa = bw["ours"] / bw["sdpa"]
            r_paged = bw["paged"] / bw["ours"]
            r_disp = min(bw["disp"], bw["disp_pg"]) / bw["sdpa"]
            out(f"{batch:>5} {n:>7} {bw['sdpa']:>7.0f} {bw['ours']:>7.0f} {bw['paged']:>7.0f} "
                f"{r_sdpa:>9.2f} {r_paged:>10.2f} {bw['disp']:>7.0f} {bw['disp_pg']:>7.0f} "
                f"{r_disp:>9.2f}  {best_c} | {best_p}; dispatch "
                f"{' | '.join(f'{c.config or c.backend} ({c.source})' for c in choice)}")
            if n >= 8192 and min(bw["ours"], bw["paged"]) < TARGET_GBS:
                missed.append(f"b{batch} n{n}: {min(bw['ours'], bw['paged']):.0f} GB/s < {TARGET_GBS:.0f}")
            if r_sdpa < args.sdpa_slack or bw["paged"] / bw["sdpa"] < args.sdpa_slack:
                missed.append(f"b{batch} n{n}: below SDPA (ours {r_sdpa:.2f}x, paged "
                              f"{bw['paged'] / bw['sdpa']:.2f}x)")
            if r_disp < args.sdpa_slack:
                missed.append(f"b{batch} n{n}: dispatch below SDPA (contiguous "
                              f"{bw['disp'] / bw['sdpa']:.2f}x, paged "
                              f"{bw['disp_pg'] / bw['sdpa']:.2f}x)")
            if r_paged < 0.9:
                missed.append(f"b{batch} n{n}: paged {r_paged:.2f}x of contiguous (< 0.90)")
            # drop this shape's tensors (the closures hold them too) before the next one
            kc = vc = kp = vp = qt = kt = vt = ref = sdpa = ours = paged = disp = disp_paged = None
    out("targets: " + ("all met" if not missed else "MISSED"))
    for m in missed:
        out("  " + m)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

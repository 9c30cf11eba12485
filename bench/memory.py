"""Peak GPU memory of forward+backward: sparktune.attention (each backend forced, and dispatch)
against plain PyTorch attention (matmul, softmax, matmul), batch 1, 12 heads, fp16.

    python bench/memory.py
    python bench/memory.py --seqlens 4096,8192,16384 --head-dim 128

Peak is torch.cuda.max_memory_allocated() during one forward+backward, minus the bytes allocated
before it (q, k, v, dout and nothing else), so it counts what attention itself needs: the
output, the saved statistics, workspaces, gradients and, for plain attention, the N^2 scores.
"""

from __future__ import annotations

import argparse

import torch


def plain(q, k, v, causal):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def peak_bytes(fn, q, k, v, dout) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out, grads
    return peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--causal", type=int, default=0)
    args = ap.parse_args(argv)

    import sparktune

    causal = bool(args.causal)
    d, h = args.head_dim, args.heads
    runs = {
        "sparktune (dispatch)": lambda q, k, v: sparktune.attention(q, k, v, causal=causal),
        "sparktune spark": lambda q, k, v: sparktune.attention(q, k, v, causal=causal, backend="spark"),
        "sparktune triton": lambda q, k, v: sparktune.attention(q, k, v, causal=causal, backend="triton"),
        "plain PyTorch": lambda q, k, v: plain(q, k, v, causal),
    }
    print(f"# peak bytes of one forward+backward beyond q, k, v, dout; batch 1, {h} heads, "
          f"hd {d}, causal {int(causal)}, fp16; {torch.cuda.get_device_name()}")
    print(f"{'seqlen':>6} | {'inputs MiB':>10} | " + " | ".join(f"{n:>20}" for n in runs))
    for n in [int(x) for x in args.seqlens.split(",")]:
        q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.float16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        inputs = 4 * q.numel() * q.element_size()
        cells = []
        for _name, fn in runs.items():
            try:
                cells.append(f"{peak_bytes(fn, q, k, v, dout) / 2**20:17.1f} MiB")
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run is reported
                cells.append(f"{type(exc).__name__:>20}")
            torch.cuda.empty_cache()
        print(f"{n:>6} | {inputs / 2**20:10.1f} | " + " | ".join(f"{c:>20}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

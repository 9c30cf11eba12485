#!/usr/bin/env python3
"""Issue 7's targets, as ratios measured in one `sparktune bench --json` run.

    python tools/bench_summary.py bench.json

Prints, per op: own / flash (min, geometric mean), dispatch / the fastest candidate (min, and
the shapes below 0.97), and forward+backward at seqlen 8192 against plain attention.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict


def main(argv: list[str]) -> int:
    data = json.load(open(argv[0]))
    by_shape: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in data["results"]:
        if r["status"] != "ok":
            continue
        key = (r["dtype"], r["op"], r["head_dim"], r["causal"], r["seqlen"])
        by_shape[key][r["candidate"]] = r["tflops"]
    ops = sorted({k[:2] for k in by_shape})
    for dtype, op in ops:
        keys = sorted(k for k in by_shape if k[:2] == (dtype, op))
        own = [by_shape[k]["own"] / by_shape[k]["flash"] for k in keys
               if "own" in by_shape[k] and "flash" in by_shape[k]]
        disp = []
        low = []
        for k in keys:
            c = by_shape[k]
            if "dispatch" not in c:
                continue
            best_name = max(c, key=c.get)
            ratio = c["dispatch"] / c[best_name]
            disp.append(ratio)
            if ratio < 0.97:
                low.append(f"hd{k[2]} causal={int(k[3])} n={k[4]}: {ratio:.3f} (fastest {best_name})")
        gm = math.exp(sum(map(math.log, own)) / len(own)) if own else float("nan")
        print(f"{dtype} {op}: own/flash min {min(own, default=float('nan')):.3f} geomean {gm:.3f} over "
              f"{len(own)} shapes; dispatch/fastest min {min(disp, default=float('nan')):.3f}, {len(low)} "
              f"of {len(disp)} below 0.97")
        for line in low:
            print(f"    {line}")
        vs_flash = [(by_shape[k]["dispatch"] / by_shape[k]["flash"], k) for k in keys
                    if "dispatch" in by_shape[k] and "flash" in by_shape[k]]
        below = [f"hd{k[2]} causal={int(k[3])} n={k[4]}: {r:.3f}" for r, k in vs_flash if r < 1.0]
        print(f"    dispatch/flash min {min((r for r, _ in vs_flash), default=float('nan')):.3f}, "
              f"{len(below)} of {len(vs_flash)} below 1.0" + ("".join(f"\n      {b}" for b in below)))
        if op == "fwd+bwd":
            for k in keys:
                c = by_shape[k]
                if k[4] == 8192 and "plain" in c:
                    print(f"    n=8192 hd{k[2]} causal={int(k[3])}: dispatch/plain {c['dispatch'] / c['plain']:.2f}, "
                          f"own/plain {c['own'] / c['plain']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

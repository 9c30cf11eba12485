#!/usr/bin/env python3
"""Summarise Nsight Compute's SASS source page (``ncu --import R --page source --print-source
sass --csv``): the lines with the most warp-stall samples, and the samples summed by stall
reason and by opcode. Usage: ncu_top_stalls.py FILE.csv [--top N]"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import Counter


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args(argv)
    text = open(args.csv, encoding="utf-8", errors="replace").read()
    # the CSV starts at its header line (ncu may print notes before it)
    start = text.find('"Address"')
    if start < 0:
        start = text.find('"#"')
    rows = list(csv.DictReader(io.StringIO(text[max(start, 0):])))
    if not rows:
        print("no rows")
        return 1
    cols = list(rows[0].keys())
    total_col = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
    src_col = next((c for c in cols if c == "Source"), cols[1])
    addr_col = next((c for c in cols if c == "Address"), cols[0])
    # one column per stall reason, with and without "(Not Issued)"
    reason_cols = [c for c in cols if c.startswith("stall_")]
    print("columns:", ", ".join(cols[:60]))

    def num(v):
        try:
            return float(str(v).replace(",", ""))
        except ValueError:
            return 0.0

    if total_col is None:
        print("no warp-stall column")
        return 1
    total = sum(num(r[total_col]) for r in rows) or 1.0
    print(f"samples: {total:.0f}")
    by_op: Counter = Counter()
    for r in rows:
        op = r[src_col].strip().split(" ")[0] if r[src_col].strip() else "?"
        if op.startswith("@"):
            op = r[src_col].strip().split(" ")[1] if len(r[src_col].split()) > 1 else op
        by_op[op.split(".")[0]] += num(r[total_col])
    print("by opcode:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(15)))
    by_reason: Counter = Counter()
    for c in reason_cols:
        by_reason[c] = sum(num(r[c]) for r in rows)
    if by_reason:
        print("by reason:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(12) if v))
    print(f"top {args.top} lines (share of samples, address, SASS, largest reasons):")
    for r in sorted(rows, key=lambda r: -num(r[total_col]))[: args.top]:
        reasons = sorted(((num(r[c]), c) for c in reason_cols), reverse=True)[:3]
        rs = " ".join(f"{c.replace('stall_', '')}={100 * v / total:.1f}" for v, c in reasons if v)
        print(f"{100 * num(r[total_col]) / total:5.1f}%  {r[addr_col]:>6}  {r[src_col].strip()[:90]:90s} {rs}")
    exc_col = next((c for c in cols if c == "L1 Wavefronts Shared Excessive"), None)
    if exc_col:
        exc = sorted(rows, key=lambda r: -num(r[exc_col]))
        tot = sum(num(r[exc_col]) for r in rows)
        print(f"shared-memory wavefronts beyond the ideal: {tot:.0f}; the lines with most:")
        for r in exc[:12]:
            if num(r[exc_col]) <= 0:
                break
            print(f"{num(r[exc_col]):12.0f}  {r[addr_col]:>6}  {r[src_col].strip()[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

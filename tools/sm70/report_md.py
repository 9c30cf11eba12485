#!/usr/bin/env python3
"""Markdown tables from a ``tools/check_sm70.py --json`` report: the sm_70 compile report, the
V100 occupancy ranking per head dim and the proposed Volta heuristic defaults.

Usage: report_md.py REPORT.json [--update docs/VOLTA.md]

With --update, the text between ``<!-- sm70-report:begin -->`` and ``<!-- sm70-report:end -->``
in that file is replaced; otherwise the tables go to stdout.

The defaults are a model, not a measurement (no V100 has run them). The model, per head dim,
over the kernels that passed with fp32 accumulation (the dispatcher's default accumulation):

1. latency hiding: at least 8 resident warps per SM (two per scheduler), else as many as any
   candidate reaches;
2. then the fewest global (L2) bytes per FMA: every row block streams all of K and V, so the
   K/V traffic per FMA falls as 1/block_m;
3. then the fewest shared-memory operand bytes per FMA in the two products: on Volta the
   operands reach registers through plain shared-memory loads, and a warp's four quadpairs
   each load their own copy of the B operand (see ``smem_bytes_per_fma``);
4. then occupancy, then the name (stable).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

BEGIN, END = "<!-- sm70-report:begin -->", "<!-- sm70-report:end -->"
MIN_WARPS = 8


def smem_bytes_per_fma(p: dict) -> float:
    """Shared-memory operand bytes a warp loads per FMA in S = QK^T and O = PV together.

    A warp of the Volta tiled MMA covers (block_m / warps_m) rows and, per product, its share
    of the columns. For one k-step of 4, a thread loads 8 bytes of A for every 32 rows of its
    warp tile and 8 bytes of B for every 8 columns (each quadpair holds its own B), and the
    warp does rows * cols * 4 FMAs.
    """
    rows = p["block_m"] / p["warps_m"]
    total_bytes, total_fma = 0.0, 0.0
    for cols, k in ((p["block_n"] / p["warps_n"], p["head_dim"]),
                    (p["head_dim"] / p["warps_n"], p["block_n"])):
        steps = k / 4
        total_bytes += steps * 32 * 8 * (rows / 32 + cols / 8)
        total_fma += steps * rows * cols * 4
    return total_bytes / total_fma


def kv_bytes_per_fma(p: dict) -> float:
    """Global K/V bytes per FMA of a block: 2 * block_n * d * 2 B for 2 * block_m * block_n * d."""
    return 2.0 / p["block_m"]


def config_key(p: dict) -> tuple:
    return (p["block_m"], p["block_n"], p["warps_m"], p["warps_n"])


def rank(kernels: list[dict], head_dim: int) -> list[dict]:
    cands = [k for k in kernels if k["passed"] and k["params"].get("head_dim") == head_dim
             and k["params"].get("accum") == 32 and k["params"].get("op") == "fwd"]
    if not cands:
        return []
    best_warps = max(k["occupancy"]["warps_per_sm"] for k in cands)
    floor = min(MIN_WARPS, best_warps)

    def score(k):
        p = k["params"]
        return (k["occupancy"]["warps_per_sm"] < floor, kv_bytes_per_fma(p),
                round(smem_bytes_per_fma(p), 4), -k["occupancy"]["occupancy"], k["name"])

    return sorted(cands, key=score)


def rule_cell(k: dict) -> str:
    """The Volta register rule's estimate and limit for a kernel ("?" when the report has none)."""
    est, limit = k.get("reg_estimate"), k.get("reg_limit")
    return "?" if est is None or limit is None else f"{est} / {limit}"


def report_table(rep: dict) -> list[str]:
    out = ["| kernel | regs (rule) | regs | spill st/ld | stack | smem static | smem dyn | "
           "mma.m8n8k4 (PTX) | HMMA.884 (SASS) | blocks/SM | occupancy | limited by | result |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for k in rep["kernels"]:
        occ = k.get("occupancy") or {}
        res = "PASS" if k["passed"] else "FAIL: " + "; ".join(k["reasons"])
        hmma = "n/a" if k["sass_hmma"] is None else k["sass_hmma"]
        out.append(
            f"| `{k['name']}` | {rule_cell(k)} | "
            f"{k['registers']} | {k['spill_stores']}/{k['spill_loads']} | {k['stack_frame']} | "
            f"{k['static_smem']} | {k['dynamic_smem']} | {k['ptx_mma']} | {hmma} | "
            f"{occ.get('blocks_per_sm', '?')} | {occ.get('occupancy', 0):.1%} | "
            f"{occ.get('limited_by', '?')} | {res} |")
    return out


def ranking_tables(rep: dict) -> tuple[list[str], dict[int, dict]]:
    head_dims = sorted({k["params"]["head_dim"] for k in rep["kernels"] if k["params"]})
    out, picks = [], {}
    for d in head_dims:
        ranked = rank(rep["kernels"], d)
        if not ranked:
            continue
        picks[d] = ranked[0]
        out += [f"**head dim {d}** (fp32 accumulation, passing kernels, best first)", "",
                "| # | block_m x block_n | warps | threads | regs | smem | blocks/SM | warps/SM | "
                "occupancy | K/V B per FMA | smem B per FMA |",
                "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for i, k in enumerate(ranked, 1):
            p, occ = k["params"], k["occupancy"]
            out.append(
                f"| {i} | {p['block_m']}x{p['block_n']} | {p['warps_m']}x{p['warps_n']} | "
                f"{k['threads']} | {k['registers']} | {k['static_smem'] + k['dynamic_smem']} | "
                f"{occ['blocks_per_sm']} | {occ['warps_per_sm']} | {occ['occupancy']:.1%} | "
                f"{kv_bytes_per_fma(p):.4f} | {smem_bytes_per_fma(p):.3f} |")
        out.append("")
    return out, picks


def defaults_table(picks: dict[int, dict]) -> list[str]:
    out = ["| head dim | proposed default (model) | block_m, block_n, warps_m, warps_n | "
           "regs | blocks/SM | occupancy |", "|---:|---|---|---:|---:|---:|"]
    for d, k in sorted(picks.items()):
        p = k["params"]
        out.append(f"| {d} | `{k['name']}` | {', '.join(map(str, config_key(p)))} | "
                   f"{k['registers']} | {k['occupancy']['blocks_per_sm']} | "
                   f"{k['occupancy']['occupancy']:.1%} |")
    return out


def render(rep: dict) -> str:
    tc = rep.get("toolchain", {})
    n_pass, n_fail = rep["passed"], rep["failed"]
    def show(v):
        return ", ".join(map(str, v)) if isinstance(v, list) else str(v)

    src = rep.get("source", {})
    lines = [f"Kernels: `csrc/` of commit `{src.get('git_head', '?')}`. "
             f"Toolchain: {'; '.join(f'{k} {show(v)}' for k, v in tc.items() if v)}.", "",
             f"**{n_pass} passed, {n_fail} failed**; {len(rep.get('excluded', []))} declared "
             "configurations excluded by the C++ rules.", ""]
    lines += report_table(rep) + [""]
    reasons: dict[str, list[dict]] = {}
    for e in rep.get("excluded", []):
        reasons.setdefault(e["reason"], []).append(e)
    if reasons:
        lines += ["Excluded by the rules (not compiled):", ""]
        for why, es in sorted(reasons.items()):
            lines.append(f"- {len(es)}: {why}")
            if "register budget" in why:
                lines += [f"  - `{e['name']}`: {rule_cell(e)}" for e in es]
        lines.append("")
    failed: dict[str, list[str]] = {}
    for k in rep["kernels"]:
        for why in k["reasons"]:
            kind = re.sub(r"\d+", "N", why.split(":")[0] if why.startswith("build") else why)
            failed.setdefault(kind, []).append(k["name"])
    if failed:
        lines += ["Failures by reason:", ""]
        lines += [f"- {kind}: {len(names)} ({', '.join(f'`{n}`' for n in names)})"
                  for kind, names in sorted(failed.items())] + [""]
    ranking, picks = ranking_tables(rep)
    lines += ["### Occupancy ranking on a V100 (model)", ""] + ranking
    lines += ["### Proposed Volta defaults (a model, not a measurement)", ""]
    lines += defaults_table(picks) + [""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--update", help="markdown file with the begin/end markers to rewrite")
    args = ap.parse_args()
    rep = json.loads(Path(args.report).read_text())
    text = render(rep)
    if not args.update:
        print(text)
        return 0
    doc = Path(args.update)
    body = doc.read_text()
    pat = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pat.search(body):
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} markers")
    doc.write_text(pat.sub(lambda _m: f"{BEGIN}\n{text}\n{END}", body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

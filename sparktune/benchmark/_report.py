"""The terminal table, the CSV file and the grouped list of candidates that did not run."""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ._candidates import CANDIDATES, TITLES
from ._sweep import BenchReport, BenchRow

__all__ = ["CSV_FIELDS", "issues", "render_table", "write_csv"]

#: the CSV columns, one row per shape, op and candidate
CSV_FIELDS: tuple[str, ...] = (
    "dtype", "op", "head_dim", "causal", "seqlen", "seqlen_k", "batch", "heads", "heads_kv",
    "candidate", "kernel", "status", "reason", "median_ms", "q1_ms", "q3_ms", "min_ms", "runs",
    "tflops", "baseline", "speedup", "peak_mem_bytes", "input_bytes", "error", "error_limit", "flops",
    "passes",
)

_CELL = {"wrong": "WRONG", "failed": "FAIL", "unavailable": "n/a", "skipped": "skip", "not run": "-"}


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def write_csv(report: BenchReport, path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in report.rows:
            w.writerow([_csv_value(getattr(r, k)) for k in CSV_FIELDS])


# --------------------------------------------------------------------------- grouping


def _ordered(values: Iterable[Any]) -> list[Any]:
    return sorted(set(values), key=lambda x: (str(type(x)), x))


def _cases_text(rows: list[BenchRow], of_candidate: int) -> str:
    if len(rows) == of_candidate:
        return f"every case ({len(rows)})"

    def yn(c: bool) -> str:
        return "yes" if c else "no"

    parts = [
        "op " + ", ".join(sorted({r.op for r in rows}, key=["fwd", "bwd", "fwd+bwd"].index)),
        "dtype " + ", ".join(_ordered(r.dtype for r in rows)),
        "hd " + ", ".join(str(x) for x in _ordered(r.head_dim for r in rows)),
        "causal " + ", ".join(yn(x) for x in _ordered(r.causal for r in rows)),
        "seqlen " + ", ".join(str(x) for x in _ordered(r.seqlen for r in rows)),
    ]
    return f"{len(rows)} case(s): " + "; ".join(parts)


def issues(report: BenchReport) -> list[dict[str, Any]]:
    """Candidates (and options of ``own``) that did not give a time, grouped by candidate,
    status and reason: [{candidate, status, reason, count, cases}]."""
    per_candidate: dict[str, int] = {}
    groups: dict[tuple[str, str, str], list[BenchRow]] = {}
    for r in report.rows:
        per_candidate[r.candidate] = per_candidate.get(r.candidate, 0) + 1
        if r.status != "ok":
            groups.setdefault((r.candidate, r.status, r.reason), []).append(r)
        else:
            for t in r.tried:
                if t.get("status") != "ok":
                    name = f"{r.candidate} ({t.get('kernel')})"
                    groups.setdefault((name, str(t.get("status")), str(t.get("reason"))), []).append(r)
    out = []
    for (cand, status, reason), rows in groups.items():
        base = cand.split(" ", 1)[0]
        out.append({
            "candidate": cand,
            "status": status,
            "reason": reason,
            "count": len(rows),
            "cases": _cases_text(rows, per_candidate.get(base, 0)),
        })
    order = {c: i for i, c in enumerate(CANDIDATES)}
    out.sort(key=lambda g: (order.get(g["candidate"].split(" ", 1)[0], 99), g["candidate"], g["status"]))
    return out


# --------------------------------------------------------------------------- the table


def _num(v: float) -> str:
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if v >= 0.1 else f"{v:.3g}"


def _speedup(v: float) -> str:
    return f"{v:.2f}x" if v >= 0.1 else f"{v:.2g}x"


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    m = n / (1 << 20)
    return f"{m:.0f}" if m >= 10 else f"{m:.2g}"


def _grid(header: list[str], rows: list[list[str]], split: int) -> list[str]:
    """Left-aligned text columns with ``|`` after the first ``split`` ones."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        left = "  ".join(c.rjust(w) for c, w in zip(cells[:split], widths[:split], strict=True))
        right = "  ".join(c.ljust(w) for c, w in zip(cells[split:], widths[split:], strict=True))
        return f"  {left} | {right}".rstrip()

    return [line(header)] + [line(r) for r in rows]


def _device_text(meta: dict[str, Any]) -> str:
    d = meta.get("device") or {}
    if d.get("type") == "cuda":
        cap = d.get("capability") or ["?", "?"]
        return f"{d.get('name')} (sm_{cap[0]}{cap[1]})"
    return f"CPU ({d.get('name', '?')})"


def render_table(report: BenchReport) -> str:
    """Per dtype and op: TFLOP/s with the speedup over the baseline, the peak memory, the
    kernels sparktune ran; then what did not run, grouped."""
    meta = report.meta
    settings = meta.get("settings", {})
    baseline = settings.get("baseline")
    present = {r.candidate for r in report.rows}
    cands = [c for c in settings.get("candidates", CANDIDATES) if c in present]
    lines = [
        f"sparktune {meta.get('sparktune', '?')}, torch {meta.get('torch', '?')}, {_device_text(meta)}",
    ]
    groups: dict[tuple[str, str], dict[tuple[Any, ...], dict[str, BenchRow]]] = {}
    for r in report.rows:
        groups.setdefault((r.dtype, r.op), {}).setdefault(r.shape_key, {})[r.candidate] = r
    measured_memory = any(r.peak_mem_bytes is not None for r in report.rows)
    for (dtype, op), shapes in groups.items():
        what = f"TFLOP/s and speedup over {TITLES.get(baseline, baseline)}" if baseline else "TFLOP/s"
        lines += ["", f"{op} {dtype}: {what}"]
        gqa = any(r.heads_kv != r.heads for s in shapes.values() for r in s.values())
        head = ["hd", "causal", "seqlen", "batch", "heads"] + (["kv"] if gqa else [])
        split = len(head)
        body, mem, kern = [], [], []
        for by_cand in shapes.values():
            r0 = next(iter(by_cand.values()))
            key = [str(r0.head_dim), "yes" if r0.causal else "no",
                   str(r0.seqlen) if r0.seqlen == r0.seqlen_k else f"{r0.seqlen}/{r0.seqlen_k}",
                   str(r0.batch), str(r0.heads)] + ([str(r0.heads_kv)] if gqa else [])
            cells, mcells = [], []
            for c in cands:
                r = by_cand.get(c)
                if r is None:
                    cells.append("")
                    mcells.append("")
                elif r.status == "ok" and r.tflops is not None:
                    sp = f" {_speedup(r.speedup)}" if r.speedup is not None else ""
                    cells.append(_num(r.tflops) + sp)
                    mcells.append(_mib(r.peak_mem_bytes))
                else:
                    cells.append(_CELL.get(r.status, r.status))
                    mcells.append(_CELL.get(r.status, r.status) if r.status != "ok" else "-")
            body.append(key + cells)
            mem.append(key + mcells)
            ks = [f"{c}: {by_cand[c].kernel}" for c in ("dispatch", "own") if c in by_cand and by_cand[c].kernel and by_cand[c].status == "ok"]
            if ks:
                kern.append(key + ["; ".join(ks)])
        lines += _grid(head + cands, body, split)
        if measured_memory:
            lines += ["", f"{op} {dtype}: peak memory above the inputs, MiB"]
            lines += _grid(head + cands, mem, split)
        if kern:
            lines += ["", f"{op} {dtype}: kernels sparktune ran"]
            lines += _grid(head + ["kernels"], kern, split)
    if not measured_memory:
        lines += ["", "peak memory: measured on CUDA devices only"]
    problems = issues(report)
    if problems:
        lines += ["", "not timed:"]
        for g in problems:
            lines.append(f"  {g['candidate']} {g['status']} in {g['cases']}: {g['reason']}")
    wall = meta.get("wall_s")
    if wall is not None:
        counts: dict[str, int] = {}
        for r in report.rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in counts.items())
        lines += ["", f"{len(report.rows)} results ({summary}) in {wall:.1f} s"]
    if meta.get("stopped"):
        lines.append(f"stopped: {meta['stopped']}")
    return "\n".join(lines)

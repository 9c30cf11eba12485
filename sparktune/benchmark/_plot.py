"""PNG bar charts of a benchmark report, drawn with matplotlib's Agg canvas (no display).

One PNG per op and dtype; one panel per (head dim, causal) with a row per mask and a column
per head dim; sequence lengths along x, one bar per candidate in each group, TFLOP/s on y with
the value on every bar. matplotlib is optional (the ``plot`` extra) and imported here only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._candidates import CANDIDATES, TITLES
from ._sweep import BenchReport, BenchRow

__all__ = ["MISSING_MATPLOTLIB", "chart_name", "matplotlib_missing", "write_charts"]

MISSING_MATPLOTLIB = (
    "matplotlib is not installed, so no PNG charts are drawn (pip install 'sparktune[plot]'; "
    "`sparktune bench --from-json FILE --out DIR` draws them later from a --json document)"
)
_OP_TITLES = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward + backward"}
#: one colour per candidate, the same in every chart
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#7f7f7f")


def matplotlib_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is None


def chart_name(op: str, dtype: str) -> str:
    return f"bench_{op.replace('+', '_')}_{dtype}.png"


def _label(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def _draw(rows: list[BenchRow], op: str, dtype: str, device: str, candidates: list[str], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    head_dims = sorted({r.head_dim for r in rows})
    masks = sorted({r.causal for r in rows})
    drawn = [c for c in candidates if any(r.candidate == c and r.status == "ok" for r in rows)]
    fig = Figure(figsize=(6.8 * len(head_dims), 4.3 * len(masks) + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(masks), len(head_dims), squeeze=False)
    width = 0.84 / max(1, len(drawn))
    for i, causal in enumerate(masks):
        for j, hd in enumerate(head_dims):
            ax = axes[i][j]
            panel = [r for r in rows if r.head_dim == hd and r.causal == causal]
            ax.set_title(f"{'With' if causal else 'Without'} causal mask, head dim {hd}", fontsize=11)
            if not panel:
                ax.set_axis_off()
                continue
            groups = sorted({(r.seqlen, r.seqlen_k, r.batch, r.heads, r.heads_kv) for r in panel})
            ambiguous = len({g[0] for g in groups}) < len(groups)
            ticks = []
            for g in groups:
                text = str(g[0]) if g[0] == g[1] else f"{g[0]}/{g[1]}"
                ticks.append(f"{text}\nb{g[2]} h{g[3]}" if ambiguous else text)
            top = 0.0
            for k, cand in enumerate(drawn):
                xs, ys = [], []
                for x, g in enumerate(groups):
                    for r in panel:
                        if r.candidate == cand and r.status == "ok" and r.tflops is not None and (
                            r.seqlen, r.seqlen_k, r.batch, r.heads, r.heads_kv
                        ) == g:
                            xs.append(x + (k - (len(drawn) - 1) / 2) * width)
                            ys.append(r.tflops)
                if not xs:
                    continue
                colour = _COLOURS[CANDIDATES.index(cand) % len(_COLOURS)] if cand in CANDIDATES else None
                bars = ax.bar(xs, ys, width * 0.95, color=colour, label=TITLES.get(cand, cand))
                ax.bar_label(
                    bars, labels=[_label(y) for y in ys], fontsize=6 if len(drawn) > 4 else 8,
                    rotation=90 if len(drawn) > 4 else 0, padding=2,
                )
                top = max(top, *ys)
            ax.set_xticks(range(len(groups)), ticks)
            ax.set_xlabel("Sequence length")
            ax.set_ylabel("Speed (TFLOP/s)")
            ax.set_ylim(0, top * 1.22 if top > 0 else 1)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
    height = fig.get_figheight()
    handles = [
        _patch(_COLOURS[CANDIDATES.index(c) % len(_COLOURS)] if c in CANDIDATES else "grey", TITLES.get(c, c))
        for c in drawn
    ]
    if handles:
        fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 4), frameon=False, fontsize=9,
                   bbox_to_anchor=(0.5, 1.0 - 0.3 / height))
    fig.suptitle(f"Attention {_OP_TITLES.get(op, op)} speed, {dtype}, on {device}", fontsize=13, y=1.0 - 0.05 / height)
    rows_of_legend = (len(handles) + 3) // 4
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.35 + 0.22 * rows_of_legend) / height))
    fig.savefig(path, dpi=130)


def _patch(colour: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, label=label)


def _device_name(report: BenchReport) -> str:
    d = report.meta.get("device") or {}
    return str(d.get("name") or "?") if d.get("type") == "cuda" else f"CPU ({d.get('name', '?')})"


def write_charts(report: BenchReport, out_dir: str | Path) -> list[Path]:
    """Draw one PNG per op and dtype under ``out_dir`` (created); returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = report.meta.get("settings", {})
    candidates = [c for c in settings.get("candidates", CANDIDATES)]
    candidates += [c for c in dict.fromkeys(r.candidate for r in report.rows) if c not in candidates]
    groups: dict[tuple[str, str], list[BenchRow]] = {}
    for r in report.rows:
        groups.setdefault((r.op, r.dtype), []).append(r)
    paths = []
    for (op, dtype), rows in groups.items():
        path = out / chart_name(op, dtype)
        _draw(rows, op, dtype, _device_name(report), candidates, path)
        paths.append(path)
    return paths

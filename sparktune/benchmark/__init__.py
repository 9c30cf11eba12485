"""``sparktune bench``: sparktune's kernels next to PyTorch's attention on a sweep of shapes.

The sweep (by default FlashAttention-2's long-sequence benchmark: 16k tokens, batch = 16384 /
seqlen, seqlen 512 to 16384, 12 heads, head dim 64 and 128, causal and not), the candidates,
the reference check and timing (the tuner's), and the reports: a table, CSV, JSON and PNG bar
charts (matplotlib, optional).
"""

from __future__ import annotations

from ._candidates import (
    CANDIDATES,
    CPU_CANDIDATES,
    OWN_BACKENDS,
    QUADRATIC,
    TITLES,
    TunedRecords,
    pick_tuned,
    score_bytes,
)
from ._check import References, make_inputs
from ._plot import MISSING_MATPLOTLIB, chart_name, matplotlib_missing, write_charts
from ._report import CSV_FIELDS, issues, render_table, write_csv
from ._sweep import (
    DEFAULT_HEAD_DIMS,
    DEFAULT_HEADS,
    DEFAULT_SEQLENS,
    DEFAULT_TOKENS,
    FORMAT,
    MEMORY_NOTE,
    OPS,
    BenchReport,
    BenchRow,
    Sweep,
    SweepSettings,
    WallClockTimer,
    case_flops,
    recipe_shapes,
    sweep_shapes,
)

__all__ = [
    "CANDIDATES",
    "CPU_CANDIDATES",
    "CSV_FIELDS",
    "DEFAULT_HEAD_DIMS",
    "DEFAULT_HEADS",
    "DEFAULT_SEQLENS",
    "DEFAULT_TOKENS",
    "FORMAT",
    "MEMORY_NOTE",
    "MISSING_MATPLOTLIB",
    "OPS",
    "OWN_BACKENDS",
    "QUADRATIC",
    "TITLES",
    "TunedRecords",
    "BenchReport",
    "BenchRow",
    "References",
    "Sweep",
    "SweepSettings",
    "WallClockTimer",
    "case_flops",
    "chart_name",
    "issues",
    "make_inputs",
    "matplotlib_missing",
    "pick_tuned",
    "recipe_shapes",
    "render_table",
    "score_bytes",
    "sweep_shapes",
    "write_charts",
    "write_csv",
]

"""Tuning: the timing harness, the reference check, the Optuna study and recipes."""

from __future__ import annotations

from ._cluster import ClusterReport, DatabaseUnavailable, Outcome, Worker, work_label
from ._recipe import DTYPE_ALIASES, Recipe, RecipeError, RecipeIssue, load_recipe, parse_recipe
from ._timing import CostTimer, CudaEventTimer, Timer, Timing
from ._tuner import (
    BASELINE,
    DEFAULT_TRIALS,
    Measurement,
    TuneAborted,
    Tuner,
    TuneResult,
    tunable_candidates,
)
from ._workload import (
    ERROR_FACTOR,
    ERROR_FLOOR,
    FP16_ACCUM_FACTOR,
    CheckResult,
    Workload,
    lowp_attention,
)

__all__ = [
    "BASELINE",
    "ClusterReport",
    "DatabaseUnavailable",
    "DEFAULT_TRIALS",
    "DTYPE_ALIASES",
    "ERROR_FACTOR",
    "ERROR_FLOOR",
    "FP16_ACCUM_FACTOR",
    "CheckResult",
    "CostTimer",
    "CudaEventTimer",
    "Measurement",
    "Outcome",
    "Recipe",
    "RecipeError",
    "RecipeIssue",
    "Timer",
    "Timing",
    "TuneAborted",
    "TuneResult",
    "Tuner",
    "Worker",
    "Workload",
    "load_recipe",
    "lowp_attention",
    "parse_recipe",
    "tunable_candidates",
    "work_label",
]

"""Tuning: the timing harness, the reference check, the Optuna study, recipes and the leases
of distributed tuning."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._cluster import ClusterReport, DatabaseUnavailable, Outcome, Worker, work_label
from ._recipe import (
    DTYPE_ALIASES,
    Recipe,
    RecipeError,
    RecipeIssue,
    feature_fields,
    load_recipe,
    parse_recipe,
)
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

if TYPE_CHECKING:
    from ._leases import Claim, LeaseBoard, LeaseInfo, LeaseLost, new_owner_id, work_id

__all__ = [
    "BASELINE",
    "Claim",
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
    "LeaseBoard",
    "LeaseInfo",
    "LeaseLost",
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
    "feature_fields",
    "load_recipe",
    "lowp_attention",
    "new_owner_id",
    "parse_recipe",
    "tunable_candidates",
    "work_id",
    "work_label",
]

#: the leases need the database driver: imported on first use
_LAZY = ("Claim", "LeaseBoard", "LeaseInfo", "LeaseLost", "new_owner_id", "work_id")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("._leases", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


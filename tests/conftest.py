"""Shared test setup: markers, the ``gpu`` skip rule and per-test seeding."""

from __future__ import annotations

import pytest
import torch

GPU_SKIP_REASON = "needs a CUDA GPU: torch.cuda.is_available() is False"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU; skipped when torch.cuda.is_available() is False"
    )
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state, so a failure can be reproduced."""
    torch.manual_seed(0)

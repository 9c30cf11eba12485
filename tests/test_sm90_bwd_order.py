"""The Hopper backward's section rule (csrc/include/sparktune/sm90_bwd_order.h), compiled with
the host compiler: how many (kv head, batch) pairs one section of a causal or windowed grid
takes, for the problems it was measured on (BENCHMARKS.md, "Sectioned block order in the
backward" and "Few pairs: the whole grid as one section") and for the variable's settings. No
GPU needed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

INCLUDE = Path(__file__).resolve().parent.parent / "csrc" / "include"
SMS = 132  # H100 SXM and H200


# what: (pairs, tokens, group, head dim, SMs, budget MB or -1 unset, expected pairs a section);
# 128 keys a block (the d128 default and the d64 kr1 kernel), Q and dO 16-bit
CASES = {
    "GQA 16:4 8k hd128 (2 waves): whole grid": (4, 8192, 4, 128, SMS, -1, 4),
    "GQA 16:4 4k hd128 (1 wave): whole grid": (4, 4096, 4, 128, SMS, -1, 4),
    "GQA 16:4 16k hd128 (4 waves of 128-block pairs): one pair": (4, 16384, 4, 128, SMS, -1, 1),
    "GQA 32:8 8k hd128 (4 waves of half-wave pairs): whole grid": (8, 8192, 4, 128, SMS, -1, 8),
    "GQA 32:8 8k hd64: whole grid": (8, 8192, 4, 64, SMS, -1, 8),
    "GQA 32:8 16k hd128 (8 waves): one pair": (8, 16384, 4, 128, SMS, -1, 1),
    "MHA 12 heads 16k hd128 (the sweep, 16 MB pairs): one pair": (12, 16384, 1, 128, SMS, -1, 1),
    "MHA 8 x 12 heads 2k hd64 (the sweep, 1 MB pairs): 8 MB": (96, 2048, 1, 64, SMS, -1, 8),
    "MHA 8 x 12 heads 2k hd128 (2 MB pairs): 8 MB": (96, 2048, 1, 128, SMS, -1, 4),
    "a 114-SM GPU: GQA 32:8 8k is past four waves": (8, 8192, 4, 128, 114, -1, 1),
    "one pair": (1, 8192, 4, 128, SMS, -1, 1),
    "variable 0: one pair after another, even for few pairs": (4, 8192, 4, 128, SMS, 0, 1),
    "variable 8: the budget as it is (no whole-grid rule)": (4, 8192, 4, 128, SMS, 8, 1),
    "variable 100000: every pair": (4, 16384, 4, 128, SMS, 100000, 4),
    "variable beyond int64's MB range: every pair, no overflow": (4, 16384, 4, 128, SMS, 2**62, 4),
}


def _args(pairs, tokens, group, head_dim, sms, budget_mb, _expected):
    return pairs, tokens // 128, group * tokens * head_dim * (2 * 2 + 4), sms, budget_mb


MAIN = """
#include <cstdio>
#include "sparktune/sm90_bwd_order.h"
int main() {
  long long c[][5] = {%s};
  for (auto& r : c) {
    std::printf("%%lld\\n", (long long)sparktune::sm90_bwd_section_pairs(r[0], r[1], r[2], r[3], r[4]));
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def section_pairs(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler")
    d = tmp_path_factory.mktemp("order")
    rows = ", ".join("{" + ", ".join(f"{x}LL" for x in _args(*c)) + "}" for c in CASES.values())
    (d / "main.cpp").write_text(MAIN % rows)
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{INCLUDE}", "main.cpp",
                    "-o", "order"], cwd=d, check=True, capture_output=True, text=True)
    out = subprocess.run([str(d / "order")], check=True, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.parametrize("what", list(CASES))
def test_section_pairs(section_pairs, what):
    assert section_pairs[list(CASES).index(what)] == CASES[what][-1], what


@pytest.mark.parametrize("what", list(CASES))
def test_the_group_splits_model_orders_its_grids_as_the_launch_does(what):
    """sparktune.kernels.sm90_bwd_split models the launch's order with a Python copy of the
    rule: the same sections for every case (the C++ header's values are checked above)."""
    from sparktune.kernels.sm90_bwd_split import _section_pairs

    assert _section_pairs(*_args(*CASES[what])) == CASES[what][-1], what

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


def _pair_bytes(group: int, seqlen: int, head_dim: int) -> int:
    return group * seqlen * head_dim * (2 * 2 + 4)  # Q and dO (16-bit), the fp32 dQ workspace


# (what, pairs, key blocks, pair bytes, SMs, budget MB or -1 unset, expected pairs per section)
CASES = [
    ("GQA 16:4 8k hd128 (2 waves): whole grid", 4, 64, _pair_bytes(4, 8192, 128), SMS, -1, 4),
    ("GQA 16:4 4k hd128 (1 wave): whole grid", 4, 32, _pair_bytes(4, 4096, 128), SMS, -1, 4),
    ("GQA 16:4 16k hd128 (4 waves of 128-block pairs): one pair", 4, 128,
     _pair_bytes(4, 16384, 128), SMS, -1, 1),
    ("GQA 32:8 8k hd128 (4 waves of half-wave pairs): whole grid", 8, 64,
     _pair_bytes(4, 8192, 128), SMS, -1, 8),
    ("GQA 32:8 8k hd64 (the kr1 kernel's 128 keys a block): whole grid", 8, 64,
     _pair_bytes(4, 8192, 64), SMS, -1, 8),
    ("GQA 32:8 16k hd128 (8 waves): one pair", 8, 128, _pair_bytes(4, 16384, 128), SMS, -1, 1),
    ("MHA 12 heads 16k hd128 (the sweep: 16 MB pairs): one pair", 12, 128,
     _pair_bytes(1, 16384, 128), SMS, -1, 1),
    ("MHA 8 x 12 heads 2k hd64 (the sweep: 1 MB pairs): the 8 MB budget", 96, 16,
     _pair_bytes(1, 2048, 64), SMS, -1, 8),
    ("MHA 8 x 12 heads 2k hd128 (2 MB pairs): the 8 MB budget", 96, 16,
     _pair_bytes(1, 2048, 128), SMS, -1, 4),
    ("a 114-SM GPU: GQA 32:8 8k is past four waves", 8, 64, _pair_bytes(4, 8192, 128), 114, -1, 1),
    ("one pair", 1, 64, _pair_bytes(4, 8192, 128), SMS, -1, 1),
    ("variable 0: one pair after another, even for few pairs", 4, 64,
     _pair_bytes(4, 8192, 128), SMS, 0, 1),
    ("variable 8: the budget as it is (no whole-grid rule)", 4, 64, _pair_bytes(4, 8192, 128),
     SMS, 8, 1),
    ("variable 100000: every pair", 4, 128, _pair_bytes(4, 16384, 128), SMS, 100000, 4),
    ("variable beyond int64's MB range: every pair, no overflow", 4, 128,
     _pair_bytes(4, 16384, 128), SMS, 2**62, 4),
]

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
    rows = ", ".join("{" + ", ".join(f"{x}LL" for x in c[1:6]) + "}" for c in CASES)
    (d / "main.cpp").write_text(MAIN % rows)
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{INCLUDE}", "main.cpp",
                    "-o", "order"], cwd=d, check=True, capture_output=True, text=True)
    out = subprocess.run([str(d / "order")], check=True, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_section_pairs(section_pairs, i):
    what, *_, expected = CASES[i]
    assert section_pairs[i] == expected, what

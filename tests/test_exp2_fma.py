"""The Hopper forward's 2^x on the FMA pipe (``sm90::exp2_fma`` in sm90_fwd_kernel.h, the
``_ex<N>`` kernels), emulated step by step in numpy float32 on the CPU: the same constants,
read from the header, and the same operations in the same order, each rounded to float32 (an
FMA computed in float64 and rounded once: the product of two float32 numbers is exact in
float64, so this differs from a true FMA only in rare double roundings, far below the bound
tested here). No GPU needed."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "include" / "sparktune" / "sm90_fwd_kernel.h"

#: the bound the header's comment states: well below fp16's half ulp (2^-11 = 4.9e-4)
MAX_REL_ERROR = 1e-4


def _constants() -> dict[str, np.float32]:
    text = HEADER.read_text()
    found = dict(re.findall(r"constexpr float (kExp2\w+) = ([-+0-9.eE]+)f;", text))
    want = {"kExp2Lowest", "kExp2Round", "kExp2C0", "kExp2C1", "kExp2C2", "kExp2C3"}
    assert want <= set(found), f"constants missing from {HEADER.name}: {want - set(found)}"
    return {k: np.float32(v) for k, v in found.items()}


def _fma(a, b, c) -> np.ndarray:
    """fmaf(a, b, c) in float32: the product of two float32 numbers is exact in float64."""
    wide = np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)
    return wide.astype(np.float32)


def exp2_fma(x, k: dict[str, np.float32] | None = None) -> np.ndarray:
    """sm90::exp2_fma, operation by operation, in float32."""
    k = k or _constants()
    x = np.maximum(np.asarray(x, np.float32), k["kExp2Lowest"])  # fmaxf(x, kExp2Lowest)
    t = x + k["kExp2Round"]                                       # __fadd_rn(x, kExp2Round)
    f = x - (t - k["kExp2Round"])                                 # __fsub_rn(x, __fsub_rn(t, .))
    assert t.dtype == f.dtype == np.float32
    q = _fma(k["kExp2C3"], f, k["kExp2C2"])
    q = _fma(q, f, k["kExp2C1"])
    q = _fma(q, f, k["kExp2C0"])
    # __int_as_float(__float_as_int(q) + (__float_as_int(t) << 23)), in 32-bit wrapping ints
    bits = q.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    return bits.view(np.float32)


EDGES = [0.0, -0.0, -0.5, -0.49999997, -0.50000006, -1.5, -1e-8, -124.5, -125.0, -125.00001,
         -126.0, -130.0, 1e-7]


def _neighbours(c: float, n: int = 2000) -> np.ndarray:
    """The n float32 numbers on each side of c (c itself among them)."""
    bits = np.array([c], np.float32).view(np.int32)[0]
    return (bits + np.arange(-n, n + 1, dtype=np.int32)).view(np.float32)


def _grid() -> np.ndarray:
    dense = np.linspace(-130.0, 0.0, 2_600_001, dtype=np.float64).astype(np.float32)
    # where j's rounding flips (f = +-0.5), at the clamp, and just below and above 0 (x is a
    # few ulp above 0 where a score is the row maximum)
    near = [_neighbours(c) for c in (-0.5, -1.5, -63.5, -124.5, -125.0)]
    near += [_neighbours(-0.0)[2000:], _neighbours(0.0)[2000:2100]]
    return np.concatenate([dense, *near, np.float32(EDGES)])


def test_constants_come_from_the_header():
    k = _constants()
    assert k["kExp2Lowest"] == -125 and k["kExp2Round"] == 1.5 * 2**23
    # the polynomial is close to 2^f's Taylor series (ln 2)^n / n!
    assert abs(k["kExp2C0"] - 1) < 1e-3 and abs(k["kExp2C1"] - np.log(2)) < 1e-3
    assert abs(k["kExp2C2"] - np.log(2) ** 2 / 2) < 5e-3 and abs(k["kExp2C3"] - np.log(2) ** 3 / 6) < 5e-3


def test_exp2_fma_relative_error():
    x = _grid()
    y = exp2_fma(x)
    assert np.all(np.isfinite(y)) and np.all(y > 0), "exp2_fma gave a non-positive or non-finite value"
    seen = x >= -125
    ref = np.exp2(x[seen].astype(np.float64))
    rel = np.abs(y[seen].astype(np.float64) / ref - 1)
    worst = int(np.argmax(rel))
    assert rel[worst] <= MAX_REL_ERROR, f"relative error {rel[worst]:.3g} at x = {x[seen][worst]!r}"
    # below the clamp: what -125 gives, about 2^-125 (not 0: the kernel keeps exp2f wherever
    # -inf must give 0)
    assert np.all(y[x < -125] == exp2_fma(np.float32([-125.0]))[0])


@pytest.mark.parametrize("x", EDGES)
def test_exp2_fma_edges(x):
    y = float(exp2_fma(np.float32([x]))[0])
    want = 2.0 ** max(float(np.float32(x)), -125.0)
    assert y > 0 and abs(y / want - 1) <= MAX_REL_ERROR, (x, y, want)


def test_the_exponent_split_is_exact():
    """j = t - 1.5 * 2^23 is x rounded to the nearest integer (ties to even) and f = x - j is
    exact and in [-0.5, 0.5], for every x of [-125, 0]."""
    k = _constants()
    x = _grid()
    x = x[(x >= -125) & (x <= 0)]
    t = x + k["kExp2Round"]
    j = t - k["kExp2Round"]
    assert np.array_equal(j.astype(np.float64), np.rint(x.astype(np.float64)))
    f = x - j
    assert np.array_equal(f.astype(np.float64), x.astype(np.float64) - j.astype(np.float64))
    assert np.all(np.abs(f) <= 0.5)
    # t's bits are 1.5 * 2^23's plus j, and the shift by 23 leaves j << 23 (two's complement)
    assert np.array_equal((t.view(np.uint32) << np.uint32(23)).view(np.int32), j.astype(np.int32) << 23)


def test_which_columns_take_the_polynomial():
    """sm90::exp2_on_fma<kEmu>(c): kEmu of every 8 columns, spread (the header's rule, in
    Python)."""
    text = HEADER.read_text()
    assert "return (c % 8 + 1) * kEmu / 8 > (c % 8) * kEmu / 8;" in text
    picks = {n: [c for c in range(8) if (c % 8 + 1) * n // 8 > (c % 8) * n // 8] for n in range(5)}
    assert picks == {0: [], 1: [7], 2: [3, 7], 3: [2, 5, 7], 4: [1, 3, 5, 7]}

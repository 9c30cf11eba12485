"""The Hopper kernels' tanh polynomial for soft-capped scores (csrc/include/sparktune/
sm90_fwd_kernel.h, used by the forward and the backward): the constants in the header, evaluated
as the kernels do (Horner in x^2, float32), stay within the error bound on the range the kernels
use them, and the share of elements that take it is a valid one. No GPU needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

INCLUDE = Path(__file__).resolve().parent.parent / "csrc" / "include" / "sparktune"
HEADER = INCLUDE / "sm90_fwd_kernel.h"


def _constants() -> dict[str, float]:
    text = HEADER.read_text()
    found = dict(re.findall(r"constexpr float (kTanhPoly\w*) = (-?[0-9.eE+-]+)f;", text))
    return {k: float(v) for k, v in found.items()}


def _poly_share() -> int:
    m = re.search(r"#define SPARKTUNE_TANH_POLY_OF_4 (\d+)", HEADER.read_text())
    assert m, "the default of SPARKTUNE_TANH_POLY_OF_4 is not in the header"
    return int(m.group(1))


def _eval(x: torch.Tensor, c: dict[str, float]) -> torch.Tensor:
    x = x.to(torch.float32)
    t = x * x
    a = c["kTanhPoly4"] * t + c["kTanhPoly3"]
    for name in ("kTanhPoly2", "kTanhPoly1", "kTanhPoly0"):
        a = a * t + c[name]
    return x * a


def test_constants_are_all_there():
    c = _constants()
    assert set(c) == {"kTanhPolyMax", *(f"kTanhPoly{i}" for i in range(5))}
    assert c["kTanhPolyMax"] == 1.0


@pytest.mark.parametrize("lo,hi", [(-1.0, 1.0), (-1e-3, 1e-3), (0.9, 1.0)])
def test_error_is_below_tanh_approx(lo, hi):
    # tanh.approx.f32 has a relative error of about 2^-11; the polynomial must stay well under
    c = _constants()
    x = torch.linspace(lo, hi, 200_001, dtype=torch.float64)
    err = (_eval(x, c).double() - torch.tanh(x)).abs()
    assert err.max().item() < 1e-5
    rel = err / torch.tanh(x).abs().clamp_min(1e-30)
    assert rel[x.abs() > 1e-6].max().item() < 2e-5


def test_odd_and_monotone_on_the_range():
    c = _constants()
    x = torch.linspace(0, c["kTanhPolyMax"], 100_001, dtype=torch.float32)
    y = _eval(x, c)
    assert torch.equal(_eval(-x, c), -y)
    assert (y[1:] >= y[:-1]).all()
    assert y[-1].item() < 1.0


def test_poly_share_is_valid():
    assert 0 <= _poly_share() <= 4


def test_the_kernel_keeps_the_special_function_path_outside_the_range():
    # the vote over the warp: one element beyond kTanhPolyMax sends the whole warp to tanh.approx
    text = HEADER.read_text()
    assert re.search(r"__all_sync\(0xffffffffu, amax \* cap_in <= sm90::kTanhPolyMax\)", text)


def test_forward_and_backward_take_the_soft_capped_tanh_from_the_one_helper():
    # the build switch moves the same share in both kernels; neither keeps a tanh loop of its own
    for name in ("sm90_fwd_kernel.h", "sm90_bwd_kernel.h"):
        text = (INCLUDE / name).read_text()
        assert re.search(r"sm90::softcap_tanh\(acc_s, ", text), name
        assert not re.search(r"acc_s\(i\) = sm90::tanh_approx", text), name

"""The spark backend's choice for an untuned problem, from a catalogue of kernel facts (no
extension or GPU needed): Hopper takes its sm90 default where it is compiled, every other GPU
(and Hopper without the sm90 kernel) the m16n8k16 defaults."""

from __future__ import annotations

import pytest

from sparktune.backends.spark import SparkBackend
from sparktune.problem import DeviceInfo, Problem

H200 = DeviceInfo("NVIDIA H200", (9, 0), 132)
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108)


def _fact(name: str) -> dict:
    parts = name.split("_")
    op, fam, dt, d, tile = parts[0], int(parts[1][2:]), parts[2], int(parts[3][1:]), parts[4]
    bm, bn = (int(x) for x in tile[1:].split("n"))
    if fam == 90:
        wm, wn = bm // 16, 1
    else:
        wm, wn = (int(x) for x in parts[5][1:].split("x"))
    return dict(name=name, op=op, family=fam, atom="wgmma" if fam == 90 else "m16n8k16",
                dtype={"f16": "float16", "bf16": "bfloat16"}[dt], head_dim=d, block_m=bm,
                block_n=bn, warps_m=wm, warps_n=wn, accum=32, softmax="reg", threads=128 * (wm // 4 + 1),
                smem_bytes=49152, min_arch=90 if fam == 90 else 80, archs=[80, 90])


NAMES = [
    "fwd_sm80_f16_d128_m128n64_w4x1_acc32",
    "fwd_sm80_f16_d128_m128n128_w8x1_acc32",
    "fwd_sm90_f16_d128_m128n128_s2",
    "fwd_sm90_f16_d128_m128n128_s2_ov1_pp0",
    "fwd_sm90_f16_d128_m128n128_s2_ov1_pp1",
    "fwd_sm90_bf16_d128_m128n128_s2_ov1_pp0",
    "fwd_sm90_bf16_d128_m128n128_s2_ov1_pp1",
    "fwd_sm90_f16_d64_m128n128_s2_ov1_pp0",
    "fwd_sm80_f16_d64_m128n64_w4x1_acc32",
]


@pytest.fixture
def backend(monkeypatch):
    b = SparkBackend()
    b._kernels = {n: _fact(n) for n in NAMES}
    monkeypatch.setattr(b, "unavailable_reasons", lambda: [])
    monkeypatch.setattr(b, "build_info", lambda: {"archs": [80, 90]})
    return b


@pytest.mark.parametrize("dtype,expected", [
    ("float16", "fwd_sm90_f16_d128_m128n128_s2_ov1_pp1"),
    ("bfloat16", "fwd_sm90_bf16_d128_m128n128_s2_ov1_pp1"),
])
def test_hopper_takes_the_sm90_default(backend, dtype, expected):
    p = Problem("fwd", dtype, 1, 8, 8, 4096, 4096, 128, True)
    assert backend.default_config(p, H200) == expected


def test_other_gpus_never_take_sm90(backend):
    p = Problem("fwd", "float16", 1, 8, 8, 4096, 4096, 128, True)
    assert backend.default_config(p, A100) == "fwd_sm80_f16_d128_m128n64_w4x1_acc32"


def test_hopper_without_the_default_sm90_kernel_takes_the_sm80_default(backend):
    # head dim 64: only a 128-row overlap kernel is compiled, not the 192-row default
    p = Problem("fwd", "float16", 1, 8, 8, 4096, 4096, 64, False)
    assert backend.default_config(p, H200) == "fwd_sm80_f16_d64_m128n64_w4x1_acc32"

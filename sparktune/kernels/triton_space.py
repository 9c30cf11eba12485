"""The configuration space of the Triton attention family, as data.

Pure Python (no torch, no triton): the tuner, the database and the CLI can read the space on a
machine without a GPU. Every configuration has a name generated from its parameters; the name
is the registry key, the database value and the log label, and :func:`parse_config` turns it
back into parameters, so any well-formed name (not only the declared ones) can be run.

Forward (``tfwd_m{BM}n{BN}_w{warps}s{stages}``): one program holds ``BM`` query rows and streams
the keys and values in tiles of ``BN`` rows.

Backward (``tbwd_m{BM}n{BN}_w{warps}s{stages}[_dqatomic]``): the dK/dV kernel holds ``BN`` key
rows per program and streams the queries in steps of ``BM`` rows; the separate dQ kernel is its
mirror image (``BN`` query rows held, keys streamed in steps of ``BM``). With ``_dqatomic`` the
dK/dV kernel also adds dQ into a float32 workspace with atomics and there is no dQ kernel.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..problem import DeviceInfo, Problem

__all__ = [
    "FwdConfig",
    "BwdConfig",
    "Config",
    "FWD_SPACE",
    "BWD_SPACE",
    "MIN_HEAD_DIM",
    "MAX_HEAD_DIM",
    "MIN_CAPABILITY",
    "parse_config",
    "padded_head_dim",
    "config_reasons",
    "smem_limit",
    "default_config_name",
]

#: head dims accepted; a head dim that is not a power of two is padded to the next one
MIN_HEAD_DIM = 32
MAX_HEAD_DIM = 256
#: Triton's tensor-core path (mma.m16n8k16 / wgmma) starts with Ampere
MIN_CAPABILITY = (8, 0)
#: bytes per element of the inputs (fp16 and bf16)
_ELEMENT_BYTES = 2
#: fp32 accumulator registers per thread above which a config is refused (of 255 in all)
_MAX_ACC_REGS = 128
_WARP = 32
#: shared memory per block (opt-in maximum) by compute capability, in bytes
_SMEM_BY_CAPABILITY = {
    (8, 0): 163 * 1024,
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024,
    (10, 3): 227 * 1024,
    (12, 0): 99 * 1024,
    (12, 1): 99 * 1024,
}
#: for a capability not in the table: the smallest of the family (safe, maybe pessimistic)
_SMEM_UNKNOWN = 99 * 1024


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def padded_head_dim(head_dim: int) -> int:
    """The tile width used for ``head_dim``: the next power of two (masked loads pad it)."""
    return 1 << max(head_dim - 1, 0).bit_length()


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    op = "fwd"

    @property
    def name(self) -> str:
        return f"tfwd_m{self.block_m}n{self.block_n}_w{self.num_warps}s{self.num_stages}"

    def smem_bytes(self, head_dim: int) -> int:
        """Estimate: the Q tile plus ``num_stages`` buffers of the K and V tiles."""
        d = padded_head_dim(head_dim)
        return _ELEMENT_BYTES * (self.block_m * d + self.num_stages * 2 * self.block_n * d)

    def acc_regs(self, head_dim: int) -> int:
        """fp32 registers per thread for the output accumulator."""
        return self.block_m * padded_head_dim(head_dim) // (_WARP * self.num_warps)


@dataclass(frozen=True)
class BwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dq_atomic: bool = False

    op = "bwd"

    @property
    def name(self) -> str:
        suffix = "_dqatomic" if self.dq_atomic else ""
        return f"tbwd_m{self.block_m}n{self.block_n}_w{self.num_warps}s{self.num_stages}{suffix}"

    def smem_bytes(self, head_dim: int) -> int:
        """Estimate for either kernel (they mirror each other): two resident tiles of
        ``block_n`` rows, ``num_stages`` buffers of two streamed tiles of ``block_m`` rows and
        one ``block_n x block_m`` tile of probabilities staged for the second product. Atomic dQ
        (dS^T K inside the dK/dV kernel) stages K, Q and dS once more in other layouts: an upper
        bound, checked against Triton 3.6's allocations on sm_80 and sm_90 (``gpu_check_triton
        --offline``)."""
        d = padded_head_dim(head_dim)
        resident = 2 * self.block_n * d
        streamed = self.num_stages * 2 * self.block_m * d
        staged = self.block_n * self.block_m
        if self.dq_atomic:
            staged += self.block_n * d + self.block_m * d + self.block_m * self.block_n
        return _ELEMENT_BYTES * (resident + streamed + staged)

    def acc_regs(self, head_dim: int) -> int:
        """fp32 registers per thread for the dK and dV accumulators."""
        return 2 * self.block_n * padded_head_dim(head_dim) // (_WARP * self.num_warps)


Config = FwdConfig | BwdConfig

_NAME_RE = re.compile(r"^t(fwd|bwd)_m(\d+)n(\d+)_w(\d+)s(\d+)(_dqatomic)?$")


def parse_config(name: str) -> Config:
    """``"tfwd_m128n64_w8s3"`` -> ``FwdConfig(128, 64, 8, 3)``. Raises ValueError with the
    reason when the name is malformed or its parameters cannot make a kernel."""
    m = _NAME_RE.match(name)
    if m is None:
        raise ValueError(
            f"{name!r} is not a Triton config name "
            "(expected tfwd_m<BM>n<BN>_w<warps>s<stages> or tbwd_..._w<warps>s<stages>[_dqatomic])"
        )
    op, bm, bn, w, s, atomic = m.groups()
    bm, bn, w, s = int(bm), int(bn), int(w), int(s)
    problems = []
    for label, value in (("block_m", bm), ("block_n", bn)):
        if not _is_pow2(value) or value < 16:
            problems.append(f"{label} {value} must be a power of two >= 16 (tl.dot's minimum)")
    if w not in (1, 2, 4, 8, 16):
        problems.append(f"num_warps {w} must be one of 1, 2, 4, 8, 16")
    if s < 1:
        problems.append(f"num_stages {s} must be >= 1")
    if op == "fwd" and atomic:
        problems.append("_dqatomic is a backward option")
    if problems:
        raise ValueError(f"{name!r}: " + "; ".join(problems))
    if op == "fwd":
        return FwdConfig(bm, bn, w, s)
    return BwdConfig(bm, bn, w, s, dq_atomic=bool(atomic))


def _fwd_space() -> tuple[FwdConfig, ...]:
    return tuple(
        FwdConfig(bm, bn, w, s)
        for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    )


def _bwd_space() -> tuple[BwdConfig, ...]:
    # (streamed step, resident block): small steps over a large resident block amortise the
    # resident tiles; the square ones trade that for fewer, larger products
    shapes = ((32, 64), (64, 64), (32, 128), (64, 128), (128, 128))
    separate = [
        BwdConfig(bm, bn, w, s) for (bm, bn), w, s in itertools.product(shapes, (4, 8), (2, 3))
    ]
    atomic = [
        BwdConfig(bm, bn, w, 2, dq_atomic=True) for (bm, bn), w in itertools.product(shapes, (4, 8))
    ]
    return tuple(separate + atomic)


#: the declared search space (the tuner's candidates, before the per-problem filter)
FWD_SPACE: tuple[FwdConfig, ...] = _fwd_space()
BWD_SPACE: tuple[BwdConfig, ...] = _bwd_space()


def smem_limit(device: DeviceInfo | None) -> int | None:
    """Shared memory per block available to a kernel on ``device`` (None: unknown device)."""
    if device is None:
        return None
    explicit = device.extra.get("max_shared_mem") if device.extra else None
    if explicit:
        return int(explicit)
    return _SMEM_BY_CAPABILITY.get(tuple(device.capability), _SMEM_UNKNOWN)


def config_reasons(cfg: Config, problem: Problem, device: DeviceInfo | None) -> list[str]:
    """Why ``cfg`` cannot run ``problem`` on ``device`` (empty when it can). Problem-level
    checks (dtype, head dim, capability) are the backend's; these are the config's own."""
    reasons = []
    if cfg.op != problem.op:
        reasons.append(f"{cfg.name} is a {cfg.op} config, the problem is {problem.op}")
        return reasons
    if getattr(problem, "deterministic", False) and getattr(cfg, "dq_atomic", False):
        reasons.append(
            f"{cfg.name}: adds dQ with float atomics, whose order varies run to run; a "
            "deterministic backward needs a config without _dqatomic"
        )
    d = problem.head_dim
    regs = cfg.acc_regs(d)
    if regs > _MAX_ACC_REGS:
        reasons.append(
            f"{cfg.name}: accumulators need {regs} fp32 registers per thread at head_dim {d} "
            f"(limit {_MAX_ACC_REGS}); more warps or a smaller block would fit"
        )
    limit = smem_limit(device)
    if limit is not None:
        need = cfg.smem_bytes(d)
        if need > limit:
            reasons.append(
                f"{cfg.name}: needs about {need // 1024} KiB of shared memory at head_dim {d}, "
                f"{device.name if device else 'the device'} has {limit // 1024} KiB per block"
            )
    return reasons


# Heuristic defaults for an untuned problem, best first, by (op, head-dim bucket, causal). The
# first entries are the configs that won most shapes of the 16k-token sweep on an H200 with
# Triton 3.6 (bench/triton_sweep.py: forward and forward+backward, 12 heads, seqlen 512-16k);
# the next ones are the best (block M, block N, warps, stages) per head dim and mask of an
# earlier sweep of a minimal Triton forward at seqlen 8192 on the same GPU, and the largest tiles
# whose backward does not spill.
# Later entries are fallbacks for GPUs with less shared memory (sm_86/89/120: 99 KiB).
_DEFAULTS: dict[tuple[str, int, bool], tuple[str, ...]] = {
    ("fwd", 64, False): ("tfwd_m128n64_w8s3", "tfwd_m128n64_w4s3", "tfwd_m128n64_w4s2", "tfwd_m64n64_w4s2"),
    ("fwd", 64, True): ("tfwd_m128n64_w8s3", "tfwd_m64n128_w4s3", "tfwd_m64n64_w4s3", "tfwd_m64n64_w4s2"),
    ("fwd", 128, False): ("tfwd_m128n128_w8s3", "tfwd_m128n64_w8s3", "tfwd_m128n64_w8s2", "tfwd_m64n64_w4s2"),
    ("fwd", 128, True): ("tfwd_m128n128_w8s3", "tfwd_m64n64_w4s3", "tfwd_m64n64_w4s2", "tfwd_m64n32_w4s2"),
    ("fwd", 256, False): ("tfwd_m64n64_w8s2", "tfwd_m64n32_w4s2"),
    ("fwd", 256, True): ("tfwd_m64n64_w8s2", "tfwd_m64n32_w4s2"),
    ("bwd", 64, False): ("tbwd_m32n128_w4s3", "tbwd_m32n128_w8s3", "tbwd_m32n128_w8s2", "tbwd_m32n64_w4s2"),
    ("bwd", 64, True): ("tbwd_m64n64_w4s2", "tbwd_m32n128_w8s3", "tbwd_m32n128_w8s2", "tbwd_m32n64_w4s2"),
    ("bwd", 128, False): ("tbwd_m64n64_w4s2", "tbwd_m32n128_w8s2", "tbwd_m32n64_w8s2"),
    ("bwd", 128, True): ("tbwd_m64n64_w4s2", "tbwd_m32n128_w8s2", "tbwd_m32n64_w8s2"),
    ("bwd", 256, False): ("tbwd_m32n64_w8s2", "tbwd_m32n64_w8s3"),
    ("bwd", 256, True): ("tbwd_m32n64_w8s2", "tbwd_m32n64_w8s3"),
}


def default_config_name(problem: Problem, device: DeviceInfo | None) -> str | None:
    """The first preferred config that fits ``problem`` on ``device``, else the first of the
    declared space that fits, else None."""
    d = padded_head_dim(problem.head_dim)
    bucket = 64 if d <= 64 else d
    preferred = _DEFAULTS.get((problem.op, bucket, problem.causal), ())
    space = FWD_SPACE if problem.op == "fwd" else BWD_SPACE
    for name in (*preferred, *(c.name for c in space)):
        if not config_reasons(parse_config(name), problem, device):
            return name
    return None

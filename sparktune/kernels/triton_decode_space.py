"""The configuration space of the Triton split-KV decode kernels, as data (pure Python).

Name: ``tdec_n{BN}_w{warps}s{stages}_x{mult}`` or ``..._p{splits}``. One program handles one
(sequence, kv head, split): all the GQA group's query rows (``group * Nq``) against ``BN`` keys
per tile, so each K/V tile is read once. The number of splits is either the rule
``splits = ceil(mult * SMs / (batch * heads_kv))`` (``_x{mult}``; at most one split per tile
of the cache's capacity, at most :data:`MAX_SPLITS`) or fixed (``_p{splits}``, for tests and
forced runs).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

__all__ = [
    "DecodeConfig",
    "DECODE_SPACE",
    "BENCH_SPACE",
    "MAX_SPLITS",
    "MAX_ROWS",
    "parse_decode_config",
    "default_decode_config",
    "num_splits",
    "blocks_per_sm",
    "problem_reasons",
]

#: splits per (sequence, kv head) at most (the combine kernel holds one lse per split)
MAX_SPLITS = 128
#: query rows (group size * Nq) one program holds at most
MAX_ROWS = 128

_NAME = re.compile(r"^tdec_n(\d+)_w(\d+)s(\d+)_(x|p)(\d+)$")


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    warps: int
    stages: int
    split_mult: int = 0  # the rule's multiplier (x), or 0 with fixed splits
    splits: int = 0  # fixed splits (p), or 0 with the rule

    @property
    def name(self) -> str:
        tail = f"x{self.split_mult}" if self.split_mult else f"p{self.splits}"
        return f"tdec_n{self.block_n}_w{self.warps}s{self.stages}_{tail}"

    def reasons(self) -> list[str]:
        out = []
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            out.append(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.warps not in (1, 2, 4, 8):
            out.append(f"warps must be 1, 2, 4 or 8, got {self.warps}")
        if not 1 <= self.stages <= 5:
            out.append(f"stages must be 1..5, got {self.stages}")
        if (self.split_mult > 0) == (self.splits > 0):
            out.append("exactly one of the split multiplier (x) and fixed splits (p) is set")
        if self.splits > MAX_SPLITS or self.split_mult > MAX_SPLITS:
            out.append(f"splits at most {MAX_SPLITS}")
        return out


_DTYPES = ("float16", "bfloat16")


def problem_reasons(key) -> list[str]:
    """Why the kernels cannot run a decode problem (a :class:`sparktune.problem.Problem` of op
    "decode" or a :class:`sparktune._kvcache.DecodeKey`: anything with ``dtype``,
    ``head_dim``, ``group_size`` and ``seqlen_q``); empty when they can."""
    out = []
    if key.dtype not in _DTYPES:
        out.append(f"triton decode: dtype float16 or bfloat16, got {key.dtype}")
    if key.head_dim % 8 or not 16 <= key.head_dim <= 256:
        out.append(f"triton decode: head_dim a multiple of 8 in 16..256, got {key.head_dim}")
    rows = key.group_size * key.seqlen_q
    if rows > MAX_ROWS:
        out.append(f"triton decode: group size * Nq at most {MAX_ROWS}, got {rows}")
    return out


def parse_decode_config(name: str) -> DecodeConfig:
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"not a decode config name: {name!r} (expected tdec_n<BN>_w<W>s<S>_x<M> "
                         "or _p<splits>)")
    bn, w, s, kind, val = m.groups()
    cfg = DecodeConfig(int(bn), int(w), int(s), int(val) if kind == "x" else 0,
                       int(val) if kind == "p" else 0)
    bad = cfg.reasons()
    if bad:
        raise ValueError(f"bad decode config {name!r}: " + "; ".join(bad))
    return cfg


#: the tuner's space
DECODE_SPACE: tuple[str, ...] = tuple(
    DecodeConfig(bn, w, s, x).name
    for bn, w, s, x in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4), (1, 2, 4, 8))
)
#: a shorter list the bandwidth bench sweeps per shape
BENCH_SPACE: tuple[str, ...] = tuple(
    DecodeConfig(bn, w, s, x).name
    for bn, w, s, x in itertools.product((64, 128), (4, 8), (2, 3), (1, 2, 4, 8))
)


def default_decode_config(head_dim: int) -> str:
    """The config used before any tuning: 64-key tiles, 4 warps, 2 stages, split multiplier 4,
    the best of ``BENCH_SPACE`` at batch 1 on an H200 (bf16, hd 128, GQA 32:8,
    bench/decode_bandwidth.py); batch 8 preferred multiplier 8 and batch 64 multipliers 1-2."""
    del head_dim  # measured at hd 128 only so far
    return DecodeConfig(64, 4, 2, 4).name


def num_splits(cfg: DecodeConfig, batch: int, heads_kv: int, sm_count: int, capacity: int,
               blocks_per_sm: int | None = None) -> int:
    """How many splits of each (sequence, kv head)'s keys a call launches.

    The rule's count (``x``: about ``split_mult`` programs per SM) is, once the kernel's
    occupancy is known (``blocks_per_sm``, from its registers and shared memory), rounded down
    to whole waves of ``sm_count * blocks_per_sm`` programs where it is more than one wave:
    every program reads the same number of keys, so a last wave that is partly filled costs
    the time of a full one. (On an H200 at batch 64, 1024 programs of a kernel resident 7 to
    an SM ran at 0.95x SDPA, 512 at 1.00x; at batch 8, 576 of a kernel resident 4 to an SM at
    0.79x.) Fixed splits (``p``) are taken as they are."""
    tiles = max(1, math.ceil(capacity / cfg.block_n))
    if cfg.splits:
        return max(1, min(cfg.splits, tiles, MAX_SPLITS))
    bh = max(1, batch * heads_kv)
    splits = max(1, min(math.ceil(cfg.split_mult * sm_count / bh), tiles, MAX_SPLITS))
    if blocks_per_sm:
        wave = sm_count * blocks_per_sm
        programs = splits * bh
        if programs > wave and programs % wave:
            splits = max(1, (programs // wave) * wave // bh)
    return splits


def blocks_per_sm(n_regs: int, num_warps: int, shared: int, regs_per_sm: int = 65536,
                  threads_per_sm: int = 2048, smem_per_sm: int = 233472,
                  max_blocks: int = 32) -> int | None:
    """How many programs of a compiled kernel one SM holds at once: the least of what its
    registers (allocated per warp in units of 256), its shared memory (and the 1 KB the
    hardware reserves per block) and its threads allow. None where the kernel's numbers are
    not known (a register count of 0: the interpreter)."""
    if n_regs <= 0 or num_warps <= 0:
        return None
    per_warp = math.ceil(n_regs * 32 / 256) * 256
    by_regs = regs_per_sm // (per_warp * num_warps)
    by_smem = smem_per_sm // (shared + 1024) if shared > 0 else max_blocks
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, max_blocks))

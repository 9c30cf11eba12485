"""The declared configuration space of the kernel family (forward and backward): the one source
of truth.

Each entry becomes one generated .cu file at build time; its name (e.g.
``fwd_sm80_f16_d128_m128n64_w4x1_acc32_preg``) is the build filter, the registry key, the
database value and the log label. Whether an entry can work is decided by the C++ rules in
``csrc/include/sparktune/fwd_config.h`` and ``bwd_config.h`` (the generator,
``csrc/gen_kernels.py``, asks a small probe compiled from them), not here. Each entry type names
the C++ it is generated into (``rules_header``, ``launch_header``, ``register_fn``).

This module needs only the standard library: the generator loads it from its file at build time.

Name fields: ``sm70``/``sm80``/``sm90`` MMA family (mma.m8n8k4 / mma.m16n8k16 / wgmma), dtype, head dim,
block_m x block_n, warps along M x along N, accumulator bits, softmax policy (``preg``: P stays
in registers; ``psmem``: S and P go through shared memory). Backward names
(``bwd_sm80_f16_d128_m128n64_w8x1_acc32``) have the same fields but no softmax policy (P and dS
always go through shared memory); their warps are the arrangement of the S = Q K^T product.
Hopper names (``fwd_sm90_f16_d128_m128n128_s2``) have no warp, accumulator or softmax field
(block_m / 64 consumer warpgroups, fp32 accumulation, P in registers) but the K/V pipeline
depth ``s``; the Hopper backward (``bwd_sm90_f16_d128_m64n128_s2``) has block_n / 64 consumer
warpgroups of 64 keys and the depth ``s`` of its Q/dO pipeline.
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import dataclass

DTYPES = {"f16": ("float16", "cutlass::half_t"), "bf16": ("bfloat16", "cutlass::bfloat16_t")}
SOFTMAX = {"preg": "SoftmaxPolicy::kRegisters", "psmem": "SoftmaxPolicy::kShared"}


@dataclass(frozen=True)
class FwdEntry:
    rules_header = "sparktune/fwd_config.h"
    launch_header = "sparktune/fwd_launch.h"
    register_fn = "register_fwd"

    family: int
    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    warps_m: int
    warps_n: int
    accum: int
    softmax: str

    @property
    def name(self) -> str:
        return (
            f"fwd_sm{self.family}_{self.dtype}_d{self.head_dim}_m{self.block_m}n{self.block_n}"
            f"_w{self.warps_m}x{self.warps_n}_acc{self.accum}_{self.softmax}"
        )

    @property
    def config_type(self) -> str:
        acc32 = "true" if self.accum == 32 else "false"
        return (
            f"FwdConfig<{self.family}, {DTYPES[self.dtype][1]}, {self.head_dim}, {self.block_m}, "
            f"{self.block_n}, {self.warps_m}, {self.warps_n}, {acc32}, {SOFTMAX[self.softmax]}>"
        )


@dataclass(frozen=True)
class Fwd90Entry:
    """A Hopper forward configuration (wgmma, TMA, a producer warpgroup and block_m / 64
    consumer warpgroups): ``fwd_sm90_f16_d128_m128n128_s2``; ``s`` is the depth of the K/V
    pipeline in shared memory. Compiled for sm_90a: it runs on sm_90 only.

    ``overlap`` (``_ov1``): softmax of key block j under the P V product of block j - 1 inside
    each consumer warpgroup; ``pingpong`` (``_pp1``, needs ``overlap``): the two consumer
    warpgroups take turns issuing their GEMMs. Both off: no suffix, the original kernel.
    ``persistent`` (``_ps1``): one block per SM walks the tiles (see sm90_fwd_config.h)."""

    rules_header = "sparktune/sm90_fwd_config.h"
    launch_header = "sparktune/sm90_fwd_launch.h"
    register_fn = "register_sm90_fwd"
    family = 90

    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    stages: int
    overlap: bool = False
    pingpong: bool = False
    persistent: bool = False

    @property
    def name(self) -> str:
        sched = f"_ov{int(self.overlap)}_pp{int(self.pingpong)}" if self.overlap or self.pingpong else ""
        if self.persistent:
            sched += "_ps1"
        return (
            f"fwd_sm90_{self.dtype}_d{self.head_dim}_m{self.block_m}n{self.block_n}"
            f"_s{self.stages}{sched}"
        )

    @property
    def config_type(self) -> str:
        sched = ""
        if self.overlap or self.pingpong or self.persistent:
            sched = f", {str(self.overlap).lower()}, {str(self.pingpong).lower()}"
        if self.persistent:
            sched += ", true"
        return (
            f"Sm90FwdConfig<{DTYPES[self.dtype][1]}, {self.head_dim}, {self.block_m}, "
            f"{self.block_n}, {self.stages}{sched}>"
        )


@dataclass(frozen=True)
class BwdEntry:
    rules_header = "sparktune/bwd_config.h"
    launch_header = "sparktune/bwd_launch.h"
    register_fn = "register_bwd"

    family: int
    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    warps_m: int
    warps_n: int
    accum: int

    @property
    def name(self) -> str:
        return (
            f"bwd_sm{self.family}_{self.dtype}_d{self.head_dim}_m{self.block_m}n{self.block_n}"
            f"_w{self.warps_m}x{self.warps_n}_acc{self.accum}"
        )

    @property
    def config_type(self) -> str:
        acc32 = "true" if self.accum == 32 else "false"
        return (
            f"BwdConfig<{self.family}, {DTYPES[self.dtype][1]}, {self.head_dim}, {self.block_m}, "
            f"{self.block_n}, {self.warps_m}, {self.warps_n}, {acc32}>"
        )


@dataclass(frozen=True)
class Bwd90Entry:
    """A Hopper backward configuration (wgmma, TMA, a producer warpgroup and block_n / 64
    consumer warpgroups of 64 keys): ``bwd_sm90_f16_d128_m64n128_s2``; block_m is the query
    tile of a step, block_n the keys of a thread block, ``s`` the depth of the Q/dO pipeline.
    Compiled for sm_90a: it runs on sm_90 only. Every configuration has the deterministic mode
    (a runtime switch: the caller passes the dQ semaphore workspace).

    ``overlap`` (``_ov1``): the next query tile's S^T, dP^T and softmax under this tile's dV, dQ
    and dK products inside each consumer warpgroup (see sm90_bwd_config.h). ``kv_regs``
    (``_kr1``): K and V loaded into registers once per block, as the register operands of S^T
    and dP^T (head dim 64: at 128 they do not fit). Off: no suffix."""

    rules_header = "sparktune/sm90_bwd_config.h"
    launch_header = "sparktune/sm90_bwd_launch.h"
    register_fn = "register_sm90_bwd"
    family = 90

    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    stages: int
    overlap: bool = False
    kv_regs: bool = False

    @property
    def name(self) -> str:
        return (
            f"bwd_sm90_{self.dtype}_d{self.head_dim}_m{self.block_m}n{self.block_n}"
            f"_s{self.stages}{'_ov1' if self.overlap else ''}{'_kr1' if self.kv_regs else ''}"
        )

    @property
    def config_type(self) -> str:
        flags = ""
        if self.overlap or self.kv_regs:
            flags = f", {str(self.overlap).lower()}"
        if self.kv_regs:
            flags += ", true"
        return (
            f"Sm90BwdConfig<{DTYPES[self.dtype][1]}, {self.head_dim}, {self.block_m}, "
            f"{self.block_n}, {self.stages}{flags}>"
        )


def _product(family, dtypes, head_dims, tiles, warps, accums, softmaxes):
    for dt, hd, (bm, bn), (wm, wn), acc, sm in itertools.product(
        dtypes, head_dims, tiles, warps, accums, softmaxes
    ):
        yield FwdEntry(family, dt, hd, bm, bn, wm, wn, acc, sm)


def forward_space() -> list[FwdEntry | Fwd90Entry]:
    """Every declared forward configuration (valid or not; the C++ rules decide)."""
    entries: list[FwdEntry] = []
    # Ampere and later (m16n8k16). Register softmax with all warps along M is FlashAttention-2's
    # arrangement; shared softmax lets warps split the key block too. fp16 accumulation is
    # offered where it saves registers for the largest tiles.
    tiles80 = [(64, 64), (64, 128), (128, 32), (128, 64), (128, 128)]
    entries += _product(80, ["f16", "bf16"], [32, 64, 96, 128, 256], tiles80,
                        [(4, 1), (8, 1)], [32], ["preg"])
    entries += _product(80, ["f16"], [64, 128], [(64, 64), (128, 64), (128, 128)],
                        [(4, 1)], [16], ["preg"])
    entries += _product(80, ["f16", "bf16"], [64, 128], [(64, 64), (128, 64)],
                        [(2, 2), (4, 2)], [32], ["psmem"])
    # Volta (m8n8k4): fp16 only, both accumulations, S and P through shared memory.
    tiles70 = [(64, 32), (64, 64), (128, 32), (128, 64)]
    entries += _product(70, ["f16"], [32, 64, 96, 128], tiles70,
                        [(2, 1), (4, 1), (2, 2)], [32, 16], ["psmem"])
    # Hopper (wgmma + TMA, sm_90a): (head_dim, block_m, block_n, stages). Two consumer
    # warpgroups of 64 rows; a deeper K/V pipeline where shared memory allows it.
    tiles90 = [(64, 128, 128, 2), (64, 128, 128, 3), (64, 128, 176, 2), (128, 128, 128, 2),
               (128, 128, 64, 3), (256, 128, 64, 2), (256, 128, 80, 2)]
    entries += [Fwd90Entry(dt, hd, bm, bn, st) for dt in ("f16", "bf16")
                for hd, bm, bn, st in tiles90]
    # the scheduled variants: intra-warpgroup overlap, then ping-pong on top of it. (Head dim
    # 128 with key blocks of 160 and 176: correct, 7-30% slower than 128 on an H200 at every
    # shape of the sweep; 192 spilled in ptxas -v. Not declared: BENCHMARKS.md, "Wider key
    # blocks at head dim 128".)
    sched90 = [(64, 128, 128, 2), (64, 128, 128, 3), (128, 128, 128, 2), (128, 128, 64, 3)]
    entries += [Fwd90Entry(dt, hd, bm, bn, st, True, pp) for dt in ("f16", "bf16")
                for hd, bm, bn, st in sched90 for pp in (False, True)]
    # head dim 64 with three consumer warpgroups (192 query rows a block): the plain and the
    # overlapped orders (ping-pong alternates between two warpgroups)
    entries += [Fwd90Entry(dt, 64, 192, 128, 2, ov, False) for dt in ("f16", "bf16")
                for ov in (True, False)]
    # persistent blocks (``_ps1``): the plain and the overlapped orders of the fastest tiles
    # (m192n128_s2_ps1, three warpgroups without the overlap, spilled 8 B in ptxas -v for
    # sm_90a in its tile loop when it was added, none now; on an H200 it is the fastest kernel
    # of several short head dim 64 shapes, BENCHMARKS.md "Persistent blocks, second version")
    pers90 = [(64, 128, 128, 2, False, False), (64, 128, 128, 2, True, False),
              (64, 128, 128, 3, False, False), (64, 192, 128, 2, True, False),
              (64, 192, 128, 2, False, False),
              (128, 128, 128, 2, False, False), (128, 128, 128, 2, True, False),
              (128, 128, 128, 2, True, True)]
    entries += [Fwd90Entry(dt, hd, bm, bn, st, ov, pp, True) for dt in ("f16", "bf16")
                for hd, bm, bn, st, ov, pp in pers90]
    names = [e.name for e in entries]
    assert len(names) == len(set(names)), "duplicate configuration names"
    return entries


def _bwd_product(family, dtypes, head_dims, tiles, accums):
    for dt, hd, (bm, bn, wm, wn), acc in itertools.product(dtypes, head_dims, tiles, accums):
        yield BwdEntry(family, dt, hd, bm, bn, wm, wn, acc)


def backward_space() -> list[BwdEntry | Bwd90Entry]:
    """Every declared backward configuration (valid or not; the C++ rules decide). Kept small:
    each backward kernel takes minutes to compile."""
    entries: list[BwdEntry] = []
    # Ampere and later (m16n8k16): (block_m, block_n, warps along M, along N of S = Q K^T)
    tiles80 = [(64, 64, 4, 1), (64, 128, 4, 2), (128, 64, 8, 1)]
    entries += _bwd_product(80, ["f16"], [32, 64, 128], tiles80, [32])
    entries += _bwd_product(80, ["bf16"], [64, 128], tiles80, [32])
    # square warp tiles of S and dP (32 x 32 per warp); 128 x 128 keeps dK and dV of a larger
    # key block on chip for head dim 64, halving the dQ atomics per key
    square = [(64, 128, 2, 4)]
    entries += _bwd_product(80, ["f16", "bf16"], [64, 128], square, [32])
    entries += _bwd_product(80, ["f16", "bf16"], [64], [(128, 128, 2, 4)], [32])
    entries += _bwd_product(80, ["f16"], [32, 64, 128], [(64, 64, 4, 1)], [16])
    # Volta (m8n8k4): fp16 only, 96 KB of shared memory. Eight warps, so that dK and dV (fp32,
    # held for the whole walk) and a step's accumulators fit the 255 registers of a thread
    # (the Volta register rule of bwd_config.h); head dim 128 with key blocks of 32, and with
    # fp32 accumulation only: with fp16 accumulation it needs 263 (it spilled 8 B).
    entries += _bwd_product(70, ["f16"], [32, 64], [(64, 64, 2, 4)], [32, 16])
    entries += _bwd_product(70, ["f16"], [128], [(64, 32, 2, 4)], [32])
    # Hopper (wgmma + TMA, sm_90a): (head_dim, block_m, block_n, stages). Two consumer
    # warpgroups of 64 keys (block_n 128) with query tiles of 64; one warpgroup (block_n 64) for
    # head dim 64. Head dim 64 with query tiles of 128 (registers), head dim 128 with 128
    # (shared memory) and head dim 256 are declared so that the rules say why they are out.
    # (Not declared: head dim 128 with one warpgroup, m64n64, which holds dQ's whole 64 x 128
    # tile in one warpgroup: ptxas serialized its wgmma for lack of registers; head dim 128
    # with three stages: no spill in ptxas -v since P^T's softmax lost its branch per element
    # (12 B before), but on an H200 no faster than two (0.97-1.04x, BENCHMARKS.md).)
    tiles90 = [(64, 64, 128, 2), (64, 128, 128, 2), (64, 64, 64, 2), (128, 64, 128, 2),
               (128, 128, 128, 2), (256, 64, 128, 2)]
    entries += [Bwd90Entry(dt, hd, bm, bn, st) for dt in ("f16", "bf16")
                for hd, bm, bn, st in tiles90]
    # the overlapped order (``_ov1``, three stages): head dim 64, and head dim 128 declared so
    # that the register rule says why it is out
    entries += [Bwd90Entry(dt, hd, 64, 128, 3, True) for dt in ("f16", "bf16") for hd in (64, 128)]
    # K and V as register operands of S^T and dP^T (``_kr1``): head dim 64, and head dim 128
    # declared so that the register rule says why it is out. (With the overlapped order as well,
    # s3_ov1_kr1, ptxas spilled 16 B and the kernel was 0.97-1.00x s2_kr1 on an H200: not declared.)
    entries += [Bwd90Entry(dt, hd, 64, 128, 2, False, True) for dt in ("f16", "bf16")
                for hd in (64, 128)]
    names = [e.name for e in entries]
    assert len(names) == len(set(names)), "duplicate configuration names"
    return entries


def full_space() -> list[FwdEntry | Fwd90Entry | BwdEntry | Bwd90Entry]:
    """The forward and the backward space: what the generator builds."""
    entries = [*forward_space(), *backward_space()]
    names = [e.name for e in entries]
    assert len(names) == len(set(names)), "duplicate configuration names"
    return entries


def select(entries: list, patterns: str | None) -> list:
    """Entries whose name matches any of the comma-separated shell patterns (all when empty)."""
    pats = [p.strip() for p in (patterns or "").split(",") if p.strip()]
    if not pats:
        return list(entries)
    return [e for e in entries if any(fnmatch.fnmatchcase(e.name, p) for p in pats)]


# ---- the defaults, and the kernels of a default build -------------------------------------------

#: Forward defaults of the mma.sync families per (family, head_dim): (block_m, block_n,
#: warps_m, warps_n), with fp32 accumulation and P in registers where the family has it. The
#: m16n8k16 entries for hd 64 and 128 are the configs that won most shapes of the 16k-token
#: sweep on an H200 (bench/spark_fwd.py --configs all); the others follow the same register
#: budget. The Volta entries are a model, not a measurement: the occupancy ranking of the sm_70
#: compile report (docs/VOLTA.md) among the kernels that pass tools/check_sm70.py. The tuner
#: replaces all of them per shape.
FWD_DEFAULTS = {
    (80, 32): (128, 128, 4, 1),
    (80, 64): (128, 64, 4, 1),
    (80, 96): (128, 64, 4, 1),
    (80, 128): (128, 64, 4, 1),
    (80, 256): (64, 64, 4, 1),
    (70, 32): (128, 32, 2, 2),
    (70, 64): (64, 32, 2, 2),
    (70, 96): (64, 32, 2, 2),
    (70, 128): (64, 32, 2, 2),
}

#: Backward defaults per (family, head_dim): (block_m, block_n, warps_m, warps_n) of the bwd
#: family, fp32 accumulation. Family 80, head dims 64 and 128: the fastest of the compiled
#: configurations at every shape of the 16k-token sweep on an H200 (bench/spark_bwd.py
#: --all-bwd); head dim 32 by register budget (dK and dV stay in registers for a whole key
#: block). The Volta entries are a model, not a measurement: the eight-warp configurations of
#: the Volta backward space that fit its register rule and pass tools/check_sm70.py
#: (docs/VOLTA.md). The tuner replaces them per shape.
BWD_DEFAULTS = {
    (80, 32): (64, 128, 4, 2),
    (80, 64): (128, 128, 2, 4),
    (80, 128): (64, 128, 2, 4),
    (70, 32): (64, 64, 2, 4),
    (70, 64): (64, 64, 2, 4),
    (70, 128): (64, 32, 2, 4),
}

#: Hopper defaults per (op, head_dim): the name's tail after the head dim. Forward, from one
#: run of every config on the 16k-token sweep on an H200 (bench/spark_fwd.py --each,
#: BENCHMARKS.md "Persistent blocks, second version"): head dim 128 with 128 x 128 tiles,
#: overlap and ping-pong, at least as fast as the overlap alone at all 12 shapes and the
#: fastest non-persistent kernel from 1k up; head dim 64 with three consumer warpgroups (192
#: query rows) without the overlap, the fastest non-persistent kernel of 7 of the 12 shapes
#: (the overlap 1-3% ahead at 8k and 16k non-causal). The tuner replaces them per shape.
SM90_DEFAULTS = {
    ("fwd", 64): "m192n128_s2",
    ("fwd", 128): "m128n128_s2_ov1_pp1",
    # Backward: two consumer warpgroups of 64 keys, query tiles of 64 (the tiles the register
    # and shared-memory rules leave). On an H200 (bwd-only TFLOP/s, 16k tokens, seqlen 4k and
    # 16k, causal and not, the family 80 defaults in the same run, BENCHMARKS.md): head dim 128
    # 397-492 against 234-275, head dim 64 268-327 against 224-266. The only backward with a
    # deterministic mode.
    # Head dim 64 with K and V in registers (``_kr1``): 1.00-1.07x the same tiles without
    # (bwd-only, same run, BENCHMARKS.md "K and V as register operands").
    ("bwd", 64): "m64n128_s2_kr1",
    ("bwd", 128): "m64n128_s2",
}

#: Hopper defaults that would serve deterministic problems only (compiled by the default build,
#: since only family 90 has that mode), where the family 80 default is faster. Empty: the
#: backward at head dim 64 was one (family 90 184-217 against 222-266 bwd-only TFLOP/s on an
#: H200) until its shared-memory accesses were fixed (268-327).
SM90_DETERMINISTIC_ONLY: frozenset[tuple[str, int]] = frozenset()


#: Declared, compiled (CI compiles one) and checked by ptxas, but not yet passed on a GPU:
#: the default build leaves them out, and dispatch and the tuner never choose them; forced by
#: name (``backend="spark", config=...``) they run, which is how their device check tests them.
#: Shell patterns of names. Empty: the Hopper backward passed tools/gpu_check_sm90_bwd.py on an
#: H200 (every compiled configuration, default and deterministic modes).
UNVERIFIED: tuple[str, ...] = ()


def is_persistent_sm90_fwd(name: str) -> bool:
    """Whether ``name`` is a persistent Hopper forward kernel: ``fwd_sm90_..._ps1``, also where
    a later suffix follows ``_ps1`` (the name's end is not enough)."""
    return name.startswith("fwd_sm90_") and "ps1" in name.split("_")


def is_unverified(name: str) -> bool:
    """Whether the configuration ``name`` waits for its first check on a GPU (:data:`UNVERIFIED`)."""
    return any(fnmatch.fnmatchcase(name, p) for p in UNVERIFIED)


def is_default(e) -> bool:
    """Whether ``e`` is the default configuration of its (family, op, dtype, head_dim); never
    one of :data:`UNVERIFIED`."""
    if is_unverified(e.name):
        return False
    if isinstance(e, (Fwd90Entry, Bwd90Entry)):
        op = "fwd" if isinstance(e, Fwd90Entry) else "bwd"
        tail = SM90_DEFAULTS.get((op, e.head_dim))
        return tail is not None and e.name.endswith(f"_d{e.head_dim}_{tail}")
    table = BWD_DEFAULTS if isinstance(e, BwdEntry) else FWD_DEFAULTS
    want = table.get((getattr(e, "family", 0), e.head_dim))
    if want is None or (e.block_m, e.block_n, e.warps_m, e.warps_n) != want or e.accum != 32:
        return False
    # the register softmax where the family has it (sm80), else the shared one (sm70)
    return isinstance(e, BwdEntry) or e.softmax == ("preg" if e.family >= 80 else "psmem")


def shipped_winners(directory) -> set[str]:
    """The spark kernels that dispatch can choose from the shipped records in ``directory``
    (``tuning_db/*.jsonl``): for each problem, GPU model and build, the fastest verified spark
    record's config (dispatch runs it when it is also the fastest candidate, and a slower spark
    record never beats it)."""
    import json
    from pathlib import Path

    best: dict[tuple, tuple[float, str]] = {}
    for path in sorted(Path(directory).glob("*.jsonl")) if directory else []:
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                if r.get("backend") != "spark" or r.get("status") != "ok":
                    continue
                median = float(r["time_ms"]["median"])
                err, limit = r.get("error"), r.get("error_limit")
                if err is not None and limit is not None and err > limit:
                    continue
                dev = r["device"]
                key = (json.dumps(r["problem"], sort_keys=True), dev["name"], tuple(dev["capability"]),
                       r.get("build_id"))
                config = str(r["config"])
            except (ValueError, KeyError, TypeError):
                continue  # the store's own import reports bad lines; here they build nothing
            if key not in best or (median, config) < best[key]:
                best[key] = (median, config)
    return {config for _, config in best.values()}


def default_build(entries: list, shipped_dir=None) -> list:
    """The entries of a default build (``SPARKTUNE_KERNELS`` unset): what dispatch can choose
    without a tuning run of the user's own, i.e. the default of every (family, op, dtype,
    head dim) and the shipped winners."""
    winners = shipped_winners(shipped_dir)
    # a configuration that waits for its first GPU check is never built by default, even where
    # a shipped record names it
    return [e for e in entries if (is_default(e) or e.name in winners) and not is_unverified(e.name)]


def build_selection(entries: list, spec: str | None, shipped_dir=None) -> list:
    """The entries a build compiles for ``SPARKTUNE_KERNELS=spec``: comma-separated shell
    patterns of names, and the words ``default`` (:func:`default_build`) and ``all`` (every
    entry); empty means ``default``. In the space's order, each entry once."""
    items = [p.strip() for p in (spec or "").split(",") if p.strip()] or ["default"]
    keep: set[str] = set()
    if "all" in items:
        keep.update(e.name for e in entries)
    if "default" in items:
        keep.update(e.name for e in default_build(entries, shipped_dir))
    pats = [p for p in items if p not in ("all", "default")]
    if pats:
        keep.update(e.name for e in select(entries, ",".join(pats)))
    return [e for e in entries if e.name in keep]


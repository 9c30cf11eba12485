#!/usr/bin/env python3
"""Compile Hopper (sm90) forward and backward kernels for sm_90a without a GPU and judge the result.

For every selected ``fwd_sm90_*`` or ``bwd_sm90_*`` configuration of the declared space that the
C++ rules accept (default: one of each, ``DEFAULT``), this check generates its ``.cu`` (csrc/gen_kernels.py), compiles
it with the local nvcc to PTX and to an sm_90a object with ``ptxas -v``, and fails a kernel on
a build error, any spill or stack frame, a PTX without ``wgmma.mma_async`` or without TMA
loads (``cp.async.bulk.tensor``), where ptxas serialized the asynchronous wgmma, or where the
``setmaxnreg`` requests do not fit the registers the block is launched with (the consumers
would wait forever). One line per kernel, then ``N passed, M failed``.

``--layouts`` instead checks the selected backward configurations' register and shared-memory
layouts on the host (no GPU, one host build): the accumulator registers reused as a wgmma A
operand, the stmatrix store of dS^T, the tiles' coverage by the consumer threads and the
transposed shared-memory views (:data:`LAYOUT_CHECK_CPP`); one line per configuration.
Exit status: 0 all passed, 1 some failed, 2 the check could not run (no nvcc or CuTe).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "fwd_sm90_f16_d128_m128n128_s2,bwd_sm90_f16_d64_m64n128_s2_kr1"
# The flags of the CMake Release build (NDEBUG included: CuTe's debug asserts, such as the
# alignment check of a position-independent swizzled view, are calls to __assertfail, and a
# call between wgmma instructions makes ptxas serialize them in a build that keeps them)
NVCC_FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "--use_fast_math"]
GENCODE = ["-gencode", "arch=compute_90a,code=sm_90a"]


class ToolUnavailable(RuntimeError):
    pass


def find_nvcc() -> Path:
    for c in [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]:
        if c and Path(c).is_file():
            return Path(c)
    raise ToolUnavailable("no nvcc on PATH")


def cutlass_include() -> Path:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise ToolUnavailable("the nvidia-cutlass package is not installed")
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    if not (inc / "cute" / "tensor.hpp").is_file():
        raise ToolUnavailable(f"no CuTe headers under {inc}")
    return inc


def parse_ptxas(log: str, entry: str | None = None) -> dict:
    """Registers, spill bytes and stack frame of the kernel entry in a ``ptxas -v`` log: the
    first entry whose mangled name contains ``entry`` (a backward unit also holds the
    preprocess and dQ conversion kernels), else the first of the log."""
    out = {"registers": None, "spill_stores": None, "spill_loads": None, "stack_frame": None}
    if entry is not None:
        parts = re.split(r"(?=ptxas info\s*: Compiling entry function )", log)
        mine = [part for part in parts if part.startswith("ptxas info") and entry in part.split("\n")[0]]
        if mine:
            log = mine[0]
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        out["stack_frame"], out["spill_stores"], out["spill_loads"] = map(int, m.groups())
    m = re.search(r"Used (\d+) registers", log)
    if m:
        out["registers"] = int(m.group(1))
    return out


def parse_ptxas_entries(log: str, entry: str) -> list[dict]:
    """:func:`parse_ptxas` of every entry whose mangled name contains ``entry`` (the backward
    kernel has two instantiations: plain, and with soft-capping or ALiBi), in log order."""
    parts = re.split(r"(?=ptxas info\s*: Compiling entry function )", log)
    mine = [part for part in parts if part.startswith("ptxas info") and entry in part.split("\n")[0]]
    return [parse_ptxas(part) for part in mine] or [parse_ptxas(log, entry)]


def register_pool_reasons(ptx: str, registers: int | None, threads: int) -> list[str]:
    """Why the setmaxnreg requests of a kernel cannot all be granted (empty: they can). The
    block is launched with ptxas's register count for every thread (rounded up to 8, the
    allocation granule); setmaxnreg only moves registers within that pool, so the producer
    warpgroup's decrease plus the consumer warpgroups' increase must fit it, or the consumers'
    setmaxnreg.inc waits forever (a hang on the GPU that no compiler reports). An increase
    below the launch count, or a decrease above it, is refused too (not an increase/decrease)."""
    dec = [int(x) for x in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx)]
    inc = [int(x) for x in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)]
    if not dec and not inc:
        return []
    if registers is None:
        return ["setmaxnreg without a ptxas register count to check it against"]
    if len(set(dec)) > 1 or len(set(inc)) > 1 or not dec or not inc:
        return [f"setmaxnreg: expected one decrease and one increase, got dec {dec} inc {inc}"]
    launch = -(-registers // 8) * 8
    d, i = dec[0], inc[0]
    need = 128 * d + (threads - 128) * i
    reasons = []
    if need > launch * threads:
        reasons.append(f"setmaxnreg asks for 128 x {d} + {threads - 128} x {i} = {need} registers, "
                       f"the block has {launch} x {threads} = {launch * threads}: the consumers "
                       "would wait forever")
    if i < launch or d > launch:
        reasons.append(f"setmaxnreg.inc {i} / .dec {d} against a launch count of {launch}")
    return reasons


# The backward's register and shared-memory layout facts, checked on the host (CuTe's layout
# algebra runs there), for the --layouts mode: (1) the S^T / dP^T accumulator registers seen
# through sm90::acc_as_operand_a are the A operand coordinates the register-sourced dV/dK wgmma
# expects; (2) stmatrix moves each dS^T accumulator element to its own coordinate; (3) every
# element of the S^T, dS^T store, dQ and dK/dV tiles is held by exactly one consumer thread;
# (4) the transposed views K^T, Q^T / dO^T and dS^T address the element of the tile they view,
# under the same swizzle.
LAYOUT_CHECK_CPP = r"""#include <cstdio>
#include <vector>
#include "sparktune/sm90_bwd_traits.h"
#include "sparktune/sm90_bwd_kernel.h"  // sm90::acc_as_operand_a, sm90::dq_tile_offset
using namespace cute;
template <class Cfg> int verify(const char* name) {
  using Tr = sparktune::Sm90BwdTraits<Cfg>;
  constexpr int BN = Cfg::kBlockN, BM = Cfg::kBlockM;
  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmaDkv mma_dkv;
  auto copy_ds = make_tiled_copy_C(typename Tr::SmemCopyAtomDs{}, mma_sdp);
  int bad = 0, checked = 0;
  for (int tid = 0; tid < Cfg::kConsumerThreads; ++tid) {
    auto cS = mma_sdp.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<BN>, Int<BM>>{}));
    // (1) accumulator registers seen as dkv's A operand == the A coordinates the RS MMA expects
    auto asA = make_tensor(cS.data(), sparktune::sm90::acc_as_operand_a(cS.layout()));
    auto wantA = mma_dkv.get_thread_slice(tid).partition_A(make_identity_tensor(Shape<Int<BN>, Int<BM>>{}));
    static_assert(decltype(size(asA))::value == decltype(size(wantA))::value);
    for (int m = 0; m < size<1>(wantA); ++m)
      for (int k = 0; k < size<2>(wantA); ++k)
        for (int v = 0; v < size<0>(wantA); ++v) {
          ++checked;
          if (asA(v, m, k) != wantA(v, m, k)) {
            if (bad++ < 5) { printf("A mismatch tid %d v%d m%d k%d: ", tid, v, m, k); print(asA(v, m, k)); print(wantA(v, m, k)); printf("\n"); }
          }
        }
    // (2) stmatrix: the retiled accumulator coordinates == the smem coordinates they go to
    auto thr_copy = copy_ds.get_thread_slice(tid);
    auto src = thr_copy.retile_S(cS);
    auto dst = thr_copy.partition_S(make_identity_tensor(Shape<Int<BN>, Int<BM>>{}));
    static_assert(decltype(size(src))::value == decltype(size(dst))::value);
    for (int i = 0; i < size(src); ++i) {
      ++checked;
      if (src(i) != dst(i)) { if (bad++ < 5) { printf("copy mismatch tid %d i %d: ", tid, i); print(src(i)); print(dst(i)); printf("\n"); } }
    }
  }
  // (3) every element of each tile is held by exactly one consumer thread: S^T/dP^T
  //     accumulators, stmatrix destinations, dQ's accumulators (added to the workspace), dK/dV's
  auto cover = [&](const char* what, int rows, int cols, auto coords_of) {
    std::vector<int> hits(rows * cols, 0);
    for (int tid = 0; tid < Cfg::kConsumerThreads; ++tid) {
      auto c = coords_of(tid);
      for (int i = 0; i < size(c); ++i) {
        int r = get<0>(c(i)), q = get<1>(c(i));
        if (r < 0 || r >= rows || q < 0 || q >= cols) { if (bad++ < 5) printf("%s out of tile\n", what); continue; }
        ++hits[r * cols + q];
      }
    }
    for (int i = 0; i < rows * cols; ++i) {
      ++checked;
      if (hits[i] != 1 && bad++ < 5) printf("%s: (%d, %d) held %d times\n", what, i / cols, i % cols, hits[i]);
    }
  };
  typename Tr::TiledMmaDq mma_dq;
  constexpr int D = Cfg::kHeadDim;
  cover("S^T", BN, BM, [&](int t) { return mma_sdp.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<BN>, Int<BM>>{})); });
  cover("dS^T stmatrix", BN, BM, [&](int t) { return copy_ds.get_thread_slice(t).partition_D(make_identity_tensor(Shape<Int<BN>, Int<BM>>{})); });
  cover("dQ", BM, D, [&](int t) { return mma_dq.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{})); });
  cover("dK/dV", BN, D, [&](int t) { return mma_dkv.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<BN>, Int<D>>{})); });
  // (4) the transposed views address the same element as the tile they view
  {
    auto K = typename Tr::SmemLayoutK{}.layout_b(); auto Kt = typename Tr::SmemLayoutKt{}.layout_b();
    for (int d = 0; d < D; ++d) for (int n = 0; n < BN; ++n) { ++checked; if (Kt(d, n) != K(n, d) && bad++ < 5) printf("Kt(%d,%d)\n", d, n); }
    auto Q = typename Tr::SmemLayoutQ{}.layout_b(); auto Qt = typename Tr::SmemLayoutQt{}.layout_b();
    for (int st = 0; st < Cfg::kStages; ++st) for (int d = 0; d < D; ++d) for (int m = 0; m < BM; ++m) { ++checked; if (Qt(d, m, st) != Q(m, d, st) && bad++ < 5) printf("Qt(%d,%d,%d)\n", d, m, st); }
    auto S = typename Tr::SmemLayoutDs{}.layout_b(); auto St = typename Tr::SmemLayoutDst{}.layout_b();
    for (int b = 0; b < 2; ++b) for (int n = 0; n < BN; ++n) for (int m = 0; m < BM; ++m) { ++checked; if (St(n, m, b) != S(m, n, b) && bad++ < 5) printf("Dst(%d,%d,%d)\n", n, m, b); }
    // the same swizzle on both views of each tile
    static_assert(std::is_same_v<decltype(typename Tr::SmemLayoutK{}.layout_a()), decltype(typename Tr::SmemLayoutKt{}.layout_a())>);
    static_assert(std::is_same_v<decltype(typename Tr::SmemLayoutQ{}.layout_a()), decltype(typename Tr::SmemLayoutQt{}.layout_a())>);
    static_assert(std::is_same_v<decltype(typename Tr::SmemLayoutDs{}.layout_a()), decltype(typename Tr::SmemLayoutDst{}.layout_a())>);
  }
  // (5) dQ's shared fp32 tile: where each consumer thread stores its accumulator elements ==
  //     the tile's layout at the coordinates CuTe gives them (what the TMA reduce-add reads)
  {
    auto Dq = typename Tr::SmemLayoutDq{};
    for (int tid = 0; tid < Cfg::kConsumerThreads; ++tid) {
      auto c = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
      static_assert(decltype(size<2>(c))::value == 1, "one dQ tile along head_dim per warpgroup");
      const sparktune::sm90::DqStore<BM, Cfg::kDqCols> store(tid);
      for (int mt = 0; mt < size<1>(c); ++mt) for (int v = 0; v < size<0>(c); ++v) {
        ++checked;
        // the swizzle acts on byte addresses (the tile starts on a 1024-byte boundary)
        const int want = Dq.layout_a()(4 * Dq.layout_b()(get<0>(c(v, mt, 0)), get<1>(c(v, mt, 0)))) / 4;
        const int got = store.offset(v, mt);
        if (want != got && bad++ < 5) printf("dQ tile tid %d v%d m%d: %d, layout %d\n", tid, v, mt, got, want);
      }
    }
  }
  // (6) each consumer warpgroup's part of that tile (its own TMA reduce-add reads it through
  //     SmemLayoutDqPart from g * block_m * kDqCols floats on) is the tile's layout there
  {
    auto Dq = typename Tr::SmemLayoutDq{};
    auto Part = typename Tr::SmemLayoutDqPart{};
    constexpr int W = Cfg::kDqCols;
    for (int g = 0; g < Cfg::kConsumerWarpgroups; ++g) for (int r = 0; r < BM; ++r) for (int c = 0; c < W; ++c) {
      ++checked;
      const int whole = Dq.layout_a()(4 * Dq.layout_b()(r, g * W + c)) / 4;
      const int part = g * BM * W + Part.layout_a()(4 * Part.layout_b()(r, c)) / 4;
      if (whole != part && bad++ < 5) printf("dQ part %d (%d, %d): %d, tile %d\n", g, r, c, part, whole);
    }
  }
  printf("%s: %d checked, %d mismatches\n", name, checked, bad);
  return bad;
}
"""


def check_layouts(entries: list[tuple[str, str]], gen: Path, nvcc: Path,
                  includes: list[Path]) -> tuple[bool, str]:
    """Compile and run :data:`LAYOUT_CHECK_CPP` on the host for (name, config type) pairs of the
    backward; one line per configuration."""
    calls = "\n".join(f'  bad += verify<sparktune::{t}>("{n}");' for n, t in entries)
    src = gen / "sm90_bwd_layouts.cu"
    src.write_text(LAYOUT_CHECK_CPP + "int main() {\n  int bad = 0;\n" + calls +
                   "\n  return bad != 0;\n}\n")
    exe = gen / "sm90_bwd_layouts"
    res = subprocess.run([str(nvcc), "-std=c++17", "--expt-relaxed-constexpr", "-w",
                          *[f"-I{i}" for i in includes], str(src), "-o", str(exe)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return False, f"layouts: FAIL: host build error\n{res.stderr[-3000:]}"
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    return res.returncode == 0, res.stdout.strip() + ("" if res.returncode == 0 else "\nlayouts: FAIL")


def check_kernel(name: str, gen: Path, nvcc: Path, includes: list[Path],
                 threads: int | None = None) -> tuple[bool, str]:
    src = gen / f"{name}.cu"
    inc = [f"-I{i}" for i in includes]
    ptx = gen / f"{name}.ptx"
    res = subprocess.run([str(nvcc), *NVCC_FLAGS, "-gencode", "arch=compute_90a,code=compute_90a",
                          *inc, "--ptx", str(src), "-o", str(ptx)], capture_output=True, text=True)
    if res.returncode != 0:
        return False, f"{name}: FAIL: PTX build error\n{res.stderr[-3000:]}"
    text = ptx.read_text()
    n_wgmma = text.count("wgmma.mma_async")
    n_tma = text.count("cp.async.bulk.tensor")
    res = subprocess.run([str(nvcc), *NVCC_FLAGS, *GENCODE, *inc, "-Xptxas=-v,-warn-spills",
                          "-c", str(src), "-o", str(gen / f"{name}.o")],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return False, f"{name}: FAIL: sm_90a build error\n{res.stderr[-3000:]}"
    # the kernel entry's report (the register function of the .cu has no device code)
    log = res.stdout + res.stderr
    # every instantiation of the kernel entry (the backward's plain one and the one with
    # soft-capping and ALiBi): each is judged; the line shows the worst
    entries = parse_ptxas_entries(
        log, "sm90_bwd_kernel" if name.startswith("bwd_") else "sm90_fwd_kernel")
    reasons = []
    for i, one in enumerate(entries):
        which = f"entry {i + 1} of {len(entries)}: " if len(entries) > 1 else ""
        if (one["spill_stores"] or 0) + (one["spill_loads"] or 0):
            reasons.append(f"{which}spills {one['spill_stores']} B stores / {one['spill_loads']} B loads")
        if one["stack_frame"]:
            reasons.append(f"{which}{one['stack_frame']} B stack frame")
        if one["registers"] is None:
            reasons.append(f"{which}no ptxas report of the kernel")
    st = max(entries, key=lambda e: ((e["spill_stores"] or 0) + (e["spill_loads"] or 0),
                                     e["stack_frame"] or 0, e["registers"] or 0))
    if threads is not None:
        for one in entries:
            for why in register_pool_reasons(text, one["registers"], threads):
                if why not in reasons:
                    reasons.append(why)
    if not n_wgmma:
        reasons.append("no wgmma.mma_async in the PTX")
    if not n_tma:
        reasons.append("no TMA load (cp.async.bulk.tensor) in the PTX")
    # ptxas makes asynchronous wgmma synchronous when it cannot prove the registers of an
    # in-flight product untouched (C7515/C7510 "Potential Performance Loss"): the overlap is gone
    if "wgmma.mma_async instructions are serialized" in log:
        m = re.search(r"wgmma\.mma_async instructions are serialized[^\n]*", log)
        reasons.append("ptxas serialized the wgmma: " + m.group(0))
    line = (f"{name} regs={st['registers']} spill={st['spill_stores']}/{st['spill_loads']} "
            f"stack={st['stack_frame']} wgmma={n_wgmma} tma={n_tma} ")
    return not reasons, line + ("PASS" if not reasons else "FAIL: " + "; ".join(reasons))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--filter", default=DEFAULT,
                    help="comma-separated shell patterns of sm90 kernel names (default: %(default)s)")
    ap.add_argument("--keep", help="write the generated files here instead of a temporary folder")
    ap.add_argument("--layouts", action="store_true",
                    help="instead of compiling the kernels, check the selected backward "
                         "configurations' register and shared-memory layouts on the host")
    args = ap.parse_args(argv)
    try:
        nvcc = find_nvcc()
        cutlass = cutlass_include()
    except ToolUnavailable as e:
        print(f"check_sm90: cannot run: {e}", file=sys.stderr)
        return 2
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="sparktune-sm90-")
    gen = Path(args.keep or tmp.name)
    gen.mkdir(parents=True, exist_ok=True)
    includes = [cutlass, ROOT / "csrc" / "include"]
    cmd = [sys.executable, str(ROOT / "csrc" / "gen_kernels.py"), "--out", str(gen), "--nvcc",
           str(nvcc), "--include", str(cutlass), "--include", str(ROOT / "csrc" / "include"),
           "--filter", args.filter, "--families", "90"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [r.split("\t") for r in (gen / "space.tsv").read_text().splitlines() if r.strip()]
    names = [r[0] for r in rows
             if r[1] == "1" and any(fnmatch.fnmatchcase(r[0], f"{op}_sm90_*") for op in ("fwd", "bwd"))]
    threads = {r[0]: int(r[3]) for r in rows if r[1] == "1"}
    if not names:
        print(f"check_sm90: no valid sm90 kernel matches {args.filter!r}", file=sys.stderr)
        return 1
    if args.layouts:
        sys.path.insert(0, str(ROOT))
        from sparktune.kernels import kernel_space

        types = {e.name: e.config_type for e in kernel_space.full_space()}
        bwd = [(n, types[n]) for n in names if n.startswith("bwd_sm90_")]
        if not bwd:
            print(f"check_sm90: no valid sm90 backward matches {args.filter!r}", file=sys.stderr)
            return 1
        ok, out = check_layouts(bwd, gen, nvcc, includes)
        print(out)
        if tmp is not None:
            tmp.cleanup()
        return 0 if ok else 1
    passed = failed = 0
    for name in names:
        ok, line = check_kernel(name, gen, nvcc, includes, threads[name])
        print(line, flush=True)
        passed += ok
        failed += not ok
    print(f"{passed} passed, {failed} failed")
    if tmp is not None:
        tmp.cleanup()
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

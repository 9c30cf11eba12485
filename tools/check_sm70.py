#!/usr/bin/env python3
"""Prove the Volta (sm_70) kernel family without a V100 or a CUDA 12 toolkit.

For every Volta-atom configuration (``*_sm70_*``) of the declared space that the C++ rules
accept, this check:

1. compiles the generated ``.cu`` with the local nvcc (CUDA 13 cannot target sm_70) to PTX for
   ``compute_75``, whose PTX is the closest one CUDA 13 still writes;
2. rewrites the PTX header to ``.target sm_70`` and a ``.version`` the CUDA 12.x assembler reads;
3. assembles it with ``ptxas -arch=sm_70 -v --warn-on-spills`` from the PyPI wheel
   ``nvidia-cuda-nvcc-cu12`` (registers, spills, static shared memory);
4. disassembles the cubin with a CUDA 12.x ``nvdisasm`` (the one inside the ``triton==3.3.1``
   wheel; CUDA 13's tools cannot read sm_70 cubins) and counts ``HMMA.884`` instructions.

It prints one line per kernel and then ``N passed, M failed``. A kernel fails on a build error,
any spill, more than 96 KB of shared memory (static + dynamic) or no ``mma.m8n8k4`` in its PTX.
Exit status: 0 all passed, 1 some failed, 2 the check could not run (tools missing).

Results are cached by a hash of everything that decides them (the generated source, the
project headers it includes, the CuTe version, the tool versions and flags), so a rerun is fast.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK_VERSION = "2"  # bump when flags or parsing change: invalidates the cache

PTXAS_WHEEL = ("nvidia-cuda-nvcc-cu12", "12.9.86", "nvidia/cuda_nvcc/bin/ptxas")
NVDISASM_WHEEL = ("triton", "3.3.1", "triton/backends/nvidia/bin/nvdisasm")
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "--use_fast_math",
              "-arch=compute_75", "--ptx"]
PTXAS_FLAGS = ["-arch=sm_70", "-v", "--warn-on-spills"]
VOLTA_SMEM_LIMIT = 96 * 1024
SM70_NAME = "*_sm70_*"
MMA_PTX = "mma.sync.aligned.m8n8k4"
HMMA_SASS = "HMMA.884"

# PTX ISA version written by each CUDA 12.x release (PTX ISA release notes); ptxas of that
# release reads that version and every older one.
PTX_ISA_OF_CUDA = {
    (12, 0): "8.0", (12, 1): "8.1", (12, 2): "8.2", (12, 3): "8.3", (12, 4): "8.4",
    (12, 5): "8.5", (12, 6): "8.5", (12, 8): "8.7", (12, 9): "8.8",
}

# V100 (compute capability 7.0), as the CUDA occupancy calculator models it
V100_SMS = 80
V100_REGS_PER_SM = 65536
V100_REG_SUBPARTITIONS = 4  # one register file per scheduler
V100_REG_ALLOC_UNIT = 256  # registers, allocated per warp
V100_SMEM_PER_SM = 96 * 1024
V100_SMEM_ALLOC_UNIT = 256
V100_MAX_THREADS = 2048
V100_MAX_WARPS = 64
V100_MAX_BLOCKS = 32


class ToolUnavailable(RuntimeError):
    """A tool the check needs cannot be found or fetched (e.g. PyPI is unreachable)."""


# ------------------------------------------------------------------------------ pure helpers
def rewrite_ptx_header(ptx: str, isa_version: str = "8.8", target: str = "sm_70") -> str:
    """The PTX with its ``.version`` and ``.target`` directives set for the sm_70 assembler.

    Only the architecture token of ``.target`` changes; modifiers after it (e.g. ``, debug``)
    stay. Raises ValueError when the PTX has no such directives.
    """
    out, n_version, n_target = [], 0, 0
    for line in ptx.splitlines(keepends=True):
        stripped = line.lstrip()
        if stripped.startswith(".version") and n_version == 0:
            m = re.match(r"(\s*\.version\s+)\d+\.\d+(.*)", line, re.S)
            if m:
                line = f"{m.group(1)}{isa_version}{m.group(2)}"
                n_version += 1
        elif stripped.startswith(".target") and n_target == 0:
            m = re.match(r"(\s*\.target\s+)sm_\d+[a-z]?(.*)", line, re.S)
            if m:
                line = f"{m.group(1)}{target}{m.group(2)}"
                n_target += 1
        out.append(line)
    if not (n_version and n_target):
        raise ValueError("PTX without .version/.target directives")
    return "".join(out)


def ptx_isa_for(ptxas_version: tuple[int, int]) -> str:
    """The PTX ISA version a CUDA 12.x ptxas of this release reads (newest known when newer)."""
    if ptxas_version in PTX_ISA_OF_CUDA:
        return PTX_ISA_OF_CUDA[ptxas_version]
    older = [v for v in PTX_ISA_OF_CUDA if v <= ptxas_version]
    if not older:
        raise ValueError(f"no PTX ISA known for CUDA {ptxas_version}")
    return PTX_ISA_OF_CUDA[max(older)]


def parse_tool_version(text: str) -> tuple[int, int] | None:
    """(major, minor) from a CUDA tool's ``--version`` text ("release 12.9, V12.9.86")."""
    m = re.search(r"release (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass
class EntryStats:
    """What ptxas -v says about one function (an entry, or a device function it calls)."""

    name: str
    entry: bool = True
    registers: int = 0
    static_smem: int = 0
    stack_frame: int = 0
    cumulative_stack: int = 0  # with the callees' frames (entries only)
    spill_stores: int = 0
    spill_loads: int = 0
    barriers: int = 0


def parse_ptxas_log(log: str) -> list[EntryStats]:
    """Per-function statistics from the output of ``ptxas -v``.

    ptxas prints, per entry, "Compiling entry function 'X'", then "Function properties for X"
    with its stack frame and spills, then "Used N registers ...". A device function that was
    not inlined gets a "Function properties for Y" block of its own, which must not be read as
    the entry's.
    """
    funcs: dict[str, EntryStats] = {}
    last_entry: EntryStats | None = None
    current: EntryStats | None = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            last_entry = funcs.setdefault(m.group(1), EntryStats(m.group(1)))
            last_entry.entry = True
            current = last_entry
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = funcs.setdefault(m.group(1), EntryStats(m.group(1), entry=False))
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m and current is not None:
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and last_entry is not None:
            last_entry.registers = int(m.group(1))
            b = re.search(r"used (\d+) barriers", line)
            last_entry.barriers = int(b.group(1)) if b else 0
            s = re.search(r"(\d+) bytes smem", line)
            last_entry.static_smem = int(s.group(1)) if s else 0
            c = re.search(r"(\d+) bytes cumulative stack size", line)
            last_entry.cumulative_stack = int(c.group(1)) if c else 0
    return list(funcs.values())


def count_ptx_mma(ptx: str) -> int:
    return sum(1 for line in ptx.splitlines() if MMA_PTX in line)


def count_sass_hmma(sass: str) -> int:
    return sum(1 for line in sass.splitlines() if HMMA_SASS in line)


def v100_occupancy(registers: int, smem_bytes: int, threads: int) -> dict:
    """Theoretical resident blocks and warps per V100 SM (the occupancy calculator's model)."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // V100_REG_ALLOC_UNIT) * V100_REG_ALLOC_UNIT
    warps_per_sub = (V100_REGS_PER_SM // V100_REG_SUBPARTITIONS) // regs_per_warp
    by_regs = (warps_per_sub * V100_REG_SUBPARTITIONS) // warps
    smem = -(-smem_bytes // V100_SMEM_ALLOC_UNIT) * V100_SMEM_ALLOC_UNIT
    by_smem = V100_SMEM_PER_SM // smem if smem else 1 << 30
    by_threads = min(V100_MAX_THREADS // threads, V100_MAX_WARPS // warps)
    limits = {"registers": by_regs, "shared memory": by_smem, "threads": by_threads,
              "blocks": V100_MAX_BLOCKS}
    blocks = min(limits.values())
    limiter = min(limits, key=lambda k: limits[k])
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps,
            "occupancy": blocks * warps / V100_MAX_WARPS, "limited_by": limiter,
            "resident_blocks_80sm": blocks * V100_SMS}


# ------------------------------------------------------------------------------ kernel names
_NAME = re.compile(
    r"^(?P<op>[a-z]+)_sm(?P<family>\d+)_(?P<dtype>[a-z0-9]+)_d(?P<head_dim>\d+)"
    r"_m(?P<block_m>\d+)n(?P<block_n>\d+)_w(?P<warps_m>\d+)x(?P<warps_n>\d+)"
    r"_acc(?P<accum>\d+)(?:_(?P<rest>.*))?$"
)


def parse_kernel_name(name: str) -> dict:
    """The parameters encoded in a kernel name (empty when it does not follow the scheme)."""
    m = _NAME.match(name)
    if not m:
        return {}
    d = {k: (int(v) if v is not None and v.isdigit() else v) for k, v in m.groupdict().items()}
    return d


def select_names(names: list[str], patterns: str | None) -> list[str]:
    """Volta names matching any comma-separated shell pattern (all Volta names when empty)."""
    pats = [p.strip() for p in (patterns or "").split(",") if p.strip()] or [SM70_NAME]
    return [n for n in names
            if fnmatch.fnmatchcase(n, SM70_NAME) and any(fnmatch.fnmatchcase(n, p) for p in pats)]


# ------------------------------------------------------------------------------ report lines
@dataclass
class KernelResult:
    name: str
    ok_build: bool = False
    error: str = ""
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_frame: int | None = None
    static_smem: int | None = None
    dynamic_smem: int | None = None
    threads: int | None = None
    ptx_mma: int | None = None
    sass_hmma: int | None = None  # None: no CUDA 12.x nvdisasm at hand
    entries: list[dict] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)  # device functions not inlined
    ptxas_log: str = ""
    seconds: float = 0.0
    cached: bool = False
    passed: bool = False
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    occupancy: dict | None = None
    reg_estimate: int | None = None  # the Volta register rule of the C++ config, when it has one
    reg_limit: int | None = None


def judge(r: KernelResult) -> KernelResult:
    """Decide PASS/FAIL with every reason, and add notes that do not fail a kernel."""
    reasons, notes = [], []
    if not r.ok_build:
        lines = [ln.strip() for ln in r.error.strip().splitlines() if ln.strip()]
        first = next((ln for ln in lines if re.search(r"\berror\b", ln)), lines[-1] if lines else "?")
        reasons.append("build error: " + re.sub(r"/\S*/sparktune-sm70-gen-[^/]+/", "", first))
    else:
        spill = (r.spill_stores or 0) + (r.spill_loads or 0)
        if spill:
            reasons.append(f"spills {r.spill_stores} B stores / {r.spill_loads} B loads")
        smem = (r.static_smem or 0) + (r.dynamic_smem or 0)
        if smem > VOLTA_SMEM_LIMIT:
            reasons.append(f"shared memory {smem} B > {VOLTA_SMEM_LIMIT} B")
        if not r.ptx_mma:
            reasons.append("no mma.m8n8k4 in the PTX")
        if r.sass_hmma is not None and r.ptx_mma:
            acc = parse_kernel_name(r.name).get("accum")
            steps = {16: 2, 32: 4}.get(acc)
            if steps and r.sass_hmma != steps * r.ptx_mma:
                notes.append(f"HMMA.884 {r.sass_hmma} != {steps} steps x {r.ptx_mma} mma")
        if r.sass_hmma == 0 and r.ptx_mma:
            reasons.append("no HMMA.884 in the SASS")
        if spill and r.reg_estimate is not None and r.reg_limit is not None \
                and r.reg_estimate <= r.reg_limit:
            notes.append(f"the register rule estimated {r.reg_estimate} <= {r.reg_limit} "
                         "registers: recalibrate it")
        if r.stack_frame and not spill:
            what = f"calls {len(r.calls)} function(s) not inlined" if r.calls else "local arrays"
            reasons.append(f"local memory: {r.stack_frame} B stack frame ({what})")
        if r.registers is not None and r.threads:
            r.occupancy = v100_occupancy(r.registers, smem, r.threads)
    r.reasons, r.notes = reasons, notes
    r.passed = r.ok_build and not reasons
    return r


def format_line(r: KernelResult, width: int = 44) -> str:
    def num(v):
        return "?" if v is None else str(v)

    spill = "?" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
    hmma = "n/a" if r.sass_hmma is None else str(r.sass_hmma)
    occ = "?" if r.occupancy is None else f"{r.occupancy['occupancy']:.0%}"
    verdict = "PASS" if r.passed else "FAIL: " + "; ".join(r.reasons)
    if r.notes:
        verdict += "  (" + "; ".join(r.notes) + ")"
    return (f"{r.name:<{width}} regs={num(r.registers):>3} spill={spill:<11} "
            f"stack={num(r.stack_frame):>5} "
            f"smem_static={num(r.static_smem):>5} smem_dyn={num(r.dynamic_smem):>5} "
            f"mma_m8n8k4={num(r.ptx_mma):>4} hmma_884={hmma:>4} occ={occ:>4} {verdict}")


_LINE = re.compile(
    r"^(?P<name>\S+)\s+regs=\s*(?P<regs>\S+) spill=(?P<spill>\S+)\s+stack=\s*(?P<stack>\S+) "
    r"smem_static=\s*(?P<smem_static>\S+) smem_dyn=\s*(?P<smem_dyn>\S+) "
    r"mma_m8n8k4=\s*(?P<mma>\S+) hmma_884=\s*(?P<hmma>\S+) occ=\s*(?P<occ>\S+) "
    r"(?P<verdict>PASS|FAIL)(?::\s*(?P<reasons>.*?))?(?:\s+\((?P<notes>.*)\))?$"
)
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$")


def parse_line(line: str) -> dict | None:
    """The fields of one report line (None when the line is not a kernel line)."""
    m = _LINE.match(line.rstrip("\n"))
    if not m:
        return None
    d = m.groupdict()

    def num(v):
        return None if v in ("?", "n/a") else int(v)

    stores, loads = (None, None) if d["spill"] == "?" else map(int, d["spill"].split("/"))
    return {"name": d["name"], "registers": num(d["regs"]), "spill_stores": stores,
            "spill_loads": loads, "stack_frame": num(d["stack"]), "static_smem": num(d["smem_static"]),
            "dynamic_smem": num(d["smem_dyn"]), "ptx_mma": num(d["mma"]),
            "sass_hmma": num(d["hmma"]), "occupancy": d["occ"],
            "passed": d["verdict"] == "PASS", "reasons": d["reasons"] or "",
            "notes": d["notes"] or ""}


# ------------------------------------------------------------------------------ the tools
def cache_root(explicit: str | None = None) -> Path:
    if explicit:
        return Path(explicit)
    if os.environ.get("SPARKTUNE_CACHE"):
        return Path(os.environ["SPARKTUNE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sparktune"


def tool_version(exe: Path | str) -> str:
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    return res.stdout.strip()


def release_line(exe: Path | str) -> str:
    """The "Cuda compilation tools, release X.Y, VX.Y.Z" line of a tool's version text."""
    lines = tool_version(exe).splitlines()
    return next((ln for ln in lines if "release" in ln), lines[-1] if lines else "?")


def _fetch_from_wheel(package: str, version: str, member: str, dest: Path) -> Path:
    """Extract one file of a PyPI wheel into ``dest`` (pip download; nothing else is fetched)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sparktune-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{package}=={version}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            msg = (res.stderr or res.stdout).strip().splitlines()
            raise ToolUnavailable(f"cannot download {package}=={version} from PyPI: "
                                  f"{msg[-1] if msg else 'no wheel'}")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                data = zf.read(member)
            except KeyError as e:
                raise ToolUnavailable(f"{wheels[0].name} has no {member}") from e
    part = dest.with_suffix(".part")
    part.write_bytes(data)
    part.chmod(part.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    part.replace(dest)
    return dest


def ensure_ptxas(cache: Path, offline: bool = False) -> Path:
    """The CUDA 12.x ptxas: $SPARKTUNE_PTXAS_SM70, else the cached one, else from PyPI."""
    env = os.environ.get("SPARKTUNE_PTXAS_SM70")
    if env:
        if not Path(env).is_file():
            raise ToolUnavailable(f"SPARKTUNE_PTXAS_SM70={env} is not a file")
        return Path(env)
    package, version, member = PTXAS_WHEEL
    dest = cache / "cu12" / f"ptxas-{version}"
    if dest.is_file():
        return dest
    if offline:
        raise ToolUnavailable(f"{dest} missing and --offline given")
    return _fetch_from_wheel(package, version, member, dest)


def find_nvdisasm(cache: Path, offline: bool = False) -> tuple[Path | None, str]:
    """A CUDA 12.x nvdisasm (CUDA 13's cannot read sm_70 cubins), and why not when None.

    Looks at $SPARKTUNE_NVDISASM_SM70, then the cached copy from the triton==3.3.1 wheel
    (fetched from PyPI when missing), then, when that cannot be had, the installed triton
    package's nvdisasm if it is a CUDA 12.x one.
    """
    def usable(c: Path) -> bool:
        if not (c.is_file() and os.access(c, os.X_OK)):
            return False
        v = parse_tool_version(tool_version(c))
        return bool(v and v[0] == 12)

    env = os.environ.get("SPARKTUNE_NVDISASM_SM70")
    if env:
        if usable(Path(env)):
            return Path(env), ""
        return None, f"SPARKTUNE_NVDISASM_SM70={env} is not a CUDA 12.x nvdisasm"
    package, version, member = NVDISASM_WHEEL
    dest = cache / "cu12" / f"nvdisasm-triton-{version}"
    why = ""
    if usable(dest):
        return dest, ""
    if offline:
        why = "no CUDA 12.x nvdisasm in the cache and --offline given"
    else:
        try:
            if usable(_fetch_from_wheel(package, version, member, dest)):
                return dest, ""
            why = f"{dest} is not a CUDA 12.x nvdisasm"
        except ToolUnavailable as e:
            why = str(e)
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            c = Path(loc) / "backends" / "nvidia" / "bin" / "nvdisasm"
            if usable(c):
                return c, ""
    except (ImportError, ValueError):
        pass
    return None, why


def find_nvcc(explicit: str | None) -> Path:
    for c in [explicit, os.environ.get("CUDACXX"), shutil.which("nvcc"),
              "/usr/local/cuda/bin/nvcc"]:
        if c and Path(c).is_file():
            return Path(c)
    raise ToolUnavailable("no nvcc (give --nvcc or put it on PATH)")


def cutlass_include() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise ToolUnavailable("the nvidia-cutlass package is not installed (pip install nvidia-cutlass)")
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    if not (inc / "cute" / "tensor.hpp").is_file():
        raise ToolUnavailable(f"no CuTe headers under {inc}")
    return inc


def cutlass_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass")
    except Exception:  # noqa: BLE001 - a missing distribution only weakens the cache key
        return "unknown"


# ------------------------------------------------------------------------------ the check
@dataclass
class Toolchain:
    nvcc: Path
    ptxas: Path
    nvdisasm: Path | None
    nvdisasm_why: str
    includes: list[Path]
    isa: str
    fingerprint: str  # hashes into every cache key


#: what the check reads from a source tree, at these paths: the generator and the kernel
#: headers, and the declared space (at ``csrc/kernel_space.py`` in older revisions)
SOURCES = ("csrc", "sparktune/kernels/kernel_space.py")


def snapshot_sources(dest: Path, rev: str | None) -> str:
    """Copy the kernel sources (``SOURCES``: the space, the generator and the kernel headers) to
    ``dest`` at the same paths, from the working tree or from a git revision, so that edits made
    while the check runs can neither mix into its results nor into its cache keys. Returns what
    was copied (a commit, maybe "+dirty")."""
    if rev is None:
        label = git_head()
        for rel in SOURCES:
            src, dst = ROOT / rel, dest / rel
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
            elif src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        return label
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                            capture_output=True, text=True)
    if commit.returncode != 0:
        raise ToolUnavailable(f"no git revision {rev!r}")
    sha = commit.stdout.strip()
    present = subprocess.run(["git", "ls-tree", "--name-only", sha, "--", *SOURCES], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", sha, *present], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return sha


def space_file(root: Path) -> Path:
    """The declared space of a source tree (``root`` holds ``csrc/``)."""
    moved = root / SOURCES[1]
    return moved if moved.is_file() else root / "csrc" / "kernel_space.py"


def generate(root: Path, nvcc: Path, includes: list[Path], patterns: str | None,
             out: Path) -> tuple[list[Path], dict[str, tuple[bool, int, int, str]]]:
    """Run the generator of the source tree ``root`` for family 70: the valid .cu files and the
    probe table."""
    pats = patterns.strip() if patterns and patterns.strip() else SM70_NAME
    cmd = [sys.executable, str(root / "csrc" / "gen_kernels.py"), "--out", str(out),
           "--nvcc", str(nvcc), "--filter", pats, "--families", "70"]
    for inc in includes:
        cmd += ["--include", str(inc)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"gen_kernels.py failed:\n{res.stdout}\n{res.stderr}")
    table: dict[str, tuple[bool, int, int, str]] = {}
    for tsv in sorted(out.glob("*space*.tsv")):
        for line in tsv.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 4:
                table[parts[0]] = (parts[1] == "1", int(parts[2]), int(parts[3]),
                                   parts[4] if len(parts) > 4 else "")
    sources = {p.stem: p for p in out.glob("*.cu")}
    listed = (out / "family70.txt").read_text().strip() if (out / "family70.txt").exists() else ""
    for item in filter(None, re.split(r"[;\n]", listed)):
        sources[Path(item).stem] = Path(item)
    names = select_names(sorted(sources), pats)
    return [sources[n] for n in names], table


def rule_estimates(root: Path, nvcc: Path, includes: list[Path], names: list[str],
                   out: Path) -> dict[str, tuple[int, int]]:
    """Per kernel name, the Volta register rule's (estimate, limit): ``kRegEstimate`` and
    ``kRegLimit`` of the configuration in ``fwd_config.h`` / ``bwd_config.h``, printed by a
    host program built from the same headers, so that the report shows the rule next to what
    ptxas did; ``root`` is the source tree (it holds ``csrc/``). Empty when the headers have no
    such rule (an older ``--rev``) or it fails to build.
    """
    spec = importlib.util.spec_from_file_location("sm70_kernel_space", space_file(root))
    if spec is None or spec.loader is None:
        return {}
    space = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = space  # dataclasses look their module up there
    try:
        spec.loader.exec_module(space)
        wanted = set(names)
        entries = [e for e in space.full_space() if e.name in wanted]
    except Exception:  # noqa: BLE001 - an unreadable space only drops the estimates column
        return {}
    finally:
        sys.modules.pop(spec.name, None)
    if not entries:
        return {}
    lines = ["#include <cstdio>", *[f'#include "{h}"' for h in sorted({e.rules_header for e in entries})],
             "using namespace sparktune;",
             "template <class C> void row(const char* n) {",
             '  std::printf("%s\\t%d\\t%d\\n", n, C::kRegEstimate, C::kRegLimit);',
             "}", "int main() {", *[f'  row<{e.config_type}>("{e.name}");' for e in entries],
             "  return 0;", "}"]
    out.mkdir(parents=True, exist_ok=True)
    src, exe = out / "reg_probe.cu", out / "reg_probe"
    src.write_text("\n".join(lines) + "\n")
    cmd = [str(nvcc), "-std=c++17", "-O0", "-o", str(exe), str(src), *[f"-I{i}" for i in includes]]
    if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:
        return {}
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    table = {}
    for line in res.stdout.splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            table[parts[0]] = (int(parts[1]), int(parts[2]))
    return table


def git_head() -> str:
    """The checkout's commit, with "+dirty" when the kernel sources differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *SOURCES], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def header_digest(include_dir: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(include_dir.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(include_dir)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def included_headers(src: Path, include_dir: Path) -> list[Path]:
    """The headers under ``include_dir`` that ``src`` includes with ``#include "..."``, directly
    or through one another (each name looked up next to the including file, then in
    ``include_dir``). Conditional includes count too: a superset only costs cache hits."""
    root = include_dir.resolve()
    found: dict[Path, None] = {}
    todo = [src.resolve()]
    while todo:
        f = todo.pop()
        for name in _QUOTED_INCLUDE.findall(f.read_text(errors="replace")):
            for base in (f.parent, root):
                c = (base / name).resolve()
                if c.is_file():
                    if root in c.parents and c not in found:
                        found[c] = None
                        todo.append(c)
                    break
    return sorted(found)


def kernel_headers_digest(src: Path, include_dir: Path) -> str:
    """A hash of the project headers one kernel source is built from (names and contents), so
    that an edit to a header the kernel does not include keeps its cached result."""
    root = include_dir.resolve()
    h = hashlib.sha256()
    for p in included_headers(src, include_dir):
        h.update(str(p.relative_to(root)).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def apply_ptxas_log(r: KernelResult) -> bool:
    """Fill registers, spills, stack and static shared memory from ``r.ptxas_log``."""
    funcs = parse_ptxas_log(r.ptxas_log)
    entries = [f for f in funcs if f.entry]
    if not entries:
        return False
    r.entries = [asdict(f) for f in funcs]
    r.registers = max(e.registers for e in entries)
    r.static_smem = max(e.static_smem for e in entries)
    r.stack_frame = max([e.cumulative_stack for e in entries] + [f.stack_frame for f in funcs])
    r.spill_stores = sum(f.spill_stores for f in funcs)
    r.spill_loads = sum(f.spill_loads for f in funcs)
    r.calls = sorted(f.name for f in funcs if not f.entry)
    return True


def compile_one(src: Path, tc: Toolchain, workdir: Path, keep: Path | None) -> KernelResult:
    name = src.stem
    r = KernelResult(name)
    t0 = time.monotonic()
    ptx_path = workdir / f"{name}.compute_75.ptx"
    cmd = [str(tc.nvcc), *NVCC_FLAGS, *[f"-I{i}" for i in tc.includes], str(src), "-o",
           str(ptx_path)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        r.error = f"nvcc: {(res.stderr or res.stdout).strip()}"
        r.seconds = time.monotonic() - t0
        return r
    ptx = ptx_path.read_text()
    r.ptx_mma = count_ptx_mma(ptx)
    try:
        ptx70 = rewrite_ptx_header(ptx, tc.isa)
    except ValueError as e:
        r.error = f"PTX header: {e}"
        return r
    ptx70_path = workdir / f"{name}.sm_70.ptx"
    ptx70_path.write_text(ptx70)
    cubin = workdir / f"{name}.sm_70.cubin"
    res = subprocess.run([str(tc.ptxas), *PTXAS_FLAGS, str(ptx70_path), "-o", str(cubin)],
                         capture_output=True, text=True)
    log = res.stdout + res.stderr
    (workdir / f"{name}.ptxas.log").write_text(log)
    if res.returncode != 0:
        r.error = f"ptxas: {log.strip()}"
        r.seconds = time.monotonic() - t0
        return r
    r.ptxas_log = log
    if not apply_ptxas_log(r):
        r.error = "ptxas: no entry function in the log"
        return r
    if tc.nvdisasm is not None:
        res = subprocess.run([str(tc.nvdisasm), "-c", str(cubin)], capture_output=True, text=True)
        if res.returncode == 0:
            r.sass_hmma = count_sass_hmma(res.stdout)
            (workdir / f"{name}.sm_70.sass").write_text(res.stdout)
        else:
            r.notes.append(f"nvdisasm failed: {res.stderr.strip()[:200]}")
    r.ok_build = True
    r.seconds = time.monotonic() - t0
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        for f in workdir.iterdir():
            shutil.copy2(f, keep / f.name)
        shutil.copy2(src, keep / src.name)
    return r


def cache_key(src: Path, tc: Toolchain, headers: str) -> str:
    h = hashlib.sha256()
    for part in (CHECK_VERSION, tc.fingerprint, headers, src.read_text()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


CACHED_FIELDS = ("ok_build", "error", "ptxas_log", "ptx_mma", "sass_hmma", "seconds")


def from_cache(name: str, key_file: Path) -> KernelResult:
    """A cached result; the ptxas numbers are parsed again from the cached log."""
    data = json.loads(key_file.read_text())
    r = KernelResult(name, cached=True, **{k: data[k] for k in CACHED_FIELDS})
    apply_ptxas_log(r)
    return r


def run_check(sources: list[Path], table: dict, tc: Toolchain, jobs: int, cache: Path | None,
              keep: Path | None, progress=None,
              estimates: dict[str, tuple[int, int]] | None = None) -> list[KernelResult]:
    results: dict[str, KernelResult] = {}
    todo: list[tuple[Path, Path | None]] = []
    for src in sources:
        key_file = None
        if cache is not None:
            headers = kernel_headers_digest(src, tc.includes[-1])
            key_file = cache / "sm70" / f"{cache_key(src, tc, headers)}.json"
            if keep is None and key_file.is_file():
                results[src.stem] = from_cache(src.stem, key_file)
                continue
        todo.append((src, key_file))

    def work(item):
        src, key_file = item
        if key_file is not None and keep is None and key_file.is_file():
            return from_cache(src.stem, key_file)  # another run finished it meanwhile
        with tempfile.TemporaryDirectory(prefix=f"sm70-{src.stem}-") as tmp:
            r = compile_one(src, tc, Path(tmp), keep / src.stem if keep else None)
        if key_file is not None and r.ok_build:
            key_file.parent.mkdir(parents=True, exist_ok=True)
            data = {k: getattr(r, k) for k in CACHED_FIELDS}
            part = key_file.with_suffix(f".{os.getpid()}.part")
            part.write_text(json.dumps(data))
            part.replace(key_file)
        return r

    done = 0
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(work, item): item[0] for item in todo}
        for fut in as_completed(futures):
            r = fut.result()
            results[r.name] = r
            done += 1
            if progress:
                progress(f"[{done}/{len(todo)}] {r.name} {'ok' if r.ok_build else 'BUILD ERROR'}"
                         f" ({r.seconds:.0f} s)")
    out = []
    for src in sources:
        r = results[src.stem]
        valid, smem, threads, _ = table.get(r.name, (True, None, None, ""))
        r.dynamic_smem, r.threads = smem, threads
        r.reg_estimate, r.reg_limit = (estimates or {}).get(r.name, (None, None))
        out.append(judge(r))
    return out


def setup_toolchain(nvcc: str | None, cache: Path, offline: bool) -> Toolchain:
    nvcc_path = find_nvcc(nvcc)
    includes = [cutlass_include(), ROOT / "csrc" / "include"]
    ptxas = ensure_ptxas(cache, offline)
    ptxas_text = tool_version(ptxas)
    pv = parse_tool_version(ptxas_text)
    if not pv or pv[0] != 12:
        raise ToolUnavailable(f"{ptxas} is not a CUDA 12.x ptxas: {ptxas_text!r}")
    nvdisasm, why = find_nvdisasm(cache, offline)
    nvdisasm_text = tool_version(nvdisasm) if nvdisasm else "none"
    fp = "\n".join([tool_version(nvcc_path), ptxas_text, nvdisasm_text, cutlass_version(),
                    str(includes[0]), " ".join(NVCC_FLAGS), " ".join(PTXAS_FLAGS)])
    return Toolchain(nvcc_path, ptxas, nvdisasm, why, includes, ptx_isa_for(pv), fp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--filter", default="",
                    help="comma-separated shell patterns of kernel names (default: every *_sm70_*)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                    help="kernels compiled at once (default: the number of cores)")
    ap.add_argument("--json", metavar="FILE", help="also write the full report as JSON")
    ap.add_argument("--keep", metavar="DIR",
                    help="keep PTX, cubin, SASS and ptxas logs per kernel (compiles afresh)")
    ap.add_argument("--rev", help="check the kernel sources (csrc/ and the declared space) as of "
                    "this git revision (default: the working tree)")
    ap.add_argument("--nvcc", help="nvcc producing the compute_75 PTX (default: PATH)")
    ap.add_argument("--cache-dir", help="default: $SPARKTUNE_CACHE or ~/.cache/sparktune")
    ap.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    ap.add_argument("--offline", action="store_true", help="never download; use cached tools only")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    args = ap.parse_args(argv)

    def progress(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    cache = cache_root(args.cache_dir)
    try:
        tc = setup_toolchain(args.nvcc, cache, args.offline)
    except ToolUnavailable as e:
        print(f"check_sm70: cannot run: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="sparktune-sm70-gen-") as gen:
        tree = Path(gen) / "src"
        try:
            source_rev = snapshot_sources(tree, args.rev)
        except ToolUnavailable as e:
            print(f"check_sm70: cannot run: {e}", file=sys.stderr)
            return 2
        snapshot = tree / "csrc" / "include"
        tc.includes[-1] = snapshot
        sources, table = generate(tree, tc.nvcc, tc.includes, args.filter, Path(gen) / "kernels")
        headers = header_digest(snapshot)
        excluded = sorted(n for n, (valid, *_rest) in table.items()
                          if not valid and fnmatch.fnmatchcase(n, SM70_NAME))
        estimates = rule_estimates(tree, tc.nvcc, tc.includes,
                                   [n for n in table if fnmatch.fnmatchcase(n, SM70_NAME)],
                                   Path(gen) / "reg_probe")
        progress(f"check_sm70: kernel sources of {source_rev}: {len(sources)} Volta kernels to check, {len(excluded)} excluded by "
                 f"the rules; ptxas {tc.ptxas} (PTX ISA {tc.isa}); nvdisasm "
                 f"{tc.nvdisasm or 'n/a: ' + tc.nvdisasm_why}")
        keep = Path(args.keep).resolve() if args.keep else None
        results = run_check(sources, table, tc, args.jobs, None if args.no_cache else cache,
                            keep, progress, estimates)

    if tc.nvdisasm is None:
        print(f"note: HMMA.884 counts are n/a: no CUDA 12.x nvdisasm ({tc.nvdisasm_why})")
    width = max([len(r.name) for r in results] + [20])
    for r in results:
        print(format_line(r, width))
    for r in results:
        if not r.ok_build:
            print(f"--- {r.name}: build error\n{r.error.strip()[-4000:]}")
    if excluded:
        reasons: dict[str, int] = {}
        for n in excluded:
            reasons[table[n][3]] = reasons.get(table[n][3], 0) + 1
        for why, count in sorted(reasons.items()):
            print(f"excluded by the rules: {count} ({why})")
    n_pass = sum(r.passed for r in results)
    n_fail = len(results) - n_pass
    if args.json:
        report = {
            "check_version": CHECK_VERSION,
            "toolchain": {"nvcc": release_line(tc.nvcc), "ptxas": release_line(tc.ptxas),
                          "nvdisasm": release_line(tc.nvdisasm) if tc.nvdisasm else None,
                          "nvdisasm_missing": tc.nvdisasm_why or None,
                          "ptx_isa": tc.isa, "cutlass": cutlass_version()},
            "source": {"git_head": source_rev, "kernel_headers_sha256": headers},
            "kernels": [asdict(r) | {"params": parse_kernel_name(r.name)} for r in results],
            "excluded": [{"name": n, "reason": table[n][3],
                          "reg_estimate": estimates.get(n, (None, None))[0],
                          "reg_limit": estimates.get(n, (None, None))[1]} for n in excluded],
            "passed": n_pass, "failed": n_fail,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{n_pass} passed, {n_fail} failed")
    return 0 if n_fail == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

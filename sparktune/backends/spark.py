"""The ``spark`` backend: sparktune's compiled CUDA/CuTe kernel family (``sparktune._C``).

Every compiled kernel is one configuration; its name (``fwd_sm80_f16_d128_m128n64_w4x1_acc32_preg``)
is the config name everywhere. The kernel facts (family, tile, threads, shared memory) come from
the compiled module, whose traits derived them, so nothing here repeats which tiles fit.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..kernels.kernel_space import (
    BWD_DEFAULTS,
    FWD_DEFAULTS,
    SM90_DEFAULTS,
    SM90_DETERMINISTIC_ONLY,
    is_persistent_sm90_fwd,
    is_unverified,
)
from ..kernels.sm90_bwd_split import group_split
from .base import Backend

if TYPE_CHECKING:
    import torch

    from ..problem import DeviceInfo, Problem

__all__ = ["SparkBackend", "load_extension"]

_DTYPE_TAGS = {"float16": "f16", "bfloat16": "bf16"}


def _dynamic_from_env(environ: Any) -> bool:
    """``SPARKTUNE_SM90_DYNAMIC`` of ``environ``: on when it is ``1``."""
    return environ.get("SPARKTUNE_SM90_DYNAMIC", "0").strip() == "1"


#: ``SPARKTUNE_SM90_DYNAMIC`` (read once, at import): how the persistent Hopper forward kernels
#: (``fwd_sm90_*_ps1*``) hand out their tiles. ``1``: dynamically, each block taking the next
#: tile of the heaviest-first order from a counter (a zeroed int32 tensor allocated per call)
#: when it is free; unset or anything else: in the static alternating rounds (no counter).
#: Both give bit-identical results; packed-sequence calls always take the static rounds. Off by
#: default: on an H200 (BENCHMARKS.md, "Dynamic tile schedule") it gained 1-7% for one
#: non-causal kernel that is not the fastest at any shape and lost up to 7% for causal launches
#: below 8k tokens (the counter's fill kernel and atomics against rounds already balanced).
SM90_DYNAMIC = _dynamic_from_env(os.environ)


def _counts_tiles(config: str) -> bool:
    """Whether a launch of ``config`` (not packed) gets a tile counter: a persistent sm90
    forward kernel while the dynamic schedule is on (:data:`SM90_DYNAMIC`). The counter is a
    torch.zeros per call, kept alive until the launch: under CUDA graphs a memset node, under
    torch.compile part of the op."""
    return SM90_DYNAMIC and is_persistent_sm90_fwd(config)


@functools.lru_cache(maxsize=1)
def load_extension() -> tuple[Any, str | None]:
    """(module, None) when ``sparktune._C`` imports, else (None, reason)."""
    try:
        from .. import _C  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"the compiled extension sparktune._C is not installed ({exc})"
    return _C, None


@functools.cache
def _sm_count(device_index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@functools.cache
def _smem_optin(device_index: int) -> int:
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


def _rows_misaligned(stride: Sequence[int]) -> bool:
    """The kernels read 16-byte rows: a batch, head or row stride that is not a multiple of 8
    elements (fp16 and bf16) breaks that."""
    return bool(stride[0] % 8 or stride[1] % 8 or stride[2] % 8)


def _tma_refuses(config: str, strides: Sequence[Sequence[int]]) -> bool:
    """The sm90 kernels read through TMA descriptors, whose batch, head and row strides must be
    positive (a broadcast view with a zero stride is refused); the 16-byte rule is
    :func:`_rows_misaligned`'s."""
    return config.startswith(("fwd_sm90_", "bwd_sm90_")) and any(
        x <= 0 for st in strides for x in st[:3]
    )


def _feature_args(
    window: Any, softcap: Any, alibi_slopes: Any, batch: int, heads_q: int, seqlen_q: int,
    seqlen_k: int, device: Any,
) -> dict[str, Any]:
    """The family 90 forward's keyword arguments for ``window``, ``softcap`` and
    ``alibi_slopes`` (checked; raises and says what is wrong). A window side that reaches past
    every key (``left >= seqlen_k``, ``right >= seqlen_q``, the longest sequences when packed)
    is passed as unlimited, so that any int fits the kernel's int32."""
    import torch

    kw: dict[str, Any] = {}
    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
            raise TypeError(f"window must be a pair of ints (left, right), got {window!r}")
        left, right = int(window[0]), int(window[1])
        if left < -1 or right < -1:
            raise ValueError(f"window sides must be >= 0, or -1 for unlimited, got {(left, right)}")
        kw["window_left"] = -1 if left >= seqlen_k else left
        kw["window_right"] = -1 if right >= seqlen_q else right
    if softcap:
        cap = float(softcap)
        if not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"softcap must be finite and >= 0 (0 for off), got {softcap!r}")
        kw["softcap"] = cap
    if alibi_slopes is not None:
        a = alibi_slopes
        if not isinstance(a, torch.Tensor) or a.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be a float32 tensor, got "
                            f"{getattr(a, 'dtype', type(a).__name__)}")
        if tuple(a.shape) not in ((heads_q,), (batch, heads_q)):
            raise ValueError(f"alibi_slopes must have shape ({heads_q},) or ({batch}, {heads_q}), "
                             f"got {tuple(a.shape)}")
        if a.device != device:
            raise ValueError(f"alibi_slopes is on {a.device}, the inputs on {device}")
        if a.stride(-1) != 1:  # (the copy outlives the launch: the caller holds what we return)
            a = a.contiguous()
        kw["alibi_slopes"] = a
        kw["alibi_batch_stride"] = a.stride(0) if a.dim() == 2 else 0
    return kw


def _device_index_for(device: DeviceInfo) -> int | None:
    idx = device.extra.get("index") if device.extra else None
    return int(idx) if idx is not None else None


#: the features only the family 90 kernels run, forward and backward (the other families'
#: kernels refuse them, with the reason; packed sequences too)
_HOPPER_FWD_FEATURES = ("window", "softcap", "alibi")
#: what the features are called in the reasons
_FEATURE_TEXT = {
    "window": "sliding windows",
    "softcap": "soft-capping",
    "alibi": "ALiBi",
    "varlen": "packed sequences (varlen)",
}


class SparkBackend(Backend):
    name = "spark"
    #: docs/FEATURES.md: "deterministic" (a backward problem's: the backward of family 90
    #: adds dQ in a fixed order when asked; the other families' backward kernels are refused),
    #: "varlen" (packed sequences: the family 90 forward and backward only) and "window",
    #: "softcap" and "alibi" (sliding windows, soft-capping and ALiBi: the family 90 forward
    #: and backward only, in any combination, packed or not, deterministic or not). Configurations listed in
    #: kernel_space.UNVERIFIED run only when forced by name.
    features = frozenset({"deterministic", "varlen", "window", "softcap", "alibi"})

    # The heuristic defaults (kernel_space.py says what each was measured on): per (family,
    # head_dim) the (block_m, block_n, warps_m, warps_n) of the forward and of the backward, and
    # Hopper's name tails per (op, head_dim). A default build compiles exactly these and the
    # shipped winners; the tuner replaces them per shape.
    _DEFAULTS = FWD_DEFAULTS
    _BWD_DEFAULTS = BWD_DEFAULTS
    _DEFAULTS90 = SM90_DEFAULTS

    def __init__(self) -> None:
        self._kernels: dict[str, dict[str, Any]] | None = None

    # ---- catalogue ----
    def _catalogue(self) -> dict[str, dict[str, Any]]:
        if self._kernels is None:
            mod, _ = load_extension()
            self._kernels = {k["name"]: k for k in mod.kernels()} if mod is not None else {}
        return self._kernels

    def build_info(self) -> dict[str, Any] | None:
        mod, _ = load_extension()
        return mod.build_info() if mod is not None else None

    def kernel_info(self, config: str) -> dict[str, Any]:
        return self._catalogue()[config]

    def unavailable_reasons(self) -> list[str]:
        mod, err = load_extension()
        if mod is None:
            return [err or "sparktune._C missing"]
        if not self._catalogue():
            return ["the extension was built with no kernels (SPARKTUNE_KERNELS filter matched none)"]
        import torch

        if not torch.cuda.is_available():
            return ["no CUDA GPU visible to torch"]
        return []

    def configs(self, op: str = "fwd") -> Sequence[str]:
        return [n for n, k in self._catalogue().items() if k["op"] == op]

    # ---- capabilities ----
    def _config_reasons(self, problem: Problem, k: dict[str, Any], device: DeviceInfo | None) -> list[str]:
        reasons = []
        if k["dtype"] != problem.dtype:
            reasons.append(f"built for {k['dtype']}, not {problem.dtype}")
        if k["head_dim"] != problem.head_dim:
            reasons.append(f"built for head_dim {k['head_dim']}, not {problem.head_dim}")
        if k["accum"] == 16 and not problem.allow_fp16_accum:
            reasons.append("accumulates in fp16, which the caller did not allow (allow_fp16_accum=False)")
        if getattr(problem, "deterministic", False) and problem.op == "bwd" and k["family"] != 90:
            reasons.append(
                "adds dQ with float atomics in no fixed order: gradients not bitwise reproducible "
                "(deterministic=True needs a family 90 backward, bwd_sm90_*)"
            )
        if getattr(problem, "varlen", False) and (
            problem.op not in ("fwd", "bwd") or k["family"] != 90
        ):
            reasons.append(
                "packed sequences (varlen) run on the family 90 forward and backward only "
                f"(fwd_sm90_*, bwd_sm90_*, sm_90); this is a family {k['family']} {k['op']} kernel"
            )
        if problem.op not in ("fwd", "bwd") or k["family"] != 90:
            wanted = [f for f in _HOPPER_FWD_FEATURES if f in problem.features]
            if wanted:
                what = " and ".join(_FEATURE_TEXT[f] for f in wanted)
                reasons.append(
                    f"{what} run on the family 90 forward and backward only (fwd_sm90_*, "
                    f"bwd_sm90_*, sm_90); this is a family {k['family']} {k['op']} kernel"
                )
        if device is not None:
            archs = k.get("archs") or (self.build_info() or {}).get("archs", [])
            if k["family"] == 90 and device.arch != 90:
                reasons.append(
                    f"sm_90a code (wgmma, TMA, setmaxnreg) runs on sm_90 (Hopper) only, the GPU "
                    f"is sm_{device.arch}"
                )
            elif device.arch < k["min_arch"]:
                reasons.append(f"needs sm_{k['min_arch']} or later, the GPU is sm_{device.arch}")
            elif device.arch not in archs:
                reasons.append(
                    f"not compiled for sm_{device.arch} (built for {', '.join(f'sm_{a}' for a in archs)};"
                    f" rebuild with SPARKTUNE_CUDA_ARCHS={device.arch})"
                )
            idx = _device_index_for(device)
            if idx is not None:
                limit = _smem_optin(idx)
                if limit and k["smem_bytes"] > limit:
                    reasons.append(f"needs {k['smem_bytes']} bytes of shared memory, the GPU allows {limit}")
        return reasons

    def not_supported_reasons(
        self, problem: Problem, config: str | None = None, device: DeviceInfo | None = None
    ) -> list[str]:
        head = self.unavailable_reasons()
        if head:
            return head
        if device is None:
            return ["needs CUDA tensors (the inputs are on the CPU)"]
        cat = self._catalogue()
        if config is not None:
            if config not in cat:
                return [f"unknown spark kernel {config!r} (not compiled; `sparktune info` lists them)"]
            if cat[config]["op"] != problem.op:
                return [f"{config} is a {cat[config]['op']} kernel, the problem is {problem.op}"]
            return self._config_reasons(problem, cat[config], device)
        fwd = [k for k in cat.values() if k["op"] == problem.op]
        if not fwd:
            return [f"no {problem.op} kernel compiled (SPARKTUNE_KERNELS filter)"]
        if not any(k["dtype"] == problem.dtype for k in fwd):
            return [f"no compiled kernel for {problem.dtype}"]
        dims = sorted({k["head_dim"] for k in fwd if k["dtype"] == problem.dtype})
        if problem.head_dim not in dims:
            return [f"no compiled kernel for head_dim {problem.head_dim} (compiled: {dims})"]
        per = [self._config_reasons(problem, k, device) for k in fwd]
        if all(per):
            uniq = sorted({r for rs in per for r in rs})
            return ["no compiled kernel fits: " + "; ".join(uniq)]
        return []

    def _emulated(self, k: dict[str, Any], device: DeviceInfo | None) -> bool:
        """Volta's m8n8k4 family runs on sm_80+ only emulated (tens of times slower): it is run
        there when forced by name (tests), never offered to the tuner or picked by default."""
        return device is not None and k["family"] == 70 and device.arch >= 80

    def candidates(self, problem: Problem, device: DeviceInfo | None = None):
        cands = super().candidates(problem, device)
        cat = self._catalogue()
        return [c for c in cands if not self._emulated(cat[c.config], device) and not is_unverified(c.config)]

    def default_config(self, problem: Problem, device: DeviceInfo | None = None) -> str | None:
        cands = self.candidates(problem, device)
        if not cands:
            return None
        cat = self._catalogue()
        if device is not None and device.arch == 90:
            tail = self._DEFAULTS90.get((problem.op, problem.head_dim))
            if (problem.op, problem.head_dim) in SM90_DETERMINISTIC_ONLY and not problem.deterministic:
                tail = None  # the family 80 default is faster there
            hopper = [c.config for c in cands if cat[c.config]["family"] == 90]
            if tail is not None:
                exact = [n for n in hopper if n.endswith("_" + tail)]
                if exact:
                    return min(exact)
        family = 70 if device is not None and device.arch < 80 else 80
        defaults = self._BWD_DEFAULTS if problem.op == "bwd" else self._DEFAULTS
        want = defaults.get((family, problem.head_dim))

        def score(name: str) -> tuple:
            k = cat[name]
            exact = want is not None and (k["block_m"], k["block_n"], k["warps_m"], k["warps_n"]) == want
            return (
                not exact,
                k["family"] != family,
                k["accum"] != 32,  # fp32 accumulation unless only fp16 is compiled
                k["softmax"] != "reg",
                k["warps_n"] != 1,
                -k["block_m"],
                -k["block_n"],
                name,
            )

        return min((c.config for c in cands), key=score)

    # ---- running ----
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
        need_lse: bool = True,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        window: tuple[int, int] | None = None,
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        **features: object,
    ) -> torch.Tensor | None:
        """The forward into ``out``; returns the log-sum-exp. Packed sequences (``cu_seqlens_*``
        given): q, k, v, out are (total, heads, head_dim), the log-sum-exp (heads_q, total_q).
        ``window=(left, right)`` (-1: unlimited; ``causal`` sets right = 0), ``softcap`` > 0
        and ``alibi_slopes`` (float32 (Hq,) or (B, Hq), B the number of sequences when packed)
        as docs/FEATURES.md defines them, in any combination with each other and with packed
        sequences. Those four run on the family 90 forward only (``fwd_sm90_*``); dropout is
        not run here (dispatch never sends it). A persistent sm90 kernel (``_ps1``, not packed)
        also gets a zeroed tile counter while :data:`SM90_DYNAMIC` is on."""
        import torch

        mod, err = load_extension()
        if mod is None:
            raise RuntimeError(err)
        if features:
            raise ValueError(
                f"the spark backend runs sliding windows, softcap, ALiBi and packed sequences "
                f"(the family 90 forward), not {sorted(features)} (docs/FEATURES.md)"
            )
        packed = cu_seqlens_q is not None or cu_seqlens_k is not None
        featured = window is not None or bool(softcap) or alibi_slopes is not None
        if (packed or featured) and not config.startswith("fwd_sm90_"):
            what = ", ".join(
                name for name, on in (("packed sequences", packed), ("window", window is not None),
                                      ("softcap", bool(softcap)), ("alibi_slopes", alibi_slopes is not None))
                if on
            )
            raise ValueError(
                f"{config}: {what}: the spark backend runs these on the family 90 forward only "
                "(fwd_sm90_*)"
            )
        if packed:
            from .._checks import check_packed_boundaries

            b, nq, nk = check_packed_boundaries(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k)
            total_q, hq, d = q.shape
            total_k, hk = k.shape[0], k.shape[1]
            # (batch, head, row) strides; the batch stride is a stand-in the kernel never steps
            views = [(t.shape[0] * t.stride(0), t.stride(1), t.stride(0)) for t in (q, k, v, out)]
        else:
            b, hq, nq, d = q.shape
            hk, nk = k.shape[1], k.shape[2]
            views = [t.stride()[:3] for t in (q, k, v, out)]
        ptrs, strides = [], []
        for name, t, st in zip(("q", "k", "v", "out"), (q, k, v, out), views, strict=True):
            ptr = t.data_ptr()
            if t.stride(-1) != 1:
                raise ValueError(f"spark kernels need {name}'s last dimension contiguous (strides {tuple(t.stride())})")
            if ptr % 16 or _rows_misaligned(st):
                raise ValueError(
                    f"spark kernels need 16-byte aligned rows: {name}'s data pointer and its batch, "
                    f"head and row strides must be multiples of 8 elements (strides {tuple(st)})"
                )
            ptrs.append(ptr)
            strides.append(tuple(st))
        if _tma_refuses(config, strides):
            raise ValueError(
                f"{config} reads through TMA descriptors, which need positive batch, head and row "
                f"strides (got {[tuple(st) for st in strides]} for q, k, v, out); make the "
                "inputs contiguous or use another kernel"
            )
        device = q.device
        # the kernel always writes the log-sum-exp, so it needs the buffer even without need_lse
        lse = torch.empty((hq, total_q) if packed else (b, hq, nq), device=device, dtype=torch.float32)
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        stream = (
            raw_stream(device.index)
            if raw_stream is not None
            else torch.cuda.current_stream(device).cuda_stream
        )
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"scale must be a finite positive number, got {scale!r}")
        args = (
            config, *ptrs, lse.data_ptr(), b, hq, hk, nq, nk, d, *strides,
            float(scale), bool(causal), stream,
        )
        extra = {}
        slopes = None
        if featured:
            extra.update(_feature_args(window, softcap, alibi_slopes, b, hq, nq, nk, device))
            slopes = extra.pop("alibi_slopes", None)  # held until the launch is queued
            if slopes is not None:
                extra["alibi_slopes"] = slopes.data_ptr()
        if packed:
            args = (*args, cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), total_q, total_k)
        elif _counts_tiles(config):  # (packed launches keep the static rounds: no counter)
            counter = torch.zeros(1, dtype=torch.int32, device=device)
            extra["tile_counter"] = counter.data_ptr()
        if device.index == torch.cuda.current_device():
            mod.fwd(*args, **extra)
        else:  # launch on the tensors' device (its stream, its attributes)
            with torch.cuda.device(device):
                mod.fwd(*args, **extra)
        return lse

    def forward_runner(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
        need_lse: bool = True,
    ) -> Any:
        """``run(q, k, v) -> (out, lse)`` for inputs with these shapes, strides, dtype and
        device: :meth:`forward` with its argument list, stride checks and output strides
        (``out``'s) worked out once; per call it checks the data pointers, allocates the
        output and the log-sum-exp (and :meth:`forward`'s tile counter where it has one), and
        launches."""
        import torch

        mod, _ = load_extension()
        if mod is None or not (scale > 0 and math.isfinite(scale)):
            return None
        b, hq, nq, d = q.shape
        hk, nk = k.shape[1], k.shape[2]
        strides = [t.stride() for t in (q, k, v, out)]
        if any(_rows_misaligned(st) for st in strides) or _tma_refuses(config, strides):
            return None  # forward says why
        shape, out_stride = tuple(q.shape), tuple(out.stride())
        dtype, device = q.dtype, q.device
        index = device.index
        fixed = (b, hq, hk, nq, nk, d, *(st[:3] for st in strides), float(scale), bool(causal))
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw_stream is None:
            return None
        fwd, empty_strided, empty, current = (
            mod.fwd, torch.empty_strided, torch.empty, torch.cuda.current_device,
        )  # fmt: skip
        f32 = torch.float32
        forward = functools.partial(
            self.forward, config=config, causal=causal, scale=scale, need_lse=need_lse
        )

        counted = _counts_tiles(config)  # a persistent sm90 kernel under the dynamic schedule
        zeros, i32 = torch.zeros, torch.int32

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
            o = empty_strided(shape, out_stride, dtype=dtype, device=device)
            if (qp | kp | vp) & 15 or index != current():
                return o, forward(q, k, v, o)  # says what is misaligned; or another device
            lse = empty((b, hq, nq), dtype=f32, device=device)
            if counted:  # a fresh zeroed tile counter, held until the launch is queued
                counter = zeros(1, dtype=i32, device=device)
                fwd(config, qp, kp, vp, o.data_ptr(), lse.data_ptr(), *fixed, raw_stream(index),
                    tile_counter=counter.data_ptr())
            else:
                fwd(config, qp, kp, vp, o.data_ptr(), lse.data_ptr(), *fixed, raw_stream(index))
            return o, lse if need_lse else None

        return run

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
        deterministic: bool = False,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        window: tuple[int, int] | None = None,
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        **features: object,
    ) -> None:
        """Write the gradients of attention(q, k, v) for ``dout`` into dq, dk, dv (any strides
        with a contiguous last dimension; GQA: dk and dv have k's heads). ``out`` and ``lse`` are
        the forward's. Two fp32 workspaces are allocated per call: the dQ sum (q's size) and
        D = rowsum(dout * out). ``deterministic`` (family 90 only): a third, int32 counters per
        query row block, makes the key blocks add their dQ parts in a fixed order. A family 90
        GQA launch with a group split (:func:`sparktune.kernels.sm90_bwd_split.group_split`)
        also takes the fp32 parts of dK and dV.

        Packed sequences (``cu_seqlens_*`` given, family 90 kernels only, ``bwd_sm90_*``): q,
        out, dout, dq are (total_q, Hq, D), k, v, dk, dv (total_k, Hkv, D), ``lse``
        (Hq, total_q) as the packed forward returns it. The boundaries are checked as
        :meth:`forward` checks them, and their values as ``varlen_attention`` checks them
        (:func:`~sparktune._checks.check_cu_seqlens`: read from the device once per tensor, so
        a training step's backward finds them read by its forward): a max length below a
        sequence's would leave gradient rows unwritten, and the deterministic counters
        overrun. Where there is no query or no key at all (a total or a max length 0) the
        gradients are zeros and nothing is launched. ``window``, ``softcap`` and
        ``alibi_slopes`` as :meth:`forward` takes them (family 90 only, ``bwd_sm90_*``; the
        forward's output and log-sum-exp must come from the same features). No other feature
        is run here (dispatch never sends one: dropout). Every argument is checked before the
        compiled module is reached: what is wrong raises ``ValueError`` (CPU tensors among
        them)."""
        import torch

        if features:
            raise ValueError(
                f"the spark backward runs packed sequences, deterministic mode, sliding windows, "
                f"softcap and ALiBi, not {sorted(features)} (docs/FEATURES.md)"
            )
        featured = window is not None or bool(softcap) or alibi_slopes is not None
        if featured and not config.startswith("bwd_sm90_"):
            raise ValueError(
                f"{config}: sliding windows, softcap and ALiBi run on the family 90 backward "
                "only (bwd_sm90_*)"
            )
        tensors = (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("dq", dq),
                   ("dk", dk), ("dv", dv))
        packed = cu_seqlens_q is not None or cu_seqlens_k is not None
        if packed:
            from .._checks import check_cu_seqlens, check_packed_boundaries

            b, nq, nk = check_packed_boundaries(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k)
            if not config.startswith("bwd_sm90_"):
                raise ValueError(
                    f"{config}: packed sequences run on the family 90 kernels only (bwd_sm90_* "
                    "for the backward)"
                )
            for name, t in tensors:
                if t.dim() != 3:
                    raise ValueError(
                        f"packed sequences need (total, heads, head_dim) tensors: {name} has "
                        f"shape {tuple(t.shape)}"
                    )
            total_q, hq, d = q.shape
            total_k, hk = k.shape[0], k.shape[1]
            if k.shape[2] != d or tuple(v.shape) != tuple(k.shape):
                raise ValueError(
                    f"k and v must be (total_k, heads_kv, {d}) alike, got k {tuple(k.shape)} and "
                    f"v {tuple(v.shape)}"
                )
            check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, nq, nk, total_q, total_k, q.device)
            lse_shape: tuple[int, ...] = (hq, total_q)
        else:
            b, hq, nq, d = q.shape
            hk, nk = k.shape[1], k.shape[2]
            lse_shape = (b, hq, nq)
        for name, t in tensors:
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}")
        for name, t, shape in (("out", out, q.shape), ("dout", dout, q.shape), ("dq", dq, q.shape),
                               ("dk", dk, k.shape), ("dv", dv, v.shape)):
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if tuple(lse.shape) != lse_shape or lse.dtype != torch.float32:
            raise ValueError(f"lse must be float32 of shape {lse_shape}, got {lse.dtype} "
                             f"{tuple(lse.shape)}")
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"scale must be a finite positive number, got {scale!r}")
        if deterministic and not config.startswith("bwd_sm90_"):
            raise ValueError(
                f"{config} adds dQ with float atomics in no fixed order: deterministic=True "
                "needs a family 90 backward (bwd_sm90_*)"
            )
        # the features' arguments, checked (as the forward checks them)
        feat = _feature_args(window, softcap, alibi_slopes, b, hq, nq, nk, q.device) if featured else {}
        if packed and (total_q == 0 or total_k == 0 or nq == 0 or nk == 0):
            # no query or no key at all: every gradient is 0, nothing to launch
            for g in (dq, dk, dv):
                g.zero_()
            return
        # (batch, head, row) strides; packed: the batch stride is a stand-in the kernel never steps
        if packed:
            strides = [(t.shape[0] * t.stride(0), t.stride(1), t.stride(0)) for _, t in tensors]
        else:
            strides = [tuple(t.stride()[:3]) for _, t in tensors]
        for (name, t), st in zip(tensors, strides, strict=True):
            if t.data_ptr() % 16 or _rows_misaligned(st) or t.stride(-1) != 1:
                raise ValueError(
                    f"spark kernels need 16-byte aligned rows: {name}'s data pointer and its batch, "
                    f"head and row strides must be multiples of 8 elements and its last dimension "
                    f"contiguous (strides {tuple(t.stride())})"
                )
        if _tma_refuses(config, strides[:5]):
            raise ValueError(
                f"{config} reads q, k, v and dout through TMA descriptors, which need positive "
                "batch, head and row strides; make the inputs contiguous or use another kernel"
            )
        if q.device.type != "cuda":
            raise ValueError(f"spark kernels need CUDA tensors, the inputs are on {q.device}")
        mod, err = load_extension()
        if mod is None:
            raise RuntimeError(err)
        info = self._catalogue().get(config)
        if info is None:
            raise ValueError(f"unknown spark kernel {config!r} (not compiled; `sparktune info` lists them)")
        if deterministic and info["family"] != 90:
            raise ValueError(
                f"{config} adds dQ with float atomics in no fixed order: deterministic=True "
                "needs a family 90 backward (bwd_sm90_*)"
            )
        semaphore = None
        if deterministic:
            # one counter per (batch, query head, row block); packed: per sequence, with the
            # longest sequence's row blocks
            m_blocks = -(-nq // int(info["block_m"]))
            semaphore = torch.zeros((b, hq, m_blocks), device=q.device, dtype=torch.int32)
        lse = lse.contiguous()
        if packed:
            dq_accum = torch.empty((total_q, hq, d), device=q.device, dtype=torch.float32)
            dsum = torch.empty((hq, total_q), device=q.device, dtype=torch.float32)
            extra = dict(cu_seqlens_q=cu_seqlens_q.data_ptr(), cu_seqlens_k=cu_seqlens_k.data_ptr(),
                         total_q=total_q, total_k=total_k)
        else:
            dq_accum = torch.empty((b, hq, nq, d), device=q.device, dtype=torch.float32)
            dsum = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
            extra = {}
        # the group split (sparktune.kernels.sm90_bwd_split): few (kv head, batch) pairs of a
        # GQA problem walked by several blocks per group, their dK and dV parts summed after
        dkv_part = None
        if info["family"] == 90 and hq > hk and not packed:
            win = feat.get("window_left", -1), feat.get("window_right", -1)
            split = group_split(
                b, hk, hq // hk, nq, nk, int(info["block_m"]), int(info["block_n"]), d,
                q.element_size(), bool(causal), win if win != (-1, -1) else None,
                _sm_count(q.device.index if q.device.index is not None else
                          torch.cuda.current_device()),
            )
            if split > 1:
                dkv_part = torch.empty((2, b, hk * split, nk, d), device=q.device,
                                       dtype=torch.float32)
                extra.update(group_split=split, dkv_part=dkv_part.data_ptr())
        slopes = None
        if featured:
            slopes = feat.pop("alibi_slopes", None)  # held until the launch is queued
            if slopes is not None:
                feat["alibi_slopes"] = slopes.data_ptr()
            extra.update(feat)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        with torch.cuda.device(q.device):
            mod.bwd(
                config, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                dq_accum.data_ptr(), dsum.data_ptr(),
                b, hq, hk, nq, nk, d,
                *strides,
                float(scale), bool(causal), stream,
                semaphore.data_ptr() if semaphore is not None else 0,
                **extra,
            )

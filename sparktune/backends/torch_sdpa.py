"""PyTorch's scaled_dot_product_attention backends as sparktune candidates.

Configs are the SDPA backends: "flash", "cudnn", "efficient", "math", each forced with
``torch.nn.attention.sdpa_kernel``, and "auto": the call a user makes,
``F.scaled_dot_product_attention`` with SDPA's own choice of backend (and ``enable_gqa`` for
grouped K/V, read as they are), so that what the user would call instead is always a
candidate. The support rules below are deliberately conservative and named; a rule that is
too strict costs a candidate, one that is too loose costs a crash.

Semantics that differ from sparktune's and how they are bridged:

- torch's ``is_causal`` is aligned top-left. It is used only when seqlen_q == seqlen_k (where
  both alignments agree). Other causal problems run on "math" and "efficient" with an explicit
  bottom-right boolean mask; "flash" and "cudnn" do not support them.
- Rows with no visible key (causal, seqlen_q > seqlen_k) get output 0 and lse -inf here, as
  the contract says; torch is given a harmless mask row for them and the row is zeroed after.
- GQA: ``enable_gqa=True`` on "auto", "flash" and "math" with torch >= 2.5; otherwise k and v
  are expanded with ``repeat_interleave`` (a copy of k and v, inside the timed call).
- The fused kernels read 16-byte vectors: an input whose pointer or strides are not 16-byte
  aligned (e.g. a slice starting mid-row) is copied first for "flash", "cudnn", "efficient"
  and "auto" (SDPA's own choice was seen on an H200 to give wrong output, and then a
  misaligned-address fault, for a view starting one element into its storage).
- The log-sum-exp comes from torch's private SDPA ops that return it ("flash", "cudnn",
  "efficient", when no mask is needed; "auto" keeps the output of SDPA's own choice and takes
  the log-sum-exp from the first of flash and efficient that can run the call, since SDPA's
  public call returns none: a second pass, only when a log-sum-exp is asked for); otherwise it
  is
  computed separately in float32 by :func:`~sparktune.backends.reference.reference_lse`
  (an extra pass over Q·K^T). With ``need_lse=False`` none of this is done.
- Backward: "cudnn" and "flash" (and "auto" where SDPA's own choice is one of them) call the
  kernel's private backward op with the forward's output and log-sum-exp as given, whichever
  backend computed them (:meth:`TorchSDPABackend.backward_runner`; not for causal with
  seqlen_q != seqlen_k); everything else recomputes the forward
  with the same SDPA backend under autograd.

Attention features (docs/FEATURES.md): "auto" and "math" take windows and ALiBi as a
materialised additive float mask ((Nq, Nk), or (B, Hq, Nq, Nk) with ALiBi; rows that see no
key are opened and zeroed after, as above; the log-sum-exp then comes from the float32
reference pass); soft-capping cannot be expressed as a mask. The config "flex" is
FlexAttention (``torch.nn.attention.flex_attention``, compiled on CUDA, eager elsewhere),
a candidate for problems with features only: soft-capping and ALiBi as its ``score_mod``,
windows, causal masks and packed sequences (document ids) as its block mask. No config takes
dropout (SDPA's own generator is not the contract's) or promises a deterministic backward.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..dtypes import DTYPE_NAMES
from ..problem import DTYPES, DeviceInfo, Problem
from .base import Backend
from .reference import causal_visible, reference_lse, window_visible

__all__ = ["AUTO", "CONFIGS", "CONFIG_FEATURES", "FLEX", "TorchSDPABackend"]

log = logging.getLogger(__name__)

#: config name -> torch.nn.attention.SDPBackend member ("auto": SDPA chooses, none forced)
CONFIGS: dict[str, str | None] = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
    "auto": None,
}
#: the config that is SDPA's own choice
AUTO = "auto"
#: FlexAttention, for problems with features
FLEX = "flex"
#: the features each config takes
CONFIG_FEATURES: dict[str, frozenset[str]] = {
    "flash": frozenset(),
    "cudnn": frozenset(),
    "efficient": frozenset(),
    "math": frozenset(("window", "alibi")),
    "auto": frozenset(("window", "alibi")),
    FLEX: frozenset(("window", "softcap", "alibi", "varlen")),
}
#: FlexAttention's smallest head_dim on CUDA (its kernels need a power of two from here)
FLEX_MIN_HEAD_DIM = 16
#: the private ops "auto" takes its log-sum-exp from, in order, when one is asked for
_AUTO_LSE_CONFIGS = ("flash", "efficient")
#: config name -> private aten op returning (output, logsumexp, ...)
_LSE_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
}

# Support rules (compute capability as one number, e.g. 80 for sm_80).
FLASH_MIN_ARCH = 80
CUDNN_MIN_ARCH = 80
#: torch's own floor is sm_50; sparktune targets Volta and later
EFFICIENT_MIN_ARCH = 70
#: flash, cudnn and efficient read head_dim in 16-byte vectors
HEAD_DIM_MULTIPLE = 8
FLASH_MAX_HEAD_DIM = 256
#: flash backward above this head_dim exists only for sm_80 and sm_90 (not sm_86/sm_89)
FLASH_BWD_LARGE_HEAD_DIM = 192
FLASH_BWD_LARGE_HEAD_DIM_ARCHS = (80, 90)
CUDNN_MAX_HEAD_DIM = 128
EFFICIENT_MAX_HEAD_DIM = 256
#: cuDNN's SDPA graph in torch needs cuDNN 9
CUDNN_MIN_VERSION = 90000
#: torch version with scaled_dot_product_attention(enable_gqa=...)
GQA_MIN_TORCH = (2, 5)
#: configs that take enable_gqa=True (others get repeated k/v)
GQA_NATIVE_CONFIGS = ("flash", "math", "auto")
#: byte alignment the private ops' vector loads need for pointers and strides
_ALIGN_BYTES = 16


@functools.cache
def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.cache
def _sdp_backend(config: str) -> Any:
    from torch.nn.attention import SDPBackend

    member = CONFIGS[config]
    return None if member is None else getattr(SDPBackend, member, None)


@functools.cache
def _sdpa_kernel() -> Any:
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel


@functools.cache
def _sdp_switches(config: str) -> tuple[tuple[Any, Any, bool], ...] | None:
    """(getter, setter, value) of every flag ``sdpa_kernel(<config's backend>)`` sets, so that
    the backend is forced without the context manager's per-call work; None where this torch
    does not expose them as ``sdpa_kernel`` itself reads them (then it is used instead)."""
    if config == AUTO:
        return ()
    want = _sdp_backend(config)
    if want is None:
        return None
    try:
        from torch.nn.attention import SDPBackend, _backend_names

        return tuple(
            (
                getattr(torch._C, f"_get_{flag}_sdp_enabled"),
                getattr(torch._C, f"_set_sdp_use_{flag}"),
                getattr(SDPBackend, member) == want,
            )
            for flag, member in _backend_names.items()
        )
    except (ImportError, AttributeError, TypeError):
        return None


@functools.cache
def _config_unavailable(config: str) -> tuple[str, ...]:
    """Why this torch build cannot run ``config`` at all (device aside)."""
    if config == AUTO:
        return ()
    if _sdp_backend(config) is None:
        return (f"this torch ({torch.__version__}) has no SDPBackend.{CONFIGS[config]}",)
    if config == "math":
        return ()
    if not torch.cuda.is_available():
        return ("needs CUDA, and torch sees no CUDA device",)
    if config == "flash" and not torch.backends.cuda.is_flash_attention_available():
        return (f"this torch build ({torch.__version__}) has no flash attention",)
    if config == "cudnn":
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if version is None or version < CUDNN_MIN_VERSION:
            return (f"needs cuDNN >= {CUDNN_MIN_VERSION} (found {version})",)
    return ()


@functools.cache
def _lse_op(config: str) -> tuple[Any, frozenset[str]] | None:
    """The private op for ``config`` and its argument names, when this torch has it."""
    name = _LSE_OPS.get(config)
    packet = getattr(torch.ops.aten, name, None) if name else None
    if packet is None:
        return None
    try:
        schema = packet.default._schema
    except Exception:  # noqa: BLE001 - an op without a readable schema is not used
        return None
    args = frozenset(a.name for a in schema.arguments)
    required = {a.name for a in schema.arguments if not a.has_default_value()}
    if not required <= {"query", "key", "value", "attn_bias", "compute_log_sumexp"}:
        return None
    return packet, args


def _aligned(t: torch.Tensor) -> bool:
    return not t.data_ptr() % _ALIGN_BYTES and _strides_aligned(t)


def _strides_aligned(*tensors: torch.Tensor) -> bool:
    """Every stride but the last a multiple of 16 bytes, in every tensor."""
    elems = _ALIGN_BYTES // tensors[0].element_size()
    return all(s % elems == 0 for t in tensors for s in t.stride()[:-1])


def _rows_lse(raw: torch.Tensor, b: int, hq: int, nq: int) -> torch.Tensor | None:
    """The (B, Hq, Nq) float32 log-sum-exp from what a private SDPA op returned (a trailing
    dimension of 1 dropped, the efficient kernel's padded rows cut), or None when it has
    another shape."""
    lse = raw.squeeze(-1) if raw.dim() == 4 and raw.shape[-1] == 1 else raw
    lse = lse[..., :nq]
    if tuple(lse.shape) != (b, hq, nq):
        return None
    return lse if lse.dtype == torch.float32 else lse.float()


def _prepare(
    config: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs as the fused kernels can read them: misaligned ones copied (not for math)."""
    if config == "math" or (_aligned(q) and _aligned(k) and _aligned(v)):
        return q, k, v
    q, k, v = (
        t if _aligned(t) else t.clone(memory_format=torch.contiguous_format) for t in (q, k, v)
    )
    return q, k, v


def _any_requires_grad(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if t.requires_grad:
            return True
    return False


def _unknown_config(config: str) -> str:
    return f"unknown config {config!r}; torch configs: {', '.join(CONFIGS)}, {FLEX}"


@functools.cache
def _flex_unavailable() -> tuple[str, ...]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as exc:
        return (f"this torch ({torch.__version__}) has no FlexAttention ({exc})",)
    return ()


def _feature_reasons(problem: Problem, config: str) -> list[str]:
    missing = problem.features - CONFIG_FEATURES[config]
    return [f"{config} does not take the feature {name!r}" for name in sorted(missing)]


def _flex_reasons(problem: Problem, device: DeviceInfo | None) -> list[str]:
    reasons = list(_flex_unavailable())
    if not problem.features:
        reasons.append(
            "flex is a candidate for problems with features only (plain problems have SDPA's "
            "fused kernels)"
        )
    reasons += _feature_reasons(problem, FLEX)
    if problem.dtype not in DTYPES:
        reasons.append(f"dtype {problem.dtype} (needs float16 or bfloat16)")
    if problem.op == "bwd" and device is None:
        reasons.append("FlexAttention has no backward for CPU tensors")
    d = problem.head_dim
    if device is not None and (d < FLEX_MIN_HEAD_DIM or d & (d - 1)):
        reasons.append(f"head_dim {d} is not a power of two >= {FLEX_MIN_HEAD_DIM} (FlexAttention on CUDA)")
    return reasons


def _reasons(problem: Problem, config: str, device: DeviceInfo | None) -> list[str]:
    if config == FLEX:
        return _flex_reasons(problem, device)
    if config not in CONFIGS:
        return [_unknown_config(config)]
    if problem.features:
        reasons = _feature_reasons(problem, config)
        if reasons:
            return reasons
    reasons = list(_config_unavailable(config))
    if reasons or config == "math":
        return reasons
    if config == AUTO:  # SDPA picks a kernel that runs, down to its math
        if problem.dtype not in DTYPES:
            reasons.append(f"dtype {problem.dtype} (needs float16 or bfloat16)")
        return reasons
    if device is None:
        return ["needs CUDA tensors (only 'math' runs on other devices)"]
    d, arch = problem.head_dim, device.arch
    square = problem.seqlen_q == problem.seqlen_k
    if problem.dtype not in DTYPES:
        reasons.append(f"dtype {problem.dtype} (needs float16 or bfloat16)")
    if d % HEAD_DIM_MULTIPLE:
        reasons.append(f"head_dim {d} is not a multiple of {HEAD_DIM_MULTIPLE}")
    if config == "flash":
        if arch < FLASH_MIN_ARCH:
            reasons.append(f"needs sm_{FLASH_MIN_ARCH}+ (device is sm_{arch})")
        if d > FLASH_MAX_HEAD_DIM:
            reasons.append(f"head_dim {d} > {FLASH_MAX_HEAD_DIM}")
        if (
            problem.op == "bwd"
            and d > FLASH_BWD_LARGE_HEAD_DIM
            and arch not in FLASH_BWD_LARGE_HEAD_DIM_ARCHS
        ):
            reasons.append(
                f"backward with head_dim {d} > {FLASH_BWD_LARGE_HEAD_DIM} needs sm_80 or sm_90"
            )
    elif config == "cudnn":
        if arch < CUDNN_MIN_ARCH:
            reasons.append(f"needs sm_{CUDNN_MIN_ARCH}+ (device is sm_{arch})")
        if d > CUDNN_MAX_HEAD_DIM:
            reasons.append(f"head_dim {d} > {CUDNN_MAX_HEAD_DIM}")
        if problem.seqlen_k == 1:
            # seen on an H200 (torch 2.11, cuDNN 9.19): "cudnn SDPA does not support key/value
            # sequence length 1"
            reasons.append("key/value sequence length 1 is not supported by cuDNN SDPA")
    else:  # efficient
        if arch < EFFICIENT_MIN_ARCH:
            reasons.append(f"needs sm_{EFFICIENT_MIN_ARCH}+ (device is sm_{arch})")
        if d > EFFICIENT_MAX_HEAD_DIM:
            reasons.append(f"head_dim {d} > {EFFICIENT_MAX_HEAD_DIM}")
    if problem.causal and not square and config in ("flash", "cudnn"):
        reasons.append(
            "causal with seqlen_q != seqlen_k: torch aligns is_causal top-left, sparktune "
            "bottom-right"
        )
    return reasons


def _direct_op(
    config: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    need_lse: bool,
    general: Any,
) -> Any:
    """``f(q, k, v) -> (out, lse)`` calling the private op of ``config`` directly (for
    "auto", SDPA's public call itself), for the problems where SDPA hands its inputs to that
    op unchanged; None elsewhere. Inputs whose data pointer is not 16-byte aligned go to
    ``general``."""
    nq, nk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    if config == "math" or (causal and nq != nk) or not _strides_aligned(q, k, v):
        return None
    if config == AUTO:
        return _auto_op(group, causal, scale, need_lse, general)
    if group > 1 and config != "flash":  # only flash reads grouped k/v as they are
        return None
    op = getattr(torch, _LSE_OPS[config], None)
    if op is None:
        return None
    b, hq = q.shape[0], q.shape[1]
    causal = bool(causal)
    scale = float(scale)

    def lse_of(raw: torch.Tensor) -> torch.Tensor:
        lse = _rows_lse(raw, b, hq, nq)
        if lse is None:
            raise RuntimeError(f"torch {config} returned lse of shape {tuple(raw.shape)}")
        return lse

    extra = {
        "flash": (0.0, causal, False),
        "cudnn": (None, need_lse, 0.0, causal, False),
        "efficient": (None, need_lse, 0.0, causal),
    }[config]
    misaligned = _ALIGN_BYTES - 1

    if need_lse:

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & misaligned:
                return general(q, k, v)
            res = op(q, k, v, *extra, scale=scale)
            return res[0], lse_of(res[1])

    else:

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & misaligned:
                return general(q, k, v)
            return op(q, k, v, *extra, scale=scale)[0], None

    return run


@functools.cache
def _arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def _borrowable(config: str, q: torch.Tensor, k: torch.Tensor, causal: bool, op: str = "fwd") -> bool:
    """Whether "auto" may take its log-sum-exp from ``config``'s private op for these CUDA
    tensors (``op`` "bwd": whether its backward op may run them): the config's own rules
    (:func:`_reasons`) for their problem."""
    b, hq, nq, d = q.shape
    dtype = DTYPE_NAMES.get(q.dtype)
    if dtype is None:
        return False
    problem = Problem(op, dtype, b, hq, k.shape[1], nq, k.shape[2], d, bool(causal))
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    device = DeviceInfo("cuda", divmod(_arch(index), 10), 1)
    return not _reasons(problem, config, device)


def _auto_op(group: int, causal: bool, scale: float, need_lse: bool, general: Any) -> Any:
    """:func:`_direct_op` for "auto", past its checks of the mask and the strides: the call a
    user makes, where it is all that "auto" runs (no log-sum-exp); None elsewhere."""
    if need_lse or (group > 1 and _torch_version() < GQA_MIN_TORCH):
        return None
    sdpa = F.scaled_dot_product_attention
    kwargs: dict[str, Any] = {"is_causal": bool(causal), "scale": float(scale)}
    if group > 1:
        kwargs["enable_gqa"] = True
    misaligned = _ALIGN_BYTES - 1

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & misaligned:
            return general(q, k, v)
        return sdpa(q, k, v, **kwargs), None

    return run


#: torch._fused_sdp_choice's numbers (SDPBackend's order: math 0, flash 1, efficient 2, cudnn 3)
#: for the kernels whose private backward op runs from an output and a log-sum-exp computed
#: elsewhere
_CHOICE_CONFIGS = {1: "flash", 3: "cudnn"}
#: the configs whose backward runs from any backend's forward (:meth:`backward_runner`):
#: "auto" where SDPA's own choice for the call is one of the other two
RUNNER_BACKWARD_CONFIGS = ("cudnn", "flash", AUTO)


def _auto_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> str | None:
    """The config of the kernel SDPA's own choice runs on these CUDA tensors ("flash" or
    "cudnn"), or None for any other (or where this torch cannot say)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    kwargs: dict[str, Any] = {"is_causal": bool(causal), "scale": float(scale)}
    if q.shape[1] != k.shape[1]:
        if _torch_version() < GQA_MIN_TORCH:
            return None
        kwargs["enable_gqa"] = True
    try:
        number = int(choose(q, k, v, None, 0.0, **kwargs))
    except Exception:  # noqa: BLE001 - a torch that cannot say keeps the general backward
        return None
    return _CHOICE_CONFIGS.get(number)


#: :func:`_backward_op`'s runs by what they depend on (:func:`_runner_key`): a training step
#: asks for one in the forward (whether to pair) and again in the backward
_RUNNERS: dict[tuple, Any] = {}
#: entries kept before :data:`_RUNNERS` starts again (a model has few distinct signatures)
_RUNNERS_MAX = 256


#: torch's getters of the global state SDPA's own choice reads besides the tensors: its
#: backend switches (which ``sdpa_kernel`` flips) and their priority order (where this torch
#: has them), the deterministic-algorithms setting and grad mode
_SDP_STATE = tuple(
    getter
    for getter in (
        *(
            getattr(torch._C, f"_get_{name}", None)
            for name in ("flash_sdp_enabled", "cudnn_sdp_enabled", "mem_efficient_sdp_enabled",
                         "math_sdp_enabled", "fa3_sdp_enabled", "sdp_priority_order")
        ),  # fmt: skip
        torch.are_deterministic_algorithms_enabled,
        torch.is_grad_enabled,
    )
    if getter is not None
)


def _sdp_flags() -> tuple[Any, ...]:
    """The global state SDPA's own choice reads (:data:`_SDP_STATE`), as it is now."""
    return tuple(
        tuple(state) if isinstance(state, list) else state
        for state in (getter() for getter in _SDP_STATE)
    )


def _runner_key(
    config: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple:
    """Everything :func:`_backward_op` decides from (not the data pointers, which its run
    checks per call): shapes, strides, dtype, device, whether gradients are asked for, the
    mask and scale, and (for "auto") SDPA's switches."""
    return (
        config, q.dtype, q.device, bool(causal), float(scale),
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
        q.requires_grad, k.requires_grad, v.requires_grad,
        _sdp_flags() if config == AUTO else None,
    )  # fmt: skip


def _cached_backward_op(
    config: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> Any:
    """:func:`_backward_op`, made once per :func:`_runner_key` (its checks, SDPA's choice for
    "auto" and the seed tensor cost more host time than the backward's launch)."""
    key = _runner_key(config, q, k, v, causal, scale)
    try:
        return _RUNNERS[key]
    except KeyError:
        pass
    run = _backward_op(config, q, k, v, causal, scale)
    if len(_RUNNERS) >= _RUNNERS_MAX:
        _RUNNERS.clear()
    _RUNNERS[key] = run
    return run


def _backward_op(
    config: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> Any:
    """``run(dout, q, k, v, out, lse) -> (dq, dk, dv)``: the private backward op of
    ``config`` ("cudnn", "flash"; "auto" where it resolves to one of them) called with the
    given forward's output and (B, Hq, Nq) float32 log-sum-exp, no second forward, for
    tensors like these; None where it does not apply (another config, no such op, causal with
    seqlen_q != seqlen_k, misaligned strides, the config's own rules). Both ops read grouped
    K/V as they are (GQA, MQA) and return dK and dV summed over each group.
    """
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    nq, nk = q.shape[2], k.shape[2]
    if (causal and nq != nk) or not _strides_aligned(q, k, v):
        return None
    if config == AUTO:
        config = _auto_kernel(q, k, v, causal, scale) or ""
    if config not in ("cudnn", "flash"):
        return None
    if not _borrowable(config, q, k, causal, op="bwd"):
        return None
    name = {"cudnn": "_scaled_dot_product_cudnn_attention_backward",
            "flash": "_scaled_dot_product_flash_attention_backward"}[config]  # fmt: skip
    op = getattr(torch.ops.aten, name, None)
    if op is None:
        return None
    causal, scale = bool(causal), float(scale)
    misaligned = _ALIGN_BYTES - 1
    # dropout is off: the philox state is never read, but the ops take tensors
    seed = torch.zeros((), dtype=torch.int64, device=q.device)

    f32 = torch.float32

    def aligned(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor) -> bool:  # fmt: skip
        # (q, k and v have the strides checked above: the same signature reached this run)
        ptrs = dout.data_ptr() | q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()
        return not ptrs & misaligned and _strides_aligned(dout, out)

    def rows(lse: torch.Tensor) -> torch.Tensor:
        return lse if lse.dtype == f32 and lse.is_contiguous() else lse.float().contiguous()

    if config == "cudnn":

        def run(dout, q, k, v, out, lse):  # type: ignore[no-untyped-def]
            if not aligned(dout, q, k, v, out):
                return None
            stats = rows(lse).unsqueeze(-1)  # cuDNN's (B, H, N, 1) statistics
            return op(dout, q, k, v, out, stats, seed, seed, None, None, None, nq, nk, 0.0,
                      causal, scale=scale)  # fmt: skip

    else:

        def run(dout, q, k, v, out, lse):  # type: ignore[no-untyped-def]
            if not aligned(dout, q, k, v, out):
                return None
            return op(dout, q, k, v, out, rows(lse), None, None, nq, nk, 0.0, causal, seed,
                      seed, scale=scale)  # fmt: skip

    return run


def _bottom_right_mask(nq: int, nk: int, device: torch.device) -> torch.Tensor:
    """(nq, nk) boolean mask, True where query i sees key j (j <= i + nk - nq). Rows that see
    nothing are opened fully so that torch produces no NaN; the caller zeroes them."""
    visible = causal_visible(nq, nk, device)
    if nq > nk:
        visible[: nq - nk] = True
    return visible


class TorchSDPABackend(Backend):
    """PyTorch SDPA (flash, cuDNN, memory-efficient, math) behind the sparktune interface."""

    name = "torch"
    tunable = True
    #: the union of the configs' (:data:`CONFIG_FEATURES`); each config names what it lacks
    features = frozenset().union(*CONFIG_FEATURES.values()) | {"decode"}

    def unavailable_reasons(self) -> list[str]:
        try:
            from torch.nn.attention import sdpa_kernel  # noqa: F401
        except ImportError as exc:
            return [f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel ({exc})"]
        return []

    def configs(self, op: str = "fwd") -> Sequence[str]:
        if op == "decode":
            return (AUTO,)  # SDPA's own choice on the sliced cache (docs/DECODING.md)
        return (*CONFIGS, FLEX) if not _flex_unavailable() else tuple(CONFIGS)

    def not_supported_reasons(
        self, problem: Problem, config: str | None = None, device: DeviceInfo | None = None
    ) -> list[str]:
        if problem.op == "decode":
            return _decode_reasons(problem, config)
        if config is not None:
            return _reasons(problem, config, device)
        per_config = {c: _reasons(problem, c, device) for c in self.configs()}
        if any(not r for r in per_config.values()):
            return []
        return [f"{c}: {'; '.join(r)}" for c, r in per_config.items()]

    def default_config(self, problem: Problem, device: DeviceInfo | None = None) -> str | None:
        """On a GPU, SDPA's own choice ("auto": what the caller would run instead); elsewhere
        the first config that runs the problem (the math kernel). Decode: "auto" on the sliced
        cache."""
        if problem.op == "decode":
            return None if _decode_reasons(problem, AUTO) else AUTO
        if device is not None and not _reasons(problem, AUTO, device):
            return AUTO
        return super().default_config(problem, device)

    # -- running -------------------------------------------------------------------------

    @staticmethod
    def _check_config(config: str) -> None:
        if config not in CONFIGS and config != FLEX:
            raise ValueError(_unknown_config(config))

    @staticmethod
    def _sdpa(
        config: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> torch.Tensor:
        """torch's public SDPA forced to ``config``, with sparktune's semantics (rows that see
        no key are not zeroed here)."""
        _, hq, nq, _ = q.shape
        _, hk, nk, _ = k.shape
        group = hq // hk
        kwargs: dict[str, Any] = {"scale": scale}
        if causal and nq == nk:
            kwargs["is_causal"] = True
        elif causal:
            kwargs["attn_mask"] = _bottom_right_mask(nq, nk, q.device)
        if group > 1:
            if config in GQA_NATIVE_CONFIGS and _torch_version() >= GQA_MIN_TORCH:
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
        if config == AUTO:  # SDPA's own choice: nothing forced
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        switches = _sdp_switches(config)
        if switches is None or torch.compiler.is_compiling():  # compilers know sdpa_kernel
            with _sdpa_kernel()(_sdp_backend(config)):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        # what ``with sdpa_kernel(backend):`` does, without its per-call Python work
        before = [get() for get, _, _ in switches]
        try:
            for _, set_, value in switches:
                set_(value)
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        finally:
            for (_, set_, _), value in zip(switches, before, strict=True):
                set_(value)

    @staticmethod
    def _sdpa_with_lse(
        config: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Output and log-sum-exp from torch's private op, or None where it does not apply
        (no such op, a mask would be needed, an unexpected lse shape)."""
        op = _lse_op(config)
        b, hq, nq, _ = q.shape
        if op is None or (causal and nq != k.shape[2]):
            return None
        packet, names = op
        group = hq // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        args = {
            "query": q,
            "key": k,
            "value": v,
            "attn_bias": None,
            "compute_log_sumexp": True,
            "dropout_p": 0.0,
            "is_causal": bool(causal),
            "return_debug_mask": False,
            "scale": scale,
        }
        result = packet(**{n: a for n, a in args.items() if n in names})
        out, lse = result[0], _rows_lse(result[1], b, hq, nq)
        if lse is None or tuple(out.shape) != tuple(q.shape):
            log.warning(
                "sparktune: torch %s returned lse of shape %s for %s; computing lse separately",
                config,
                tuple(result[1].shape),
                tuple(q.shape),
            )
            return None
        return out, lse

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
        **features: Any,
    ) -> torch.Tensor | None:
        if features or config == FLEX:
            self._check_config(config)
            with torch.no_grad():  # (detached: FlexAttention refuses CPU tensors needing grad)
                o, lse = _run_features(
                    config, q.detach(), k.detach(), v.detach(), causal, scale, need_lse, features
                )
                out.copy_(o)
                return lse
        if torch.is_grad_enabled() and _any_requires_grad(q, k, v, out):
            with torch.no_grad():
                o, lse = self._run(config, q, k, v, causal, scale, need_lse)
                out.copy_(o)
                return lse
        o, lse = self._run(config, q, k, v, causal, scale, need_lse)
        out.copy_(o)
        return lse

    def forward_alloc(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
        need_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` into the output tensor SDPA allocates: returns (out, lse), out of
        q's shape and dtype with whatever strides torch chose. ``sparktune.attention()`` uses
        it to save the copy into a buffer of its own (it copies only when the strides are not
        the caller's layout)."""
        if torch.is_grad_enabled() and _any_requires_grad(q, k, v):
            with torch.no_grad():
                return self._run(config, q, k, v, causal, scale, need_lse)
        return self._run(config, q, k, v, causal, scale, need_lse)

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
        device, as :meth:`forward_alloc` computes it (``out`` is only an example here; SDPA
        makes its own). For flash, cuDNN and the efficient kernel, where SDPA would pass the
        inputs on unchanged (no mask, no copies, no repeated k/v), it calls the private op
        SDPA itself calls, with no backend switches to flip and no selection to redo; it
        goes the long way for an input whose data pointer is not 16-byte aligned."""
        self._check_config(config)
        general = functools.partial(
            self.forward_alloc, config=config, causal=causal, scale=scale, need_lse=need_lse
        )
        direct = _direct_op(config, q, k, v, causal, scale, need_lse, general)
        return general if direct is None else direct

    def forward_autograd(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        """The forward recorded by PyTorch's own autograd ((B, H, N, D) views in, out of q's
        shape with torch's strides): its backward is SDPA's backward of the same kernel, from
        what SDPA saved itself, with no second forward. ``sparktune.attention()`` uses it when
        the backward would run on this backend too."""
        self._check_config(config)
        q, k, v = _prepare(config, q, k, v)
        o = self._sdpa(config, q, k, v, causal, scale)
        nq, nk = q.shape[2], k.shape[2]
        if causal and nq > nk:  # rows that see no key give 0
            keep = torch.arange(nq, device=q.device) >= nq - nk
            o = o * keep[:, None].to(o.dtype)
        return o

    def backward_runner(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
    ) -> Any:
        """``run(dout, q, k, v, out, lse) -> (dq, dk, dv)`` from any backend's forward, for
        inputs like these: cuDNN's and flash's private backward ops take the output and the
        log-sum-exp as given ("auto" where SDPA's own choice is one of them), so a training
        call can run another backend's faster forward and this backward with nothing
        computed twice. None for other configs and inputs (:func:`_backward_op`)."""
        self._check_config(config)
        if config not in RUNNER_BACKWARD_CONFIGS:
            return None
        return _cached_backward_op(config, q, k, v, causal, scale)

    def _run(
        self,
        config: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        need_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out, lse) from torch's own output tensor; call with autograd off or with inputs
        that need no gradient (no graph is recorded either way)."""
        self._check_config(config)
        q, k, v = _prepare(config, q, k, v)
        fused = None
        if need_lse and config != AUTO:
            fused = self._sdpa_with_lse(config, q, k, v, causal, scale)
        if fused is not None:
            o, lse = fused
        else:
            o = self._sdpa(config, q, k, v, causal, scale)
            lse = None
            if need_lse and config == AUTO and q.is_cuda:
                # the output stays SDPA's own choice (the same bits as without the lse); the
                # lse comes from the first fused kernel that runs these tensors
                for c in _AUTO_LSE_CONFIGS:
                    if _borrowable(c, q, k, causal):
                        fused = self._sdpa_with_lse(c, q, k, v, causal, scale)
                        if fused is not None:
                            lse = fused[1]
                            break
            if need_lse and lse is None:
                lse = reference_lse(q, k, causal, scale, torch.float32)
        if causal:
            nq, nk = q.shape[2], k.shape[2]
            if nq > nk:  # rows that see no key (their lse is already -inf)
                o[:, :, : nq - nk].zero_()
        return o, lse

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
        **features: Any,
    ) -> None:
        self._check_config(config)
        if not features:
            run = self.backward_runner(q, k, v, config=config, causal=causal, scale=scale)
            grads = None if run is None else run(dout, q, k, v, out, lse)
            if grads is not None:
                for dst, src in zip((dq, dk, dv), grads, strict=True):
                    dst.copy_(src)
                return
        if features or config == FLEX:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                o, _ = _run_features(config, *leaves, causal, scale, False, features)
                gq, gk, gv = torch.autograd.grad(o, leaves, dout)
            dq.copy_(gq)
            dk.copy_(gk)
            dv.copy_(gv)
            return
        nq, nk = q.shape[2], k.shape[2]
        leaves = [t.detach().requires_grad_() for t in _prepare(config, q, k, v)]
        with torch.enable_grad():
            o = self._sdpa(config, *leaves, causal, scale)
            if causal and nq > nk:
                keep = torch.arange(nq, device=q.device) >= nq - nk
                o = o * keep[:, None].to(o.dtype)
            gq, gk, gv = torch.autograd.grad(o, leaves, dout)
        dq.copy_(gq)
        dk.copy_(gk)
        dv.copy_(gv)


# --------------------------------------------------------------------------- decode


def _decode_reasons(problem: Problem, config: str | None) -> list[str]:
    """Why SDPA on the sliced cache (sparktune._kvcache.sdpa_decode) cannot run a decode
    problem; it returns no log-sum-exp, which the call asks of another backend."""
    reasons = []
    if config is not None and config != AUTO:
        reasons.append(f"decode problems run SDPA's own choice on the sliced cache: config {AUTO!r}, "
                       f"got {config!r}")
    if problem.softcap:
        reasons.append("SDPA has no softcap")
    return reasons


# --------------------------------------------------------------------------- features


def _run_features(
    config: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    need_lse: bool,
    features: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) of a problem with features on ``config`` ("flex", or "auto"/"math" with
    an additive float mask); differentiable when the inputs require gradients."""
    unknown = set(features) - {"window", "softcap", "alibi_slopes", "cu_seqlens_q",
                               "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
    if unknown or (config != FLEX and ("softcap" in features or "cu_seqlens_q" in features)):
        raise ValueError(f"torch config {config!r} does not take {sorted(features)}")
    if config == FLEX:
        return _flex(q, k, v, causal, scale, need_lse, features)
    b, hq, nq, _ = q.shape
    hk, nk = k.shape[1], k.shape[2]
    visible = window_visible(nq, nk, q.device, causal=causal, window=features.get("window", (-1, -1)))
    bias = torch.zeros((nq, nk), dtype=torch.float32, device=q.device)
    slopes = features.get("alibi_slopes")
    if slopes is not None:
        diag = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        dist = (diag - torch.arange(nk, device=q.device)[None, :]).abs().float()
        bias = -slopes.expand(b, hq)[:, :, None, None] * dist
    empty = None
    if visible is not None:
        empty = ~visible.any(dim=-1)
        bias = bias.masked_fill(~(visible | empty[:, None]), -float("inf"))  # empty rows opened
    kwargs: dict[str, Any] = {"attn_mask": bias.to(q.dtype), "scale": scale}
    if hq != hk:
        if _torch_version() >= GQA_MIN_TORCH:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
    if config == AUTO:
        o = F.scaled_dot_product_attention(q, k, v, **kwargs)
    else:
        with _sdpa_kernel()(_sdp_backend(config)):
            o = F.scaled_dot_product_attention(q, k, v, **kwargs)
    if empty is not None and bool(empty.any()):
        o = o * (~empty)[:, None].to(o.dtype)
    lse = None
    if need_lse:
        lse = reference_lse(q.detach(), k.detach(), causal, scale, torch.float32, **features)
    return o, lse


@functools.cache
def _flex_function(cuda: bool) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if cuda else flex_attention


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    need_lse: bool,
    features: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlexAttention: soft-capping and ALiBi as the score_mod, the window, causal mask and
    packed sequences as the block mask (dense (B, H, N, D) views, or packed (total, H, D)
    tensors seen as one batch of document ids)."""
    from torch.nn.attention.flex_attention import create_block_mask

    left, right = features.get("window", (-1, -1))
    if causal:
        right = 0
    softcap = float(features.get("softcap", 0.0) or 0.0)
    slopes = features.get("alibi_slopes")
    varlen = features.get("cu_seqlens_q") is not None
    dev = q.device
    if varlen:
        cu_q = features["cu_seqlens_q"].to(dev, torch.int64)
        cu_k = features["cu_seqlens_k"].to(dev, torch.int64)
        len_q, len_k = cu_q.diff(), cu_k.diff()
        nb = len_q.numel()
        doc_q = torch.repeat_interleave(torch.arange(nb, device=dev), len_q)
        doc_k = torch.repeat_interleave(torch.arange(nb, device=dev), len_k)
        diag = torch.arange(q.shape[0], device=dev) - cu_q[doc_q] + (len_k - len_q)[doc_q]
        pos_k = torch.arange(k.shape[0], device=dev) - cu_k[doc_k]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if slopes is not None:
            slopes = slopes.expand(nb, q.shape[1]) if slopes.dim() == 1 else slopes
    else:
        nq, nk = q.shape[2], k.shape[2]
        if slopes is not None:
            slopes = slopes.expand(q.shape[0], q.shape[1]) if slopes.dim() == 1 else slopes

    def diag_of(qi: Any) -> Any:
        return diag[qi] if varlen else qi + (nk - nq)

    def key_of(kv: Any) -> Any:
        return pos_k[kv] if varlen else kv

    def mask_mod(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        d, j = diag_of(qi), key_of(kv)
        m = doc_q[qi] == doc_k[kv] if varlen else j >= 0
        if left >= 0:
            m = m & (j >= d - left)
        if right >= 0:
            m = m & (j <= d + right)
        return m

    score_mod = None
    if softcap or slopes is not None:

        def score_mod(score: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
            if softcap:
                score = torch.tanh(score / softcap) * softcap
            if slopes is not None:
                row = doc_q[qi] if varlen else b
                score = score - slopes[row, h] * (diag_of(qi) - key_of(kv)).abs()
            return score

    block_mask = None
    if varlen or left >= 0 or right >= 0:
        block_mask = create_block_mask(
            mask_mod, None, None, q.shape[2], k.shape[2], device=dev
        )
    flex = _flex_function(dev.type == "cuda")
    o, lse = flex(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1], return_lse=True,
    )  # fmt: skip
    if varlen:
        o, lse = o[0].transpose(0, 1), lse[0]
    return o, (lse.float() if need_lse else None)

"""The checks of ``sparktune.attention()``'s inputs, shared by the eager call, the custom ops
and :func:`sparktune.dispatch.explain`: what is wrong is raised with what is supported."""

from __future__ import annotations

import math
import numbers
import threading
import weakref
from typing import Any

import torch

from .dtypes import DTYPE_NAMES

__all__ = [
    "LAYOUTS",
    "SUPPORTED_DTYPES",
    "NO_WINDOW",
    "OFF",
    "Features",
    "bhnd",
    "check_cu_seqlens",
    "check_features",
    "check_packed_boundaries",
    "check_varlen_inputs",
    "draw_seed_offset",
    "trim_window",
    "check_inputs",
    "check_scale",
    "checked_sizes",
    "dtype_name",
    "quick_sizes",
]


#: layout name -> what the four dimensions are
LAYOUTS = {
    "bhnd": "(batch, heads, seqlen, head_dim)",
    "bnhd": "(batch, seqlen, heads, head_dim)",
}


#: input dtypes and their names in the problem key
SUPPORTED_DTYPES = DTYPE_NAMES


def bhnd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, H, N, D) view of ``t`` given in ``layout`` (never a copy); packed varlen
    tensors (layout "thd") stay as they are."""
    return t.transpose(1, 2) if layout == "bnhd" else t


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    value = float(scale)
    if not 0.0 < value < math.inf:  # also false for NaN; traceable by torch.compile
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return value


def _check_alike(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, api: str) -> None:
    """q, k and v on one device, of one supported dtype (``api`` names the function that
    supports it), k and v of one shape: checked alike for dense and packed inputs."""
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on the same device, got q on {q.device}, k on {k.device}, "
            f"v on {v.device}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must have the same dtype, got q {dtype_name(q.dtype)}, "
            f"k {dtype_name(k.dtype)}, v {dtype_name(v.dtype)}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"dtype {dtype_name(q.dtype)} is not supported; {api} supports "
            + " and ".join(SUPPORTED_DTYPES.values())
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )


def check_inputs(
    q: object, k: object, v: object, layout: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the user's tensors; return their (B, H, N, D) views."""
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        supported = ", ".join(f"{n!r} {dims}" for n, dims in LAYOUTS.items())
        raise ValueError(f"unknown layout {layout!r}; supported layouts: {supported}")
    dims = LAYOUTS[layout]
    for name, t in tensors.items():
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-dimensional {dims} for layout {layout!r}, "
                f"got shape {tuple(t.shape)}"
            )
    _check_alike(q, k, v, "sparktune.attention")
    qb, kb, vb = (bhnd(t, layout) for t in (q, k, v))
    if qb.shape[0] != kb.shape[0]:
        raise ValueError(f"batch sizes differ: q has {qb.shape[0]}, k and v have {kb.shape[0]}")
    if qb.shape[3] != kb.shape[3]:
        raise ValueError(f"head_dim differs: q has {qb.shape[3]}, k and v have {kb.shape[3]}")
    for name, t in zip(tensors, (qb, kb, vb), strict=True):
        if t.numel() == 0:
            b, h, n, d = t.shape
            raise ValueError(
                f"{name} is empty (batch={b}, heads={h}, seqlen={n}, head_dim={d}); "
                "every dimension must be at least 1"
            )
    if qb.shape[1] % kb.shape[1]:
        raise ValueError(
            f"heads of q ({qb.shape[1]}) must be a multiple of heads of k and v ({kb.shape[1]})"
        )
    for name, t in tensors.items():
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            raise ValueError(
                f"the last dimension of {name} must be contiguous (stride 1), got strides "
                f"{tuple(t.stride())}; other strides may be anything"
            )
    return qb, kb, vb


def checked_sizes(
    q: object, k: object, v: object, layout: object
) -> tuple[Any, Any, Any, Any, Any, Any, torch.dtype, torch.device]:
    """What :func:`quick_sizes` returns, from the full checks (which raise and say why)."""
    qb, kb, _ = check_inputs(q, k, v, layout)
    b, hq, nq, d = qb.shape
    return b, hq, kb.shape[1], nq, kb.shape[2], d, qb.dtype, qb.device


def quick_sizes(
    q: object, k: object, v: object, layout: object
) -> tuple[int, int, int, int, int, int, torch.dtype, torch.device] | None:
    """(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, device) of inputs
    that pass every check of :func:`check_inputs`, read with as few tensor calls as
    possible; None when a check fails or is not decided here (a last dimension of size 1 with
    another stride): then :func:`check_inputs` decides, and says why."""
    if not (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    ):
        return None
    qs, ks = q.shape, k.shape
    if len(qs) != 4 or len(ks) != 4 or v.shape != ks:
        return None
    if layout == "bhnd":
        b, hq, nq, d = qs
        _, hk, nk, dk = ks
    elif layout == "bnhd":
        b, nq, hq, d = qs
        _, nk, hk, dk = ks
    else:
        return None
    if not (b and hq and nq and d and hk and nk) or ks[0] != b or dk != d or hq % hk:
        return None
    dtype = q.dtype
    if k.dtype is not dtype or v.dtype is not dtype or dtype not in SUPPORTED_DTYPES:
        return None
    if q.stride()[3] != 1 or k.stride()[3] != 1 or v.stride()[3] != 1:
        return None
    device = q.device
    if k.device != device or v.device != device:
        return None
    return b, hq, hk, nq, nk, d, dtype, device


# --------------------------------------------------------------------------- the features


#: ``window`` off: unlimited on both sides (the default object of the public functions, so
#: that a plain call is recognised by identity)
NO_WINDOW = (-1, -1)
#: ``softcap`` and ``dropout_p`` off (the default object, as above)
OFF = 0.0


class Features:
    """The features of one call, checked (docs/FEATURES.md): ``window`` normalised (causal
    implies ``right = -1``; for dense problems a side that masks nothing is -1),
    ``alibi_slopes`` a (B, Hq) float32 view, and the dropout generator."""

    __slots__ = ("window", "softcap", "alibi_slopes", "dropout_p", "generator", "deterministic")

    def __init__(
        self,
        window: tuple[int, int],
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        dropout_p: float,
        generator: torch.Generator | None,
        deterministic: bool,
    ) -> None:
        self.window = window
        self.softcap = softcap
        self.alibi_slopes = alibi_slopes
        self.dropout_p = dropout_p
        self.generator = generator
        self.deterministic = deterministic

    @property
    def off(self) -> bool:
        return (
            self.window == NO_WINDOW
            and not self.softcap
            and self.alibi_slopes is None
            and not self.dropout_p
            and not self.deterministic
        )

    def key(self) -> tuple[Any, ...]:
        """What the problem key and the plan depend on (not the slopes' values)."""
        return (
            self.window,
            self.softcap,
            self.alibi_slopes is not None,
            self.dropout_p,
            self.deterministic,
        )

    def kwargs(self, seed: int = 0, offset: int = 0) -> dict[str, Any]:
        """The backend's feature keyword arguments, those that are on (not ``deterministic``:
        the backward's alone)."""
        kw: dict[str, Any] = {}
        if self.window != NO_WINDOW:
            kw["window"] = self.window
        if self.softcap:
            kw["softcap"] = self.softcap
        if self.alibi_slopes is not None:
            kw["alibi_slopes"] = self.alibi_slopes
        if self.dropout_p:
            kw["dropout_p"] = self.dropout_p
            kw["seed"] = seed
            kw["offset"] = offset
        return kw


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_window(window: object, causal: bool) -> tuple[int, int]:
    """``window`` as a pair of ints >= -1, with causal's right side -1 (raises and says why)."""
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(
        _is_int(w) for w in window
    ):
        raise TypeError(
            f"window must be a pair of ints (left, right), -1 meaning unlimited on that side, "
            f"got {window!r}"
        )
    left, right = int(window[0]), int(window[1])
    for side, value in (("left", left), ("right", right)):
        if value < -1:
            raise ValueError(
                f"window {side} must be >= 0, or -1 for unlimited, got {value} "
                f"(window={tuple(window)!r})"
            )
    if causal:
        right = -1  # causal is right = 0: the causal flag carries it
    return left, right


def trim_window(window: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """A dense problem's window with a side that masks no key for any row made -1 (the left
    side reaches key 0 for every row when ``left >= seqlen_k - 1``, the right the last key
    when ``right >= seqlen_q - 1``)."""
    left, right = window
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    return left, right


def check_softcap(softcap: object) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0 for off), got {softcap!r}")
    value = float(softcap)
    if not 0.0 <= value < math.inf:
        raise ValueError(f"softcap must be finite and >= 0 (0 for off), got {softcap!r}")
    return value


def check_dropout(dropout_p: object, generator: object) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r}")
    value = float(dropout_p)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    return value


def check_alibi(slopes: object, batch: int, heads_q: int, device: torch.device) -> torch.Tensor:
    """ALiBi slopes as a (batch, heads_q) float32 view (raises and says why)."""
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {dtype_name(slopes.dtype)}")
    if tuple(slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(
            f"alibi_slopes must have shape (heads_q,) = ({heads_q},) or (batch, heads_q) = "
            f"({batch}, {heads_q}), got {tuple(slopes.shape)}"
        )
    if slopes.device != device:
        raise ValueError(
            f"alibi_slopes must be on the inputs' device {device}, got {slopes.device}"
        )
    return slopes.expand(batch, heads_q) if slopes.dim() == 1 else slopes


def check_features(
    window: object,
    softcap: object,
    alibi_slopes: object,
    dropout_p: object,
    generator: object,
    deterministic: object,
    *,
    causal: bool,
    batch: int,
    heads_q: int,
    device: torch.device,
) -> Features:
    """The features of a call, checked (each bad argument raises, naming what is wrong and
    what is supported)."""
    w = check_window(window, causal)
    cap = check_softcap(softcap)
    slopes = None if alibi_slopes is None else check_alibi(alibi_slopes, batch, heads_q, device)
    p = check_dropout(dropout_p, generator)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    return Features(w, cap, slopes, p, generator if p else None, deterministic)


def draw_seed_offset(generator: torch.Generator | None, device: torch.device, count: int) -> tuple[int, int]:
    """(seed, offset) of one call's dropout mask from ``generator`` (default: the device's
    default generator), which is advanced past ``count`` random numbers (so the next call
    gets another mask, and a Philox kernel that counts from ``offset`` has its own range).
    Generators with an offset (CUDA's Philox) give their seed and offset; others (the CPU's)
    give a seed drawn from them, with offset 0."""
    if generator is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            generator = torch.cuda.default_generators[index]
        else:
            generator = torch.default_generator
    if generator.device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(offset + (count + 3) // 4 * 4)
        return generator.initial_seed(), offset
    seed = int(torch.randint(0, 2**62, (), generator=generator, device="cpu"))
    return seed, 0


# --------------------------------------------------------------------------- varlen

#: id(tensor) -> (weak reference, version, data pointer, values) of the boundary tensors read
#: lately (at most _CU_CACHE_SIZE, the oldest dropped first)
_CU_CACHE: dict[int, tuple[Any, int, int, tuple[int, ...]]] = {}
_CU_CACHE_SIZE = 64
_CU_LOCK = threading.Lock()


def cu_values(cu: torch.Tensor) -> tuple[int, ...]:
    """The values of a boundary tensor (``cu_seqlens_*``), read once per tensor and version.

    Reading a CUDA tensor's values waits for the device, so a model that passes the same
    ``cu_seqlens`` to every layer (and the backward, which reuses them) would otherwise stall
    the host at every call. The values are kept for the same tensor object (held weakly, so
    nothing is kept alive) while its version counter and data pointer are unchanged: an in-place
    change (``cu[1] = 5``, ``cu.copy_(...)``) bumps the version and the next call reads again.
    Tensors without a version counter (made under ``torch.inference_mode``) are read every time."""
    try:
        version = cu._version
    except (RuntimeError, AttributeError):
        return tuple(cu.tolist())
    key, ptr = id(cu), cu.data_ptr()
    with _CU_LOCK:
        hit = _CU_CACHE.get(key)
    if hit is not None and hit[0]() is cu and hit[1] == version and hit[2] == ptr:
        return hit[3]
    values = tuple(cu.tolist())

    def forget(_ref: Any, key: int = key) -> None:
        with _CU_LOCK:
            entry = _CU_CACHE.get(key)
            if entry is not None and entry[0] is _ref:
                del _CU_CACHE[key]

    with _CU_LOCK:
        _CU_CACHE.pop(key, None)
        while len(_CU_CACHE) >= _CU_CACHE_SIZE:
            del _CU_CACHE[next(iter(_CU_CACHE))]
        _CU_CACHE[key] = (weakref.ref(cu, forget), version, ptr, values)
    return values


def check_packed_boundaries(
    q: torch.Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any
) -> tuple[int, int, int]:
    """The packed-sequence arguments as a kernel backend takes them (all four given, the
    boundaries contiguous 1-d int32 tensors on q's device of one length, the max lengths
    >= 0); returns (batch, max_seqlen_q, max_seqlen_k). The values are trusted: reading them
    would wait for the device (the API checks them once, :func:`check_cu_seqlens`)."""
    if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
        raise ValueError("varlen needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous 1-d int32 tensor, got {cu.dtype} {tuple(cu.shape)}"
            )
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device}, q on {q.device}")
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must have batch + 1 entries")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
            f"{tuple(cu_seqlens_k.shape)} must have the same length"
        )
    if int(max_seqlen_q) < 0 or int(max_seqlen_k) < 0:
        raise ValueError("max_seqlen_q and max_seqlen_k must be >= 0")
    return cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k)


def check_cu_seqlens(
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    total_q: int,
    total_k: int,
    device: torch.device,
) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """The varlen boundaries checked (docs/FEATURES.md): both int32 1-d on the inputs'
    device, of one length (B + 1), starting at 0, non-decreasing, ending at the packed
    totals, and the max lengths at least the longest sequence. Returns their values with the
    max lengths. The values are read from the device once per tensor (:func:`cu_values`):
    a model passing the same boundaries to every layer waits for the device once, not at
    every call."""
    lists = []
    for name, cu, total in (
        ("cu_seqlens_q", cu_seqlens_q, total_q),
        ("cu_seqlens_k", cu_seqlens_k, total_k),
    ):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {dtype_name(cu.dtype)}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(
                f"{name} must be 1-dimensional with batch + 1 >= 2 entries, got shape "
                f"{tuple(cu.shape)}"
            )
        if cu.device != device:
            raise ValueError(f"{name} must be on the inputs' device {device}, got {cu.device}")
        values = cu_values(cu)
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {values[0]}")
        for b in range(len(values) - 1):
            if values[b + 1] < values[b]:
                raise ValueError(
                    f"{name} must be non-decreasing, but entry {b + 1} ({values[b + 1]}) < "
                    f"entry {b} ({values[b]})"
                )
        if values[-1] != total:
            raise ValueError(
                f"the last entry of {name} ({values[-1]}) must be the number of packed tokens "
                f"({total})"
            )
        lists.append(values)
    cq, ck = lists
    if len(cq) != len(ck):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same batch: they have "
            f"{len(cq) - 1} and {len(ck) - 1} sequences"
        )
    maxes = []
    for name, value, cu in (("max_seqlen_q", max_seqlen_q, cq), ("max_seqlen_k", max_seqlen_k, ck)):
        if not _is_int(value):
            raise TypeError(f"{name} must be an int, got {value!r}")
        longest = max(cu[b + 1] - cu[b] for b in range(len(cu) - 1))
        if int(value) < longest:
            raise ValueError(
                f"{name} ({value}) is smaller than the longest sequence ({longest})"
            )
        maxes.append(int(value))
    return cq, ck, maxes[0], maxes[1]


def check_varlen_inputs(
    q: object, k: object, v: object
) -> tuple[int, int, int, int, int, torch.dtype, torch.device]:
    """Packed (total, H, D) tensors checked like :func:`check_inputs` checks dense ones;
    returns (total_q, total_k, heads_q, heads_kv, head_dim, dtype, device)."""
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-dimensional (total_tokens, heads, head_dim) for "
                f"varlen_attention, got shape {tuple(t.shape)}"
            )
    _check_alike(q, k, v, "sparktune.varlen_attention")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim differs: q has {q.shape[2]}, k and v have {k.shape[2]}")
    if not (q.shape[1] and q.shape[2] and k.shape[1]):
        raise ValueError("heads and head_dim must be at least 1")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"heads of q ({q.shape[1]}) must be a multiple of heads of k and v ({k.shape[1]})"
        )
    for name, t in tensors.items():
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            raise ValueError(
                f"the last dimension of {name} must be contiguous (stride 1), got strides "
                f"{tuple(t.stride())}"
            )
    return q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device

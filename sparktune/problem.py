"""The problem key: what a kernel is asked to compute, and the device it runs on."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Problem", "DeviceInfo", "DTYPES", "DECODE_FEATURES", "FEATURES", "OPS"]

DTYPES = ("float16", "bfloat16")
OPS = ("fwd", "bwd", "decode")
#: the attention features a problem may have and a backend may declare (docs/FEATURES.md);
#: "decode" is every problem of op "decode" (a few queries against a KV cache,
#: docs/DECODING.md): a backend runs them only when it declares it
FEATURES = ("window", "softcap", "alibi", "dropout", "deterministic", "varlen", "decode")
#: the features a decode problem may have besides "decode"
DECODE_FEATURES = frozenset(("window", "softcap", "alibi"))

_NO_FEATURES: frozenset[str] = frozenset()


def _visible_pairs(nq: int, nk: int, causal: bool, left: int, right: int) -> int:
    """How many (query, key) pairs a dense problem's mask leaves visible (bottom-right
    alignment, docs/FEATURES.md)."""
    if causal:
        right = 0
    if left < 0 and right < 0:
        return nq * nk
    total = 0
    for i in range(nq):
        d = i + nk - nq
        lo = 0 if left < 0 else max(0, d - left)
        hi = nk - 1 if right < 0 else min(nk - 1, d + right)
        if hi >= lo:
            total += hi - lo + 1
    return total


@functools.cache
def _hashed_fields(cls: type) -> tuple[str, ...]:
    """The fields the hash that ``@dataclass`` would generate for ``cls`` covers, in order."""
    return tuple(
        f.name for f in dataclasses.fields(cls) if (f.compare if f.hash is None else f.hash)
    )


class _CachedHash:
    """Mixin for frozen dataclasses used as dictionary keys on every call: the hash of the
    compared fields is computed once, at construction. It is not pickled or copied (string
    hashes differ between processes); unpickling and copying compute it again."""

    def _set_hash(self) -> None:
        names = _hashed_fields(type(self))
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, n) for n in names)))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._set_hash()


@dataclass(frozen=True)
class Problem(_CachedHash):
    """One attention problem. Hashable; the tuning database keys records on it.

    Tensors are seen as (batch, heads, seqlen, head_dim); the memory layout (BHND or BNHD, any
    strides with a contiguous last dimension) is not part of the key.
    """

    op: str
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    allow_fp16_accum: bool = False
    # the features (docs/FEATURES.md); the defaults mean "off", so that records made before
    # they existed keep their keys
    #: keys left/right of each query's diagonal, -1 unlimited (causal implies right = -1)
    window_left: int = -1
    window_right: int = -1
    softcap: bool = False
    alibi: bool = False
    dropout: bool = False
    #: bitwise reproducible gradients (a "bwd" problem only)
    deterministic: bool = False
    #: packed sequences: batch counts them, seqlen_q/seqlen_k are the longest, total_q/total_k
    #: the packed totals (0 unless varlen)
    varlen: bool = False
    total_q: int = 0
    total_k: int = 0
    #: decode problems (op "decode", docs/DECODING.md): seqlen_q is the number of queries
    #: (Nq), seqlen_k the power-of-two bucket (>= 16) of the cache's capacity; page_size the
    #: cache's page size (0: a contiguous cache), appends the tokens appended before attending
    page_size: int = 0
    appends: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})"
            )
        if (
            self.window_left != -1
            or self.window_right != -1
            or self.softcap
            or self.alibi
            or self.dropout
            or self.deterministic
            or self.varlen
            or self.total_q
            or self.total_k
            or self.op == "decode"
            or self.page_size
            or self.appends
        ):
            self._check_features()
            features = frozenset(
                name
                for name, on in (
                    ("window", self.window_left != -1 or self.window_right != -1),
                    ("softcap", self.softcap),
                    ("alibi", self.alibi),
                    ("dropout", self.dropout),
                    ("deterministic", self.deterministic),
                    ("varlen", self.varlen),
                    ("decode", self.op == "decode"),
                )
                if on
            )
        else:
            features = _NO_FEATURES
        object.__setattr__(self, "_features", features)
        self._set_hash()

    def _check_features(self) -> None:
        for name in ("page_size", "appends"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.op == "decode":
            self._check_decode()
        elif self.page_size or self.appends:
            raise ValueError(
                f"page_size and appends are for decode problems only (op 'decode'), got op "
                f"{self.op!r} with page_size {self.page_size}, appends {self.appends}"
            )
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ValueError(f"{name} must be an integer >= -1 (-1: unlimited), got {value!r}")
        if self.causal and self.window_right != -1:
            raise ValueError(
                f"a causal problem has window_right -1 in its key (causal is right = 0), got "
                f"{self.window_right}"
            )
        for name in ("softcap", "alibi", "dropout", "deterministic", "varlen"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.deterministic and self.op != "bwd":
            raise ValueError("deterministic applies to the backward: only a 'bwd' problem has it")
        for name, longest in (("total_q", self.seqlen_q), ("total_k", self.seqlen_k)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if not self.varlen:
                if value:
                    raise ValueError(f"{name} is for varlen problems only (0 otherwise), got {value}")
            elif not longest <= value <= self.batch * longest:
                raise ValueError(
                    f"{name} ({value}) must be between the longest sequence ({longest}) and "
                    f"batch * longest ({self.batch * longest})"
                )

    def _check_decode(self) -> None:
        n = self.seqlen_k
        if n < 16 or n & (n - 1):
            raise ValueError(
                f"a decode problem's seqlen_k is the cache-length bucket, a power of two >= 16 "
                f"(the next one of the cache's capacity), got {n}"
            )
        if self.page_size > n:
            raise ValueError(f"page_size ({self.page_size}) must not exceed the cache-length bucket ({n})")
        if self.appends > n:
            raise ValueError(f"appends ({self.appends}) must not exceed the cache-length bucket ({n})")
        for name in ("dropout", "deterministic", "varlen", "allow_fp16_accum"):
            if getattr(self, name):
                raise ValueError(
                    f"a decode problem has no {name}; decode problems take the features "
                    f"{', '.join(sorted(DECODE_FEATURES))}"
                )

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    @property
    def is_decode(self) -> bool:
        return self.op == "decode"

    @property
    def paged(self) -> bool:
        """A decode problem on a paged cache."""
        return self.page_size > 0

    @property
    def features(self) -> frozenset[str]:
        """The names of the features this problem has (see :data:`FEATURES`)."""
        return self._features  # type: ignore[attr-defined]

    @property
    def window(self) -> tuple[int, int]:
        return self.window_left, self.window_right

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    def flops(self) -> float:
        """FLOPs as FlashAttention counts them: 4*B*H*Nq*Nk*D forward (halved when causal),
        backward 2.5x forward; with a window or varlen, 4*B*H*D times the visible (query, key)
        pairs (varlen: of sequences of the mean lengths). Decode: 4*B*Hq*Nq*D times the
        cache-length bucket (every query against a full cache; neither the causal diagonal nor
        a window is subtracted: the tuner's caches are full and decode cost is the K/V read,
        see :meth:`bytes_read`)."""
        if self.op == "decode":
            return 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        if not self._features or self._features <= {"softcap", "alibi", "dropout", "deterministic"}:
            f = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
            if self.causal:
                f /= 2
            return f * (2.5 if self.op == "bwd" else 1.0)
        # windows and varlen: the visible area (varlen: sequences of the mean lengths)
        if self.varlen:
            nq = max(1, round(self.total_q / self.batch))
            nk = max(1, round(self.total_k / self.batch))
        else:
            nq, nk = self.seqlen_q, self.seqlen_k
        pairs = _visible_pairs(nq, nk, self.causal, self.window_left, self.window_right)
        f = 4.0 * self.batch * self.heads_q * pairs * self.head_dim
        return f * (2.5 if self.op == "bwd" else 1.0)

    def bytes_read(self) -> float:
        """Bytes of K and V a decode problem reads with every cache full (the bandwidth
        numerator: ``2 * B * Hkv * cache_len * D * itemsize``); for other problems the same
        count over seqlen_k, once."""
        return 2.0 * self.batch * self.heads_kv * self.seqlen_k * self.head_dim * 2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> Problem:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class DeviceInfo(_CachedHash):
    """Fingerprint of the GPU a measurement belongs to."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    driver: str = ""
    cuda: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        self._set_hash()

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    @property
    def arch(self) -> int:
        """Compute capability as one number: (9, 0) -> 90."""
        return self.capability[0] * 10 + self.capability[1]

    @classmethod
    def from_torch(cls, device: Any = None) -> DeviceInfo:
        """The fingerprint of a CUDA device (default: the current one)."""
        import torch

        index = torch.device(device if device is not None else "cuda").index
        if index is None:
            index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return cls(
            name=props.name,
            capability=(props.major, props.minor),
            sm_count=props.multi_processor_count,
            driver=_driver_version(),
            cuda=str(torch.version.cuda or ""),
            extra={"index": index},
        )


@functools.lru_cache(maxsize=1)
def _driver_version() -> str:
    """The NVIDIA driver's version ("580.159.04") from NVML where the nvidia-ml-py package is
    installed, else the CUDA version the driver supports as PyTorch reads it ("cuda 13.0"),
    else "". Informative only: records of other driver versions still apply."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - no NVML: fall back below
        pass
    try:
        import torch

        v = int(torch._C._cuda_getDriverVersion())
        return f"cuda {v // 1000}.{v % 1000 // 10}" if v > 0 else ""
    except Exception:  # noqa: BLE001
        return ""

"""The problem key: what a kernel is asked to compute, and the device it runs on."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Problem", "DeviceInfo", "DTYPES", "OPS"]

DTYPES = ("float16", "bfloat16")
OPS = ("fwd", "bwd")


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
        self._set_hash()

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    def flops(self) -> float:
        """FLOPs as FlashAttention counts them: 4*B*H*Nq*Nk*D forward (halved when causal and
        square), backward 2.5x forward."""
        f = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        if self.causal:
            f /= 2
        return f * (2.5 if self.op == "bwd" else 1.0)

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

"""Hugging Face transformers models on sparktune: ``attn_implementation="sparktune"``.

::

    import sparktune.integrations.transformers  # registers "sparktune" (so does register())

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sparktune")
    model.set_attn_implementation("sparktune")  # or switch a model already built

Importing this module registers, under the name ``"sparktune"``, an attention function with
transformers' ``AttentionInterface`` and a mask function with its ``AttentionMaskInterface``.
Importing ``sparktune`` itself never imports transformers.

**What runs on sparktune.** transformers hands the attention function q, k and v as
(B, H, N, D) tensors, grouped-query K/V not repeated. They go to :func:`sparktune.attention`
as they are (no views, no copies): K/V heads stay grouped (``heads_kv < heads_q``), and the
output is returned as (B, N, H, D), contiguous, made as transformers' own ``sdpa`` function
makes it, which is what the model reshapes next. The attention weights returned are None.

- No mask (the mask function skipped it), as transformers' ``sdpa`` function reads it: causal
  when the layer is causal and there is more than one query; keys past the queries are
  dropped first when there are more of them (the prefill of an empty static cache, the only
  case where transformers leaves such a mask out).
- A boolean mask that is exactly the plain causal mask (square, query ``i`` sees keys
  ``j <= i``): causal.
- A boolean mask that is exactly the causal sliding-window mask of the layer's
  ``sliding_window`` (square, query ``i`` sees keys ``i - sliding_window < j <= i``, as
  transformers builds it for Mistral, Gemma and others): causal with
  ``window=(sliding_window - 1, -1)``.
- Soft-capped logits (``softcap``, Gemma 2): ``softcap=``, always (transformers' ``sdpa``
  function refuses them; where no backend but the reference math runs them, sparktune says
  so once).

A sliding window runs on sparktune when a backend other than the reference math can run it
there (dispatch decides, as for any call; the answer is kept per shape); else it falls back
as below (reason ``"mask"``), as it does while a compiler traces. Such a mask reaches the attention function when a model asks for a
  materialised mask, or when transformers builds one because it is tracing (below). In eager
  mode each mask tensor is compared once (the result is kept for that tensor and version).

**What falls back.** Anything else runs transformers' own ``sdpa`` function with the same
arguments, so that the result is the one ``attn_implementation="sdpa"`` gives; each reason
is logged once (logger ``sparktune.integrations.transformers``) and counted
(:func:`counters`). The reasons are :data:`FALLBACK_REASONS`.

**torch.compile.** transformers' own mask function materialises a mask while tracing in
cases where it can skip it in eager mode. The mask function registered here is transformers'
``sdpa`` mask function, except that while compiling it skips the mask wherever transformers'
eager rules skip it without reading any tensor (no padding mask given, integer offsets, no
local window that bites): a traced model then reaches sparktune with no data-dependent
branch. One case stays data-dependent: training without a cache, where transformers derives
a packed-sequence mask from ``position_ids`` and so builds a full mask. There the attention
function compares the mask with the causal one on the device and branches on the result,
a graph break at each attention call, when the compiler allows graph breaks; under
``fullgraph=True`` or ``torch.export`` it cannot, and the call falls back to SDPA
(reason ``"mask_unchecked"``). A forward with a cache (``use_cache=True``, as in generation)
has no such mask. (A mask transformers builds from a padding mask is never skipped while
tracing: it is compared in the same way.)

Under a compiler, the counters count the calls traced, not the calls run.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import sparktune
from sparktune.dtypes import DTYPE_NAMES

try:  # the mask functions and their interface (transformers 4.53 and later)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError:  # pragma: no cover - older transformers
    AttentionMaskInterface = None
    sdpa_mask = None

__all__ = [
    "FALLBACK_REASONS",
    "NAME",
    "attention_forward",
    "counters",
    "mask_function",
    "register",
    "reset_counters",
]

log = logging.getLogger(__name__)

#: the ``attn_implementation`` name this module registers
NAME = "sparktune"

#: why a call falls back to transformers' sdpa function -> what that means
FALLBACK_REASONS: dict[str, str] = {
    "mask": "an attention mask other than the plain causal one and the layer's causal sliding "
    "window (padding, packed sequences, a chunk that bites, a custom mask), or a sliding window "
    "no backend but the reference math can run (or met while a compiler traces)",
    "mask_unchecked": "a mask met while torch.compile traces with graph breaks forbidden "
    "(fullgraph=True or export), where it cannot be compared with the causal mask",
    "dropout": "attention dropout (a model in training mode with attention_dropout > 0)",
    "output_attentions": "the attention weights were asked for",
    "position_bias": "an additive position bias",
    "dtype": "a dtype other than float16 and bfloat16",
    "shape": "shapes sparktune does not take (k and v head dims differ, batch sizes differ, "
    "query heads not a multiple of key heads)",
    "layout": "a tensor whose last dimension is not contiguous",
    "rejected": "sparktune.attention raised (the log line says why)",
}

#: torch.export is tracing (False on a torch without the question)
_is_exporting: Callable[[], bool] = getattr(torch.compiler, "is_exporting", lambda: False)

_counts: dict[str, int] = {}
_logged: set[str] = set()


def counters() -> dict[str, int]:
    """Calls of the attention function in this process: ``"sparktune"`` for those that ran
    on :func:`sparktune.attention`, and one entry per fallback reason met (see
    :data:`FALLBACK_REASONS`). Under a compiler, the calls traced."""
    return dict(_counts)


def reset_counters() -> None:
    """Set every count to zero (reasons already logged stay quiet)."""
    _counts.clear()


@torch.compiler.assume_constant_result
def _note(what: str, detail: str = "") -> bool:
    """Count one call of kind ``what`` ("sparktune", "sparktune_decode" (counted besides
    "sparktune" for decode steps) or a fallback reason) and log a fallback
    reason the first time it is met. Marked constant so that a compiler runs it once while
    tracing (logging cannot be traced) instead of breaking the graph."""
    _counts[what] = _counts.get(what, 0) + 1
    if what not in (NAME, DECODE) and what not in _logged:
        _logged.add(what)
        log.warning(
            "sparktune: attention falls back to transformers' sdpa: %s%s "
            "(logged once per reason; see sparktune.integrations.transformers.counters())",
            FALLBACK_REASONS.get(what, what),
            f" ({detail})" if detail else "",
        )
    return True


@torch.compiler.assume_constant_result
def _graph_breaks_allowed() -> bool:
    """Whether the compiler tracing the caller may break the graph (not under
    ``fullgraph=True``, ``torch.export`` or ``error_on_graph_break``). Answered while
    tracing, from the tracer's own settings; False whenever that cannot be read."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return not (getattr(tx, "one_graph", True) or getattr(tx, "error_on_graph_break", True))
    except Exception:  # noqa: BLE001 - another tracer, or another torch: assume not
        return False


# --------------------------------------------------------------------- the plain causal mask

#: (weak reference to a mask, its key (:func:`_mask_version`), the answer) for the masks
#: compared lately
_checked: list[tuple[weakref.ref[torch.Tensor], tuple[int, int], bool]] = []


def _mask_version(mask: torch.Tensor, layer: int | None) -> tuple[int, int] | None:
    """What a remembered answer about ``mask`` is keyed on besides the tensor itself, or None
    when nothing may be remembered or reused. A normal tensor: its version counter (an
    in-place change is compared again). An inference-mode tensor has no version counter; a
    model's forward hands one mask tensor to its attention layers in the order of their
    ``layer_idx``, so an answer is reused only by a later layer (a larger index) than the one
    that compared it: every forward compares its mask once, at its first attention layer,
    whatever the caller did to the tensor between forwards. Without a layer index: compared
    at every call."""
    if not torch.is_inference(mask):
        return (mask._version, -1)
    return None if layer is None else (-1, layer)


def _recall(memory: list, mask: torch.Tensor, key: tuple[int, int] | None) -> tuple[bool, Any]:
    """(found, answer) from ``memory`` (entries ``(weakref, key, answer)``)."""
    if key is None:
        return False, None
    for ref, seen, answer in memory:
        if ref() is mask and (seen[0] == -1 and seen[1] < key[1] if key[0] == -1 else seen == key):
            return True, answer
    return False, None


def _remember(memory: list, mask: torch.Tensor, key: tuple[int, int] | None, answer: Any) -> None:
    """Keep ``answer`` about ``mask`` (replacing an older one about the same tensor)."""
    if key is None:
        return
    memory[:] = [e for e in memory if e[0]() is not None and e[0]() is not mask]
    if len(memory) >= _CHECKED_MAX:
        del memory[0]
    memory.append((weakref.ref(mask), key, answer))


#: masks remembered (a model has one or two kinds of mask: full and sliding)
_CHECKED_MAX = 4
#: mask elements compared at once in eager mode (bounds the temporary comparison)
_CHUNK_ELEMENTS = 1 << 24


def _equals_causal_traced(mask: torch.Tensor) -> torch.Tensor:
    """A 0-d bool: the square mask is the causal one (one expression, which a compiler
    fuses into a reduction over the mask)."""
    n = mask.shape[-1]
    idx = torch.arange(n, device=mask.device)
    return (mask == (idx[:, None] >= idx[None, :])).all()


def _equals_causal(mask: torch.Tensor) -> bool:
    """Whether the square mask is the causal one, compared in row blocks (one sync)."""
    n = mask.shape[-1]
    cols = torch.arange(n, device=mask.device)
    rows_per_block = max(1, _CHUNK_ELEMENTS // max(1, mask[..., :1, :].numel()))
    ok = torch.ones((), dtype=torch.bool, device=mask.device)
    for start in range(0, n, rows_per_block):
        rows = cols[start : start + rows_per_block]
        block = mask[..., start : start + rows_per_block, :]
        ok &= (block == (rows[:, None] >= cols[None, :])).all()
    return bool(ok)


def _equals_window(mask: torch.Tensor, left: int) -> bool:
    """Whether the square mask is the causal mask with ``left`` keys before the diagonal
    (``i - left <= j <= i``), compared in row blocks (one sync)."""
    n = mask.shape[-1]
    cols = torch.arange(n, device=mask.device)
    rows_per_block = max(1, _CHUNK_ELEMENTS // max(1, mask[..., :1, :].numel()))
    ok = torch.ones((), dtype=torch.bool, device=mask.device)
    for start in range(0, n, rows_per_block):
        rows = cols[start : start + rows_per_block, None]
        block = mask[..., start : start + rows_per_block, :]
        ok &= (block == ((rows >= cols[None, :]) & (cols[None, :] >= rows - left))).all()
    return bool(ok)


def _is_causal_window(mask: torch.Tensor, nq: int, nk: int, left: int) -> bool:
    """Whether ``mask`` is exactly the causal sliding-window mask (``left`` keys before the
    diagonal) of a square problem, outside a compiler (kept per mask tensor and version)."""
    if (
        torch.compiler.is_compiling()
        or mask.dtype != torch.bool
        or mask.dim() != 4
        or nq != nk
        or tuple(mask.shape[-2:]) != (nq, nk)
    ):
        return False
    key = _mask_version(mask, None)  # inference-mode masks: compared at every call
    key = None if key is None else (key[0], left)
    found, answer = _recall(_checked_windows, mask, key)
    if found:
        return answer
    answer = _equals_window(mask, left)
    _remember(_checked_windows, mask, key, answer)
    return answer


#: as :data:`_checked`, for the sliding-window masks (the version with the window)
_checked_windows: list[tuple[weakref.ref[torch.Tensor], tuple[int, int], bool]] = []

#: (dispatch generation, shapes, dtype, device, causal, window, softcap on) -> whether a
#: backend other than the reference math runs that problem
_fast: dict[tuple[Any, ...], bool] = {}


def _runs_fast(query: torch.Tensor, key: torch.Tensor, causal: bool, window: tuple[int, int],
               softcap: float) -> bool:
    """Whether dispatch sends this call with features to a backend other than the fallback
    (the reference math); False while a compiler traces."""
    if torch.compiler.is_compiling():
        return False
    from sparktune import dispatch
    from sparktune._plan import FALLBACK_BACKENDS

    memo = (dispatch.generation, query.shape, key.shape, query.dtype, query.device, causal,
            window, bool(softcap))  # fmt: skip
    answer = _fast.get(memo)
    if answer is None:
        try:
            ex = sparktune.explain(query, k=key, causal=causal, window=window, softcap=softcap)
            answer = ex.selection is not None and ex.selection.candidate.backend not in FALLBACK_BACKENDS
        except (TypeError, ValueError):
            answer = False
        if len(_fast) >= 256:
            _fast.clear()
        _fast[memo] = answer
    return answer


def _is_plain_causal(mask: torch.Tensor, nq: int, nk: int, layer: int | None = None) -> bool | None:
    """Whether ``mask`` is exactly the causal mask of a square problem; None when that
    cannot be known (a compiler that forbids graph breaks is tracing). ``layer``: the calling
    attention layer's index (:func:`_mask_version`)."""
    if (
        mask.dtype != torch.bool
        or mask.dim() != 4
        or nq != nk
        or tuple(mask.shape[-2:]) != (nq, nk)
    ):
        return False
    if torch.compiler.is_compiling():
        if not _graph_breaks_allowed():
            return None
        return bool(_equals_causal_traced(mask))  # data-dependent: the graph breaks here
    key = _mask_version(mask, layer)
    found, answer = _recall(_checked, mask, key)
    if found:
        return answer
    answer = _equals_causal(mask)
    _remember(_checked, mask, key, answer)
    return answer


# ------------------------------------------------------------------------ decode steps

#: the counter of calls that ran as decode steps (:func:`sparktune.attention_with_kvcache`)
DECODE = "sparktune_decode"
#: query tokens per decode step at most (plain decoding and speculative verification)
DECODE_MAX_QUERIES = 16
#: (mask, key) -> the cache lengths it encodes, or None (not a prefix mask)
_decode_checked: list[tuple[weakref.ref[torch.Tensor], tuple[int, int], torch.Tensor | None]] = []


def _decode_candidate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, nq: int,
                      nk: int) -> bool:
    """A few queries against more keys, eager, inference: the shape of a decode step."""
    return (
        nq <= DECODE_MAX_QUERIES
        and nk > nq
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                              or value.requires_grad))
    )


def _decode_lengths(mask: torch.Tensor, nq: int, nk: int, layer: int | None = None
                    ) -> torch.Tensor | None:
    """The int32 ``(B,)`` cache lengths when the boolean ``(B, 1, Nq, Nk)`` mask is exactly a
    static cache's decode mask (sequence b's query i sees keys ``j <= i + L_b - Nq``, the rest
    of the cache being unwritten); else None. Compared once per mask tensor and version (one
    sync per decode step: the layers share the mask), or under ``torch.inference_mode`` once
    per forward (``layer``, :func:`_mask_version`)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or tuple(
        mask.shape[-2:]
    ) != (nq, nk):
        return None
    key = _mask_version(mask, layer)
    found, answer = _recall(_decode_checked, mask, key)
    if found:
        return answer
    answer = _decode_compare(mask, nq, nk)
    _remember(_decode_checked, mask, key, answer)
    return answer


def _decode_compare(mask: torch.Tensor, nq: int, nk: int) -> torch.Tensor | None:
    """:func:`_decode_lengths` without the memory: reads the mask (one host sync)."""
    rows = mask[:, 0]
    lens = rows[:, -1].sum(-1, dtype=torch.int32)
    cols = torch.arange(nk, device=mask.device)
    last = lens[:, None] - nq + torch.arange(nq, device=mask.device)[None, :]  # (B, Nq)
    expected = cols[None, None, :] <= last[:, :, None]
    return lens if bool(((rows == expected).all() & (lens >= nq).all()).item()) else None


# ------------------------------------------------------------------------ attention function


def _unsupported(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[str, str] | None:
    """(reason, detail) when the call cannot run on sparktune whatever the mask; else None."""
    if dropout:
        return "dropout", f"p={dropout}"
    if kwargs.get("output_attentions"):
        return "output_attentions", ""
    if kwargs.get("position_bias") is not None:
        return "position_bias", ""
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in DTYPE_NAMES:
        return "dtype", str(query.dtype).removeprefix("torch.")
    if (
        query.dim() != 4
        or key.dim() != 4
        or key.shape != value.shape
        or query.shape[0] != key.shape[0]
        or query.shape[3] != key.shape[3]
        or query.shape[1] % key.shape[1]
    ):
        return "shape", f"q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}"
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return "layout", ""
    return None


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for ``attn_implementation="sparktune"``: the
    signature and result of its ``sdpa`` function (q, k, v (B, H, N, D), K/V heads grouped;
    output (B, N, H, D) contiguous, weights None), computed by :func:`sparktune.attention`
    where it can be, else by transformers' ``sdpa`` function (see the module's text)."""
    problem = _unsupported(query, key, value, dropout, kwargs)
    nq, nk = query.shape[2], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    k, v = key, value
    window = (-1, -1)
    softcap = kwargs.get("softcap")
    softcap = float(softcap) if softcap is not None else 0.0
    sliding = kwargs.get("sliding_window")
    if problem is None and attention_mask is not None:
        layer = getattr(module, "layer_idx", None)
        layer = layer if isinstance(layer, int) and not isinstance(layer, bool) else None
        plain = _is_plain_causal(attention_mask, nq, nk, layer)
        lens = None
        if plain is False and not softcap and _decode_candidate(query, key, value, nq, nk):
            lens = _decode_lengths(attention_mask, nq, nk, layer)
        if lens is not None:
            # a decode step against a static cache (transformers wrote the new tokens): the
            # queries see a prefix of each sequence's cache, bottom-right aligned
            try:
                out = sparktune.attention_with_kvcache(
                    query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                    cache_seqlens=lens, causal=True, scale=scaling,
                )
            except (TypeError, ValueError) as exc:
                problem = "rejected", str(exc).splitlines()[0]
            else:
                _note(NAME)
                _note(DECODE)
                return out.contiguous(), None
        elif plain is None:
            problem = "mask_unchecked", ""
        elif plain:
            causal = True
        elif (
            isinstance(sliding, int)
            and not isinstance(sliding, bool)
            and sliding > 0
            and _is_causal_window(attention_mask, nq, nk, sliding - 1)
            and _runs_fast(query, key, True, (sliding - 1, -1), softcap)
        ):
            causal, window = True, (sliding - 1, -1)
        else:
            problem = "mask", f"{attention_mask.dtype} mask of shape {tuple(attention_mask.shape)}"
    elif causal:
        # no mask, as transformers' sdpa function reads it: one query sees every key; more
        # keys than queries only for an empty static cache, whose unwritten tail is dropped
        causal = nq > 1
        if causal and nk > nq:
            k, v = key[:, :, :nq], value[:, :, :nq]
    if problem is None:
        # (B, H, N, D) as transformers gives them, and its (B, N, H, D) contiguous output as
        # its sdpa function makes it: no views or copies beyond what that function does
        if torch.compiler.is_compiling():  # checked while tracing; nothing to catch here
            if softcap:  # (runs eagerly: a graph break)
                out = sparktune.attention(query, k, v, causal=causal, scale=scaling, softcap=softcap)
            else:
                out = sparktune.attention(query, k, v, causal=causal, scale=scaling)
            _note(NAME)
            return out.transpose(1, 2).contiguous(), None
        try:
            if softcap or window != (-1, -1):
                out = sparktune.attention(
                    query, k, v, causal=causal, scale=scaling, window=window, softcap=softcap
                )
            else:
                out = sparktune.attention(query, k, v, causal=causal, scale=scaling)
        except (TypeError, ValueError) as exc:  # NoKernelError is a ValueError
            problem = "rejected", str(exc).splitlines()[0]
        else:
            _note(NAME)
            return out.transpose(1, 2).contiguous(), None
    reason, detail = problem
    _note(reason, detail)
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


# ----------------------------------------------------------------------------- mask function


def _skippable_while_tracing(kwargs: dict[str, Any]) -> bool:
    """Whether transformers' eager rules skip this mask without reading a tensor (no padding
    mask, an integer query offset, no local window that bites) while a compiler traces,
    where transformers' own mask function may materialise it."""
    if not torch.compiler.is_compiling() or _is_exporting():
        return False
    if "q_length" not in kwargs or kwargs.get("attention_mask") is not None:
        return False  # an older signature, or a padding mask: decided by transformers
    q_length, kv_length = kwargs["q_length"], kwargs["kv_length"]
    q_offset = kwargs.get("q_offset", 0)
    if isinstance(q_offset, torch.Tensor):
        return False
    local_size = kwargs.get("local_size")
    if local_size is not None and kv_length >= local_size:
        return False
    if kwargs.get("allow_is_causal_skip", True):
        return bool(q_length == 1 or kv_length == q_length or q_offset == 0)
    return bool(kwargs.get("allow_is_bidirectional_skip", False))


def mask_function(**kwargs: Any) -> torch.Tensor | None:
    """transformers' mask function for ``attn_implementation="sparktune"``: its ``sdpa``
    mask function (a boolean mask, or None where SDPA's ``is_causal`` or no mask does), which
    also skips, while a compiler traces, the masks that its eager rules skip without reading
    data. Takes the keyword arguments transformers passes to a mask function."""
    if _skippable_while_tracing(kwargs):
        return None
    if sdpa_mask is None:  # pragma: no cover - older transformers
        raise RuntimeError("this transformers has no sdpa_mask")
    return sdpa_mask(**kwargs)


def register() -> None:
    """Register ``attn_implementation="sparktune"`` (attention and mask functions) with
    transformers. Idempotent; importing this module already did it."""
    transformers.AttentionInterface.register(NAME, attention_forward)
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(NAME, mask_function)


register()

"""End-to-end benchmark: Hugging Face transformers models with ``attn_implementation=
"sparktune"`` against transformers' own ``"sdpa"``.

::

    python -m sparktune.benchmark.models                     # every GPU preset, 2k/8k/16k, train and prefill
    python -m sparktune.benchmark.models --preset llama --seqlen 8192 --mode train --target 1.0
    python -m sparktune.benchmark.models --json > models.json
    python -m sparktune.benchmark.models --device cpu --preset tiny --seqlen 32   # wiring only

Models are built from a config (random weights, nothing downloaded): see :data:`PRESETS`.
Each case (model, mode, sequence length) builds one model and one batch of token ids; the two
implementations run the same weights on the same inputs, switched with
``model.set_attn_implementation``, in alternating rounds (sparktune first in even rounds,
SDPA first in odd ones), each round a few timed steps of each after warm-up steps of each.

- ``train``: forward with labels (the causal LM loss), backward, gradients dropped (no
  optimizer step), the model in training mode with dropout off, no cache.
- ``prefill``: a forward under ``torch.inference_mode`` that fills a cache and keeps the last
  position's logits (``logits_to_keep=1``), as generation's first step does.
- ``decode`` (not in the default modes): greedy generation of ``--new-tokens`` tokens per
  sequence, one forward each, against a static cache (``transformers.StaticCache``) that SDPA
  filled once with the sequence length's prompt; every step starts from that prompt, so both
  implementations decode the same tokens from the same cache (the positions after the prompt
  are written again by each step). Tokens per second count the generated tokens; the
  difference is the largest one between the two implementations' generated token ids (0 when
  they are the same).

Reported per implementation: tokens per second (batch x sequence length over the median step
time; CUDA events around each step), the peak memory allocated during its timed steps, and
the attention share of the step: every attention call is bracketed with CUDA events (forward:
around the call; backward: by identity autograd nodes on its inputs and its output, whose
backward passes record an event), so the share is the GPU time between those events over the
step time. That costs two events per call and direction; ``--no-attention-timing`` leaves the
attention functions unwrapped. The timer also counts its spans (``attention_spans``: forward,
backward, unpaired marks); a share marked ``?`` in the table comes from spans that do not pair
up (a training step with fewer backward spans than forward ones, or an end without its start),
so it misses some backward time. Per case, also: the ratio of sparktune's tokens per second to
SDPA's, the selections sparktune's dispatch made in the sparktune steps by source (``tuned``,
``nearest``, ``default``; :func:`sparktune.dispatch.counters`), the kernels dispatch names
for the case's forward and backward problems (:func:`sparktune.explain`), the integration's
own counts (calls run on sparktune and fallbacks by reason), and how far the two
implementations' first results are apart (the loss for ``train``, the last logits for
``prefill``).

``--target RATIO`` exits with status 1 when a case's ratio is below it. ``--control`` makes
an A/A run: the sparktune side runs transformers' own ``sdpa`` function too, so the ratio it
reports is the benchmark's noise on this machine (cases short enough to be bound by the host
move by several percent). Timing runs need a
CUDA GPU; ``--device cpu`` runs the same code on the CPU (sparktune's reference backend), to
check the wiring, not to measure.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..dtypes import TORCH_DTYPES

__all__ = ["PRESETS", "Preset", "CaseResult", "ImplResult", "main", "run_case"]

#: the two implementations compared, sparktune's first
IMPLEMENTATIONS = ("sparktune", "sdpa")
MODES = ("train", "prefill", "decode")
DEFAULT_MODES = ("train", "prefill")
#: tokens each sequence generates in one decode step of the benchmark (``--new-tokens``)
DEFAULT_NEW_TOKENS = 32
DEFAULT_SEQLENS = (2048, 8192, 16384)


@dataclass(frozen=True)
class Preset:
    """A model shape, built from a transformers config."""

    name: str
    #: "llama" (LlamaForCausalLM: RMSNorm, rotary, SwiGLU, grouped-query attention) or
    #: "gpt2" (GPT2LMHeadModel: learned positions, GELU MLP, multi-head attention)
    family: str
    hidden: int
    heads: int
    heads_kv: int
    layers: int
    intermediate: int
    vocab: int
    #: only with --device cpu or when named
    small: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> str:
        return (
            f"{self.family}: hidden {self.hidden}, {self.heads} query / {self.heads_kv} key-value "
            f"heads of dim {self.head_dim}, {self.layers} layers, MLP {self.intermediate}, "
            f"vocab {self.vocab}"
        )

    def config(self, max_positions: int) -> Any:
        """The transformers config (dropout off everywhere)."""
        import transformers

        if self.family == "llama":
            return transformers.LlamaConfig(
                hidden_size=self.hidden,
                num_attention_heads=self.heads,
                num_key_value_heads=self.heads_kv,
                head_dim=self.head_dim,
                num_hidden_layers=self.layers,
                intermediate_size=self.intermediate,
                vocab_size=self.vocab,
                max_position_embeddings=max_positions,
                attention_dropout=0.0,
                bos_token_id=1,
                eos_token_id=2,
                tie_word_embeddings=False,
            )
        if self.family == "gpt2":
            if self.heads_kv != self.heads:
                raise ValueError("the gpt2 family has multi-head attention only")
            return transformers.GPT2Config(
                n_embd=self.hidden,
                n_head=self.heads,
                n_layer=self.layers,
                n_inner=self.intermediate,
                vocab_size=self.vocab,
                n_positions=max_positions,
                attn_pdrop=0.0,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                bos_token_id=1,
                eos_token_id=2,
            )
        raise ValueError(f"unknown model family {self.family!r}")


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # Llama-style decoder, head dim 128, grouped-query attention 4:1
        Preset("llama", "llama", 2048, 16, 4, 8, 5632, 32000),
        # the same with head dim 64 (32 query / 8 key-value heads)
        Preset("llama-hd64", "llama", 2048, 32, 8, 8, 5632, 32000),
        # head dim 128 with grouped-query attention 8:1
        Preset("llama-gqa8", "llama", 2048, 16, 2, 8, 5632, 32000),
        # GPT-2 small: head dim 64, multi-head attention
        Preset("gpt2", "gpt2", 768, 12, 12, 12, 3072, 50257),
        # a few thousand parameters, for --device cpu
        Preset("tiny", "llama", 64, 4, 2, 2, 128, 128, small=True),
    )
}
DEFAULT_PRESETS = ("llama", "llama-hd64", "gpt2")


# ---------------------------------------------------------------------------- timing marks


class _Clock:
    """Marks on the device's timeline: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (after a synchronisation, on a GPU)."""
        if self.cuda:
            return float(start.elapsed_time(end))
        return (end - start) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class _BackwardStarts(torch.autograd.Function):
    """Identity on an attention output; its backward marks where that attention's backward
    begins."""

    @staticmethod
    def forward(ctx: Any, timer: _AttentionTimer, out: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.timer = timer
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        ctx.timer.open.append(ctx.timer.clock.mark())
        return None, grad


class _BackwardEnds(torch.autograd.Function):
    """Identity on an attention call's q, k and v; its backward marks where that attention's
    backward ends."""

    @staticmethod
    def forward(
        ctx: Any, timer: _AttentionTimer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.timer = timer
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        timer = ctx.timer
        if timer.open:
            timer.spans.append((timer.open.pop(), timer.clock.mark()))
        else:  # an end without its start: the share misses that backward
            timer.unpaired += 1
        return None, dq, dk, dv


class _AttentionTimer:
    """Brackets every attention call (forward and backward) with marks while enabled."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.enabled = False
        #: (start, end) marks of attention work since the last reset
        self.spans: list[tuple[Any, Any]] = []
        #: backward starts waiting for their end
        self.open: list[Any] = []
        #: forward spans recorded since the last reset (the rest of ``spans`` are backward
        #: ones), and backward marks that found no partner (an end without a start); with the
        #: starts still open at the end of a step, they say whether the share can be trusted (a
        #: training step has as many backward spans as forward ones, and nothing unpaired)
        self.forward_spans = 0
        self.unpaired = 0

    def reset(self) -> None:
        self.spans.clear()
        self.open.clear()
        self.forward_spans = self.unpaired = 0

    def counts(self) -> tuple[int, int, int]:
        """(forward spans, backward spans, unpaired marks: ends without a start and starts
        still open) since the last reset."""
        backward = len(self.spans) - self.forward_spans
        return self.forward_spans, backward, self.unpaired + len(self.open)

    def total_ms(self) -> float:
        return sum(self.clock.ms(a, b) for a, b in self.spans)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(module, query, key, value, *args, **kwargs)
            grad = torch.is_grad_enabled() and (
                query.requires_grad or key.requires_grad or value.requires_grad
            )
            if grad:
                query, key, value = _BackwardEnds.apply(self, query, key, value)
            start = self.clock.mark()
            out, weights = fn(module, query, key, value, *args, **kwargs)
            self.spans.append((start, self.clock.mark()))
            self.forward_spans += 1
            if grad:
                out = _BackwardStarts.apply(self, out)
            return out, weights

        return timed


@contextmanager
def _timed_attention(timer: _AttentionTimer | None) -> Iterator[None]:
    """transformers' attention functions of both implementations wrapped by ``timer`` (a
    local override of its global AttentionInterface, removed on exit)."""
    if timer is None:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    interface = ALL_ATTENTION_FUNCTIONS
    saved = {name: interface._local_mapping.get(name) for name in IMPLEMENTATIONS}
    for name in IMPLEMENTATIONS:
        interface[name] = timer.wrap(interface[name])
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                del interface[name]
            else:
                interface[name] = old


# --------------------------------------------------------------------------------- results


@dataclass
class ImplResult:
    """One implementation on one case."""

    implementation: str
    #: median step time, milliseconds
    step_ms: float
    step_ms_all: list[float]
    tokens_per_s: float
    #: peak memory allocated during the timed steps, GiB (None on the CPU)
    peak_gib: float | None
    #: attention time per step, milliseconds, and its share of the step (None: not timed)
    attention_ms: float | None
    attention_share: float | None
    #: the attention timer's spans over the timed steps: forward spans, backward spans, and
    #: unpaired backward marks (None: not timed); a training run whose backward spans differ
    #: from its forward ones, or with unpaired marks, has a share that misses some backward
    #: time (the table marks it with "?")
    attention_spans: tuple[int, int, int] | None = None


@dataclass
class CaseResult:
    """One model, mode and sequence length: both implementations."""

    preset: str
    model: str
    mode: str
    seqlen: int
    batch: int
    dtype: str
    results: dict[str, ImplResult]
    #: sparktune's tokens per second over SDPA's
    ratio: float
    #: selections by source made by sparktune's dispatch during the sparktune steps
    dispatch: dict[str, int]
    #: the integration's counts during the sparktune steps ("sparktune" and fallbacks)
    integration: dict[str, int]
    #: "fwd"/"bwd" -> the kernel dispatch names for the case's problem, and why
    kernels: dict[str, str] = field(default_factory=dict)
    #: largest difference of the two implementations' first results (loss or last logits)
    difference: float = math.nan

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["results"] = {k: asdict(v) for k, v in self.results.items()}
        return doc


# ------------------------------------------------------------------------------- the runs


def _build(preset: Preset, max_positions: int, dtype: torch.dtype, device: torch.device) -> Any:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        preset.config(max_positions), attn_implementation="sdpa", dtype=dtype
    )
    return model.to(device)


def _rewind(cache: Any, tokens: int) -> None:
    """Make a static cache forget its last ``tokens`` positions (newer transformers count the
    filled positions per layer, ``cumulative_length``, and write there whatever
    ``cache_position`` says; older ones write at ``cache_position``, with nothing to rewind).
    The layers' counters are moved back directly where they exist (transformers 5.17 counts
    them but its cache is not ``is_croppable``: without this a second step wrote past the
    cache's end), else the cache is cropped where it can be."""
    layers = [layer for layer in getattr(cache, "layers", None) or ()
              if hasattr(layer, "cumulative_length")]
    if layers:
        for layer in layers:
            n = layer.cumulative_length
            if isinstance(n, torch.Tensor):
                n.sub_(tokens)  # in place: a static address under CUDA graphs
            else:
                layer.cumulative_length = n - tokens
    elif getattr(cache, "is_croppable", False):
        cache.crop(-tokens)


def _decode_step(model: Any, ids: torch.Tensor, new_tokens: int) -> Callable[[], torch.Tensor]:
    """The ``decode`` mode's step: ``new_tokens`` greedy steps against a static cache that the
    model's current implementation prefills here once with ``ids``."""
    import transformers

    model.eval()
    batch, prompt = ids.shape
    cache = transformers.StaticCache(config=model.config, max_cache_len=prompt + new_tokens)
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(prompt, device=ids.device))
        first = out.logits[:, -1].argmax(-1, keepdim=True)

    def decode() -> torch.Tensor:
        with torch.inference_mode():
            token, tokens = first, []
            for i in range(new_tokens):  # a new position tensor each time, as generate makes
                pos = torch.tensor([prompt + i], device=ids.device)
                out = model(input_ids=token, past_key_values=cache, use_cache=True,
                            cache_position=pos)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(token)
            _rewind(cache, new_tokens)
            return torch.cat(tokens, dim=1)

    return decode


def _step_fn(model: Any, mode: str, ids: torch.Tensor, new_tokens: int = DEFAULT_NEW_TOKENS
             ) -> Callable[[], torch.Tensor]:
    """One step of ``mode``; returns what the implementations are compared on (detached)."""
    if mode == "decode":
        return _decode_step(model, ids, new_tokens)
    if mode == "train":
        model.train()

        def train() -> torch.Tensor:
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            model.zero_grad(set_to_none=True)
            return out.loss.detach()

        return train
    model.eval()
    extra = (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(model.forward).parameters
        else {}
    )

    def prefill() -> torch.Tensor:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, **extra)
            return out.logits[:, -1]

    return prefill


def _kernels(preset: Preset, seqlen: int, batch: int, dtype: str, mode: str) -> dict[str, str]:
    """What dispatch chooses for the case's attention problems, and why (GPU only)."""
    if not torch.cuda.is_available() or mode == "decode":
        return {}
    from sparktune import dispatch
    from sparktune.problem import Problem

    found = {}
    for op in ("fwd", "bwd") if mode == "train" else ("fwd",):
        problem = Problem(
            op=op,
            dtype=dtype,
            batch=batch,
            heads_q=preset.heads,
            heads_kv=preset.heads_kv,
            seqlen_q=seqlen,
            seqlen_k=seqlen,
            head_dim=preset.head_dim,
            causal=True,
        )
        try:
            sel = dispatch.explain(problem).selection
            found[op] = f"{sel.candidate.label} ({sel.source})" if sel else "none"
        except Exception as exc:  # noqa: BLE001 - a report, not a failure
            found[op] = f"? ({type(exc).__name__}: {exc})"
    return found


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def run_case(
    model: Any,
    preset: Preset,
    mode: str,
    seqlen: int,
    *,
    batch: int,
    dtype_name: str,
    rounds: int,
    steps: int,
    warmup: int,
    timer: _AttentionTimer | None,
    clock: _Clock,
    new_tokens: int = DEFAULT_NEW_TOKENS,
) -> CaseResult:
    """Both implementations on one case, in alternating rounds."""
    from sparktune import dispatch
    from sparktune.integrations import transformers as hf

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seqlen)
    ids = torch.randint(3, preset.vocab, (batch, seqlen), generator=gen).to(device)
    if mode == "decode":  # one prefilled cache for both implementations, filled by SDPA
        model.set_attn_implementation("sdpa")
    step = _step_fn(model, mode, ids, new_tokens)
    step_tokens = batch * (new_tokens if mode == "decode" else seqlen)
    times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    attention: dict[str, float] = dict.fromkeys(IMPLEMENTATIONS, 0.0)
    spans: dict[str, list[int]] = {name: [0, 0, 0] for name in IMPLEMENTATIONS}
    peaks: dict[str, float] = dict.fromkeys(IMPLEMENTATIONS, 0.0)
    first: dict[str, torch.Tensor] = {}
    dispatch_counts: dict[str, int] = {}
    integration_counts: dict[str, int] = {}
    for name in IMPLEMENTATIONS:
        model.set_attn_implementation(name)
        for i in range(warmup):
            result = step()
            if i == 0:
                first[name] = result.float().cpu()
    clock.sync()
    for r in range(rounds):
        order = IMPLEMENTATIONS if r % 2 == 0 else IMPLEMENTATIONS[::-1]
        for name in order:
            model.set_attn_implementation(name)
            if clock.cuda:
                torch.cuda.reset_peak_memory_stats()
            d0, h0 = dispatch.counters(), hf.counters()
            if timer is not None:
                timer.reset()
                timer.enabled = True
            marks = []
            for _ in range(steps):
                start = clock.mark()
                step()
                marks.append((start, clock.mark()))
            clock.sync()
            if timer is not None:
                timer.enabled = False
                attention[name] += timer.total_ms()
                spans[name] = [a + b for a, b in zip(spans[name], timer.counts(), strict=True)]
            if name == "sparktune":
                for k, v in _delta(dispatch.counters(), d0).items():
                    dispatch_counts[k] = dispatch_counts.get(k, 0) + v
                for k, v in _delta(hf.counters(), h0).items():
                    integration_counts[k] = integration_counts.get(k, 0) + v
            times[name].extend(clock.ms(a, b) for a, b in marks)
            if clock.cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() / 2**30)
    results = {}
    for name in IMPLEMENTATIONS:
        median = statistics.median(times[name])
        total = sum(times[name])
        attn = attention[name] / (rounds * steps) if timer is not None else None
        results[name] = ImplResult(
            implementation=name,
            step_ms=median,
            step_ms_all=times[name],
            tokens_per_s=step_tokens / (median / 1e3),
            peak_gib=peaks[name] if clock.cuda else None,
            attention_ms=attn,
            attention_share=attention[name] / total if timer is not None and total else None,
            attention_spans=tuple(spans[name]) if timer is not None else None,
        )
    return CaseResult(
        preset=preset.name,
        model=preset.describe(),
        mode=mode,
        seqlen=seqlen,
        batch=batch,
        dtype=dtype_name,
        results=results,
        ratio=results["sparktune"].tokens_per_s / results["sdpa"].tokens_per_s,
        dispatch=dispatch_counts,
        integration=integration_counts,
        kernels=_kernels(preset, seqlen, batch, dtype_name, mode),
        difference=float((first["sparktune"] - first["sdpa"]).abs().max()),
    )


# -------------------------------------------------------------------------------- reports


def _counts_text(counts: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "-"


def _doubt(mode: str, result: ImplResult) -> str:
    """"?" where the attention timer's spans do not pair up (:attr:`ImplResult.attention_spans`):
    the share misses some backward time."""
    if result.attention_spans is None:
        return ""
    fwd, bwd, unpaired = result.attention_spans
    return "?" if unpaired or (mode == "train" and bwd != fwd) else ""


def render(cases: Sequence[CaseResult]) -> str:
    """The table of results, one line per case, and the geometric mean of the ratios."""
    head = (
        f"{'model':<11} {'mode':<7} {'seqlen':>6} {'sparktune tok/s':>15} {'sdpa tok/s':>11} "
        f"{'ratio':>6} {'peak GiB st/sdpa':>16} {'attn share st/sdpa':>18}  dispatch | integration"
    )
    lines = [head, "-" * len(head)]
    for c in cases:
        st, sd = c.results["sparktune"], c.results["sdpa"]
        peak = (
            f"{st.peak_gib:.2f}/{sd.peak_gib:.2f}"
            if st.peak_gib is not None and sd.peak_gib is not None
            else "-"
        )
        share = (
            f"{st.attention_share:.0%}{_doubt(c.mode, st)}/{sd.attention_share:.0%}{_doubt(c.mode, sd)}"
            if st.attention_share is not None and sd.attention_share is not None
            else "-"
        )
        lines.append(
            f"{c.preset:<11} {c.mode:<7} {c.seqlen:>6} {st.tokens_per_s:>15,.0f} "
            f"{sd.tokens_per_s:>11,.0f} {c.ratio:>5.3f}x {peak:>16} {share:>18}  "
            f"{_counts_text(c.dispatch)} | {_counts_text(c.integration)}"
        )
    if cases:
        geo = math.exp(sum(math.log(c.ratio) for c in cases) / len(cases))
        worst = min(cases, key=lambda c: c.ratio)
        lines.append(
            f"geomean ratio {geo:.3f}x over {len(cases)} cases; lowest {worst.ratio:.3f}x "
            f"({worst.preset} {worst.mode} {worst.seqlen})"
        )
    kernels = [
        f"  {c.preset} {c.mode} {c.seqlen}: "
        + ", ".join(f"{op} {text}" for op, text in c.kernels.items())
        for c in cases
        if c.kernels
    ]
    if kernels:
        lines.append("kernels dispatch names for each case's attention problem:")
        lines.extend(kernels)
    return "\n".join(lines)


def _environment(device: torch.device) -> dict[str, Any]:
    import transformers

    import sparktune

    env: dict[str, Any] = {
        "sparktune": sparktune.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["arch"] = f"sm_{props.major}{props.minor}"
        env["cuda"] = torch.version.cuda
    return env


# ------------------------------------------------------------------------------------ main


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(f"{p.name} ({p.describe()})" for p in PRESETS.values())
    p = argparse.ArgumentParser(
        prog="python -m sparktune.benchmark.models",
        description=(
            "Training step and prefill of Hugging Face transformers models built from a config "
            "(no downloads), attention on sparktune (attn_implementation='sparktune') against "
            "transformers' sdpa, same weights and inputs, alternating rounds."
        ),
        epilog=f"presets: {names}",
    )
    p.add_argument(
        "--preset",
        nargs="+",
        default=list(DEFAULT_PRESETS),
        choices=sorted(PRESETS),
        metavar="NAME",
        help=f"models (default: {' '.join(DEFAULT_PRESETS)})",
    )
    p.add_argument(
        "--seqlen",
        nargs="+",
        type=int,
        default=list(DEFAULT_SEQLENS),
        metavar="N",
        help="sequence lengths (default: 2048 8192 16384)",
    )
    p.add_argument(
        "--mode",
        nargs="+",
        default=list(DEFAULT_MODES),
        choices=MODES,
        help="train: forward, loss, backward; prefill: inference forward filling a cache; "
             "decode: greedy generation against a static cache of the sequence length "
             "(default: train prefill)",
    )
    p.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                   help=f"tokens generated per sequence in a decode step (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TORCH_DTYPES))
    p.add_argument("--layers", type=int, default=None, help="override the presets' layer count")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="timed steps of each implementation per round (default 3)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps of each implementation first (default 2)",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="an A/A run: the sparktune side runs transformers' own sdpa function too, so "
             "its ratio shows how far the benchmark moves with no difference to measure",
    )
    p.add_argument(
        "--no-attention-timing",
        action="store_true",
        help="do not wrap the attention functions to time them (no attention share)",
    )
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda (default; timing runs need a GPU) or cpu (a wiring check)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (environment, settings, cases) instead of the table",
    )
    p.add_argument(
        "--target",
        type=float,
        default=None,
        metavar="RATIO",
        help="exit with status 1 when a case's sparktune/sdpa ratio is below RATIO",
    )
    return p  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "sparktune.benchmark.models: the timing runs need a CUDA GPU and "
            "torch.cuda.is_available() is False here; '--device cpu --preset tiny --seqlen 32' "
            "checks the wiring on the CPU",
            file=sys.stderr,
        )
        return 2
    if min(args.rounds, args.steps, args.warmup, args.batch, args.new_tokens) < 1 or min(args.seqlen) < 1:
        print("sparktune.benchmark.models: --rounds, --steps, --warmup, --batch, --new-tokens and "
              "--seqlen must be at least 1", file=sys.stderr)  # fmt: skip
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "sparktune.benchmark.models needs Hugging Face transformers: "
            "pip install 'sparktune[transformers]'",
            file=sys.stderr,
        )
        return 2
    from sparktune.integrations import transformers as hf

    hf.register()
    if args.control:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        AttentionInterface.register(hf.NAME, sdpa_attention_forward)
        print(
            "# --control: both implementations run transformers' sdpa function (an A/A run)",
            file=sys.stderr,
        )
    try:
        return _main(args, hf)
    finally:
        if args.control:
            hf.register()  # sparktune's attention function again


def _main(args: argparse.Namespace, hf: Any) -> int:
    device = torch.device(args.device)
    dtype = TORCH_DTYPES[args.dtype]
    clock = _Clock(device)
    timer = None if args.no_attention_timing else _AttentionTimer(clock)
    cases: list[CaseResult] = []
    with _timed_attention(timer):
        for name in args.preset:
            preset = PRESETS[name]
            if args.layers is not None:
                preset = Preset(**{**asdict(preset), "layers": args.layers})
            positions = max(args.seqlen) + (args.new_tokens if "decode" in args.mode else 0)
            model = _build(preset, positions, dtype, device)
            for mode in args.mode:
                for seqlen in args.seqlen:
                    print(f"# {name} {mode} {seqlen} ...", file=sys.stderr, flush=True)
                    case = run_case(
                        model,
                        preset,
                        mode,
                        seqlen,
                        batch=args.batch,
                        dtype_name=args.dtype,
                        rounds=args.rounds,
                        steps=args.steps,
                        warmup=args.warmup,
                        timer=timer,
                        clock=clock,
                        new_tokens=args.new_tokens,
                    )
                    cases.append(case)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        doc = {
            "environment": _environment(device),
            "settings": {
                k: getattr(args, k)
                for k in ("preset", "seqlen", "mode", "batch", "dtype", "layers", "rounds",
                          "steps", "warmup", "target", "new_tokens", "control")
            } | {"attention_timing": timer is not None},
            "cases": [c.to_json() for c in cases],
        }  # fmt: skip
        print(json.dumps(doc, indent=2))
    else:
        print(render(cases))
    if args.target is not None:
        below = [c for c in cases if c.ratio < args.target]
        for c in below:
            print(
                f"below target {args.target:g}x: {c.preset} {c.mode} {c.seqlen}: {c.ratio:.3f}x",
                file=sys.stderr,
            )
        if below:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

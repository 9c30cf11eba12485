"""``attn_implementation="sparktune"`` for Hugging Face transformers models
(:mod:`sparktune.integrations.transformers`), on tiny models built from a config (CPU, no
downloads): logits and gradients against transformers' own ``sdpa`` implementation with the
same weights, grouped K/V reaching sparktune without a repeat, the fallbacks and their
counters, switching implementations, a cache, and ``torch.compile``."""

from __future__ import annotations

import copy
import inspect
import logging
import subprocess
import sys
from typing import Any

import pytest
import torch

import sparktune

transformers = pytest.importorskip("transformers")

from sparktune.integrations import transformers as hf  # noqa: E402

# CPU tensors always take sparktune's reference fallback (tests/test_attention_api.py tests
# its warning)
pytestmark = pytest.mark.filterwarnings("ignore:sparktune. attention runs on the fallback")

VOCAB = 96
SEQ = 20
#: the keyword that passes a cache to a model's forward (renamed in transformers 5.24)
CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters
    else "past_key_values"
)


@pytest.fixture(autouse=True)
def _fresh_counters():
    hf.reset_counters()
    hf._checked.clear()
    yield
    hf.reset_counters()


def llama_config(**overrides: Any) -> Any:
    """A tiny Llama: hidden 64, 4 query heads and 2 key/value heads of dim 16, 2 layers."""
    settings: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(overrides)
    return transformers.LlamaConfig(**settings)


def gpt2_config() -> Any:
    """A tiny GPT-2: head dim 64, 2 heads (multi-head attention), 2 layers, no dropout."""
    return transformers.GPT2Config(
        n_embd=128,
        n_head=2,
        n_layer=2,
        vocab_size=VOCAB,
        n_positions=64,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build(config: Any, attn: str, dtype: torch.dtype = torch.float16) -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=dtype
    )


def tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def step(model: Any, ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Logits (float32) and parameter gradients (float32) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.float()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return out.logits.float(), grads


def err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference, relative to the reference's largest magnitude."""
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def assert_like_sdpa(model: Any, ids: torch.Tensor) -> None:
    """sparktune's logits and gradients are as close to a float32 run of the same weights as
    SDPA's own (in the model's dtype) are: the difference is rounding noise."""
    reference = copy.deepcopy(model).float()
    reference.set_attn_implementation("sdpa")
    ref_logits, ref_grads = step(reference, ids)
    model.set_attn_implementation("sdpa")
    sdpa_logits, sdpa_grads = step(model, ids)
    model.set_attn_implementation("sparktune")
    before = hf.counters().get("sparktune", 0)
    logits, grads = step(model, ids)
    assert hf.counters().get("sparktune", 0) - before == model.config.num_hidden_layers
    noise = max(err(sdpa_logits, ref_logits), 2e-3)
    assert err(logits, ref_logits) <= 2 * noise, (err(logits, ref_logits), noise)
    assert grads.keys() == ref_grads.keys() == sdpa_grads.keys()
    for name, ref in ref_grads.items():
        noise = max(err(sdpa_grads[name], ref), 4e-3)
        assert err(grads[name], ref) <= 2 * noise, (name, err(grads[name], ref), noise)


# -- registration ------------------------------------------------------------------------------


def test_registered_with_transformers():
    assert transformers.AttentionInterface._global_mapping["sparktune"] is hf.attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionMaskInterface._global_mapping["sparktune"] is hf.mask_function
    hf.register()  # idempotent
    hf.register()
    assert transformers.AttentionInterface._global_mapping["sparktune"] is hf.attention_forward


def test_importing_sparktune_does_not_import_transformers():
    code = (
        "import sys, sparktune, sparktune.integrations; "
        "sys.exit(1 if 'transformers' in sys.modules else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- results against sdpa -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_llama_gqa_logits_and_gradients_match_sdpa(dtype):
    model = build(llama_config(), "sparktune", dtype)
    assert model.config._attn_implementation == "sparktune"
    assert_like_sdpa(model, tokens())
    assert set(hf.counters()) == {"sparktune"}


def test_gpt2_logits_and_gradients_match_sdpa():
    model = build(gpt2_config(), "sparktune")
    assert_like_sdpa(model, tokens())
    assert set(hf.counters()) == {"sparktune"}


def test_grouped_kv_reaches_sparktune_without_repeat(monkeypatch):
    calls: list[dict[str, Any]] = []
    real = sparktune.attention

    def spy(q, k, v, **kwargs):
        calls.append(dict(q=q.shape, k=k.shape, v=v.shape, **kwargs))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(sparktune, "attention", spy)
    model = build(llama_config(), "sparktune")
    ids = tokens(batch=2, seq=12)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert len(calls) == 2
    for call in calls:
        # (B, H, N, D) as transformers gives them: 4 query heads, 2 key/value heads, not repeated
        assert call["q"] == (2, 4, 12, 16)
        assert call["k"] == call["v"] == (2, 2, 12, 16)
        assert call.get("layout", "bhnd") == "bhnd"
        assert call["causal"] is True
        assert call["scale"] == pytest.approx(16**-0.5)


def test_output_layout_is_sdpa_s():
    model = build(llama_config(), "sparktune")
    attn = model.model.layers[0].self_attn
    q = torch.randn(2, 4, 10, 16, dtype=torch.float16).transpose(1, 2).contiguous().transpose(1, 2)
    k = torch.randn(2, 2, 10, 16, dtype=torch.float16)
    v = torch.randn(2, 2, 10, 16, dtype=torch.float16)
    out, weights = hf.attention_forward(attn, q, k, v, None, scaling=0.25)
    ref, _ = transformers.integrations.sdpa_attention.sdpa_attention_forward(
        attn, q, k, v, None, scaling=0.25
    )
    assert weights is None
    assert out.shape == ref.shape == (2, 10, 4, 16)
    assert out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_more_keys_than_queries_without_mask_is_sdpa_s_reading():
    """An empty static cache's prefill: no mask, more keys than queries; transformers' sdpa
    drops the unwritten keys and runs causal."""
    model = build(llama_config(), "sparktune")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 6, 16, dtype=torch.float16)
    k = torch.randn(1, 2, 16, 16, dtype=torch.float16)
    v = torch.randn(1, 2, 16, 16, dtype=torch.float16)
    sdpa = transformers.integrations.sdpa_attention.sdpa_attention_forward
    for nq in (6, 1):
        out, _ = hf.attention_forward(attn, q[:, :, :nq], k, v, None)
        ref, _ = sdpa(attn, q[:, :, :nq], k, v, None)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert hf.counters() == {"sparktune": 2}


def test_cache_prefill_and_decode_match_sdpa():
    model = build(llama_config(), "sparktune")
    ids = tokens(batch=1, seq=12)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            first = model(input_ids=ids, use_cache=True)
            nxt = first.logits[:, -1:].argmax(-1)
            second = model(input_ids=nxt, **{CACHE_KWARG: first.past_key_values}, use_cache=True)
        return first.logits.float(), second.logits.float()

    prefill, decode = run()
    assert hf.counters() == {"sparktune": 4}
    model.set_attn_implementation("sdpa")
    ref_prefill, ref_decode = run()
    assert err(prefill, ref_prefill) < 1e-2
    assert err(decode, ref_decode) < 1e-2


def test_from_pretrained_and_set_attn_implementation(tmp_path):
    build(llama_config(), "sdpa").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="sparktune", dtype=torch.float16
    )
    assert model.config._attn_implementation == "sparktune"
    ids = tokens()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
        assert hf.counters() == {"sparktune": 2}
        model.set_attn_implementation("sdpa")
        model(input_ids=ids, use_cache=False)
        assert hf.counters() == {"sparktune": 2}
        model.set_attn_implementation("sparktune")
        model(input_ids=ids, use_cache=False)
    assert hf.counters() == {"sparktune": 4}


# -- fallbacks ------------------------------------------------------------------------------------


def test_padding_mask_falls_back_counted_and_logged_once(caplog):
    model = build(llama_config(), "sparktune")
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    caplog.set_level(logging.WARNING, logger=hf.__name__)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        model(input_ids=ids, attention_mask=mask, use_cache=False)
        assert hf.counters() == {"mask": 4}
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(out, ref)  # the very same function ran
    lines = [r for r in caplog.records if r.name == hf.__name__]
    assert len(lines) == 1 and "sdpa" in lines[0].getMessage()
    assert "padding" in lines[0].getMessage()


def test_all_ones_padding_mask_runs_on_sparktune():
    model = build(llama_config(), "sparktune")
    ids = tokens()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert hf.counters() == {"sparktune": 2}


def test_materialised_causal_mask_runs_on_sparktune_and_is_compared_once(monkeypatch):
    model = build(llama_config(), "sparktune")
    attn = model.model.layers[0].self_attn
    q = torch.randn(2, 4, 10, 16, dtype=torch.float16)
    k = torch.randn(2, 2, 10, 16, dtype=torch.float16)
    v = torch.randn(2, 2, 10, 16, dtype=torch.float16)
    causal = torch.ones(10, 10, dtype=torch.bool).tril().expand(2, 1, 10, 10)
    compared: list[int] = []
    real = hf._equals_causal
    monkeypatch.setattr(hf, "_equals_causal", lambda m: compared.append(1) or real(m))
    sdpa = transformers.integrations.sdpa_attention.sdpa_attention_forward
    ref, _ = sdpa(attn, q, k, v, None)
    for _ in range(3):
        out, _ = hf.attention_forward(attn, q, k, v, causal)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert hf.counters() == {"sparktune": 3}
    assert len(compared) == 1  # one comparison for this mask tensor
    other = causal.clone()
    other[1, 0, 9, 0] = False
    out, _ = hf.attention_forward(attn, q, k, v, other)
    ref, _ = sdpa(attn, q, k, v, other)
    assert torch.equal(out, ref)
    assert hf.counters() == {"sparktune": 3, "mask": 1}
    causal_copy = causal.clone()
    causal_copy[0, 0, 0, 1] = True  # an in-place change is seen (the tensor's version)
    hf.attention_forward(attn, q, k, v, causal_copy)
    assert hf.counters()["mask"] == 2


def test_dropout_in_training_falls_back():
    model = build(llama_config(attention_dropout=0.1), "sparktune")
    ids = tokens()
    model.train()
    step(model, ids)
    assert hf.counters() == {"dropout": 2}
    model.eval()  # no dropout in evaluation: sparktune
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert hf.counters() == {"dropout": 2, "sparktune": 2}


def test_float32_falls_back():
    model = build(llama_config(), "sparktune", torch.float32)
    with torch.no_grad():
        model(input_ids=tokens(), use_cache=False)
    assert hf.counters() == {"dtype": 2}


def test_unsupported_arguments_fall_back():
    model = build(llama_config(), "sparktune")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16, dtype=torch.float16)
    k = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    hf.attention_forward(attn, q, k, k, None, output_attentions=True)
    hf.attention_forward(attn, q, k, k[..., :8].contiguous(), None)  # v head dim differs
    hf.attention_forward(attn, q, k.transpose(2, 3).contiguous().transpose(2, 3), k, None)
    bias = torch.zeros(1, 4, 8, 8, dtype=torch.float16)
    hf.attention_forward(attn, q, k, k, None, position_bias=bias)
    assert hf.counters() == {
        "output_attentions": 1,
        "shape": 1,
        "layout": 1,
        "position_bias": 1,
    }
    assert set(hf.counters()) <= set(hf.FALLBACK_REASONS)


# -- torch.compile ----------------------------------------------------------------------------------


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiled_with_a_cache_reaches_sparktune_in_one_graph():
    """While tracing, transformers' mask function may build the causal mask; ours skips it
    by transformers' own eager rules, so a fullgraph model reaches sparktune."""
    model = build(llama_config(), "sparktune")
    ids = tokens(batch=1, seq=12)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=True).logits
        hf.reset_counters()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        out = compiled(input_ids=ids, use_cache=True).logits
    assert hf.counters() == {"sparktune": 2}
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiled_training_compares_the_mask_or_falls_back():
    """Training without a cache: transformers builds a packed-sequence mask while tracing.
    Where graph breaks are allowed it is compared with the causal mask on the device (and
    sparktune runs); under fullgraph it cannot be, and SDPA runs on it."""
    model = build(llama_config(), "sparktune")
    ids = tokens()
    ref_logits, ref_grads = step(model, ids)
    hf.reset_counters()
    logits, grads = step(torch.compile(model, backend="aot_eager"), ids)
    counts = hf.counters()
    assert counts.get("sparktune", 0) >= 1 and set(counts) == {"sparktune"}
    torch.testing.assert_close(logits, ref_logits, atol=1e-2, rtol=1e-2)
    for name, ref in ref_grads.items():
        assert err(grads[name], ref) < 2e-2, name

    torch._dynamo.reset()
    hf.reset_counters()
    logits, _ = step(torch.compile(model, backend="aot_eager", fullgraph=True), ids)
    assert set(hf.counters()) == {"mask_unchecked"}
    torch.testing.assert_close(logits, ref_logits, atol=1e-2, rtol=1e-2)


# -- features: soft-capping and sliding windows ----------------------------------------------------


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def test_gemma2_softcap_and_sliding_window_run_on_sparktune():
    config = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256,
        attn_logit_softcapping=2.0, sliding_window=5, query_pre_attn_scalar=16,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = build(config, "sparktune")
    ids = tokens()
    reference = copy.deepcopy(model).float()
    reference.set_attn_implementation("eager")  # transformers' own softcap and window
    want = _logits(reference, ids)
    got = _logits(model, ids)
    assert hf.counters() == {"sparktune": 2}, hf.counters()
    model.set_attn_implementation("eager")
    eager16 = _logits(model, ids)
    noise = max(err(eager16, want), 2e-3)
    assert err(got, want) <= 2 * noise, (err(got, want), noise)


def test_mistral_sliding_window_that_bites_runs_on_sparktune():
    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256, sliding_window=4,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = build(config, "sparktune")
    ids = tokens()
    reference = copy.deepcopy(model).float()
    reference.set_attn_implementation("sdpa")
    want = _logits(reference, ids)
    got = _logits(model, ids)
    assert hf.counters() == {"sparktune": 2}, hf.counters()
    model.set_attn_implementation("sdpa")
    sdpa16 = _logits(model, ids)
    noise = max(err(sdpa16, want), 2e-3)
    assert err(got, want) <= 2 * noise, (err(got, want), noise)


def test_window_mask_that_is_not_the_layers_window_falls_back():
    model = build(llama_config(), "sparktune")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16, dtype=torch.float16)
    k = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    i = torch.arange(8)
    mask = ((i[:, None] >= i[None, :]) & (i[None, :] > i[:, None] - 3))[None, None]
    hf.attention_forward(attn, q, k, k, mask, sliding_window=4)  # the mask is a window of 3
    assert hf.counters() == {"mask": 1}
    hf.attention_forward(attn, q, k, k, mask, sliding_window=3)
    assert hf.counters() == {"mask": 1, "sparktune": 1}


def test_softcap_runs_on_sparktune_and_a_window_without_a_fast_backend_falls_back(monkeypatch):
    model = build(llama_config(), "sparktune")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16, dtype=torch.float16)
    k = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    monkeypatch.setattr(hf, "_runs_fast", lambda *a: False)
    out, _ = hf.attention_forward(attn, q, k, k, None, softcap=2.0)  # sdpa would refuse it
    want = sparktune.attention(q, k, k, causal=True, softcap=2.0, backend="reference")
    torch.testing.assert_close(out, want.transpose(1, 2), atol=2e-3, rtol=0)
    i = torch.arange(8)
    mask = ((i[:, None] >= i[None, :]) & (i[None, :] > i[:, None] - 3))[None, None]
    hf.attention_forward(attn, q, k, k, mask, sliding_window=3)
    assert hf.counters() == {"sparktune": 1, "mask": 1}


# -- decode steps against a static cache -------------------------------------------------------


def _generate(model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False,
                              cache_implementation="static", **kwargs)


def test_static_cache_decode_steps_run_attention_with_kvcache_and_match_sdpa(monkeypatch):
    model = build(llama_config(), "sparktune")
    ids = tokens(batch=2, seq=7)
    calls = []
    real = sparktune.attention_with_kvcache

    def spy(q, k_cache, v_cache, *args, **kwargs):
        calls.append((tuple(q.shape), tuple(k_cache.shape), kwargs["cache_seqlens"].tolist()))
        return real(q, k_cache, v_cache, *args, **kwargs)

    monkeypatch.setattr(sparktune, "attention_with_kvcache", spy)
    hf._decode_checked.clear()
    ours = _generate(model, ids)
    layers = model.config.num_hidden_layers
    # 6 new tokens: the prefill makes the first, five decode steps the rest
    assert hf.counters()["sparktune_decode"] == 5 * layers
    assert len(calls) == 5 * layers
    # (B, Nq, Hq, D) queries; the static cache seen as (B, N_max, Hkv, D)
    assert calls[0][0] == (2, 1, 4, 16) and calls[0][1][0] == 2 and calls[0][1][2:] == (2, 16)
    assert [c[2] for c in calls[::layers]] == [[n, n] for n in range(8, 13)]
    model.set_attn_implementation("sdpa")
    assert torch.equal(ours, _generate(model, ids))


def test_left_padded_decode_steps_fall_back_and_match_sdpa():
    model = build(llama_config(), "sparktune")
    ids = tokens(batch=2, seq=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # sequence 0 is left-padded: its visible keys are not a prefix
    hf._decode_checked.clear()
    ours = _generate(model, ids, attention_mask=mask)
    assert hf.counters().get("sparktune_decode", 0) == 0
    assert hf.counters().get("mask", 0) > 0
    model.set_attn_implementation("sdpa")
    assert torch.equal(ours, _generate(model, ids, attention_mask=mask))


def test_inference_mode_decode_compares_the_mask_once_per_step(monkeypatch):
    """Under torch.inference_mode masks have no version counter: the decode mask that the
    model hands to its layers is compared once per step (at its first layer), not once per
    layer; the tokens stay SDPA's."""
    model = build(llama_config(), "sparktune")
    ids = tokens(batch=2, seq=7)
    compared = []
    real = hf._decode_compare
    monkeypatch.setattr(hf, "_decode_compare", lambda *a: compared.append(1) or real(*a))
    hf._decode_checked.clear()
    with torch.inference_mode():
        ours = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert hf.counters()["sparktune_decode"] == 5 * model.config.num_hidden_layers
    assert 1 <= len(compared) <= 5, len(compared)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        assert torch.equal(ours, model.generate(ids, max_new_tokens=6, do_sample=False,
                                                cache_implementation="static"))


def test_inference_masks_are_compared_once_per_forward(monkeypatch):
    """An inference-mode mask (no version counter) is compared at every call without a layer
    index; with one, at the first layer of a forward and reused by the later layers, and
    compared again when a forward starts over (a smaller index), so that an in-place change
    between forwards is seen."""
    compared = []
    real = hf._decode_compare
    monkeypatch.setattr(hf, "_decode_compare", lambda *a: compared.append(1) or real(*a))
    hf._decode_checked.clear()
    with torch.inference_mode():
        mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
        mask[..., :5] = True
        for _ in range(3):
            assert hf._decode_lengths(mask, 1, 8).tolist() == [5, 5]
        assert len(compared) == 3
        for layer in range(4):  # one forward: compared at layer 0 only
            assert hf._decode_lengths(mask, 1, 8, layer).tolist() == [5, 5]
        assert len(compared) == 4
        mask[1, ..., 4] = False  # changed in place between forwards
        for layer in range(4):
            assert hf._decode_lengths(mask, 1, 8, layer).tolist() == [5, 4]
        assert len(compared) == 5

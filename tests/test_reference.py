"""The reference backend: exact math, GQA, bottom-right causal, empty rows, lse, chunking."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparktune.backends.reference as reference_module
from sparktune.backends.reference import (
    ReferenceBackend,
    reference_attention,
    reference_attention_backward,
    reference_lse,
)
from sparktune.problem import Problem
from tests._oracle import visible_mask

F64 = torch.float64


def rand(*shape: int, dtype: torch.dtype = F64, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def explicit(q, k, v, causal=False, scale=None):
    """Scores, out and lse written out by hand in float64 (empty rows: out 0, lse -inf)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * sc
    mask = visible_mask(q.shape[2], k.shape[2], causal, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v, lse


SHAPES = [  # (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim)
    (1, 1, 1, 1, 1, 1),
    (2, 3, 3, 17, 17, 8),
    (1, 2, 2, 33, 33, 17),
    (3, 1, 1, 1, 33, 16),
    (1, 2, 2, 33, 1, 4),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_math_sdpa(shape, causal):
    b, hq, hkv, nq, nk, d = shape
    if causal and nq != nk:
        pytest.skip("torch's is_causal is top-left; covered by the explicit-mask test")
    q, k, v = rand(b, hq, nq, d), rand(b, hkv, nk, d), rand(b, hkv, nk, d)
    out, lse = reference_attention(q, k, v, causal=causal)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads", [(4, 2), (6, 3), (8, 1)], ids=str)
def test_gqa_matches_repeated_kv(heads):
    hq, hkv = heads
    q, k, v = rand(2, hq, 17, 16), rand(2, hkv, 33, 16), rand(2, hkv, 33, 16)
    out, _ = reference_attention(q, k, v)
    g = hq // hkv
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        )
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # query head h reads kv head h // g: change kv head 0 and only heads 0..g-1 move
    k2 = k.clone()
    k2[:, 0] += 1.0
    out2, _ = reference_attention(q, k2, v)
    moved = (out2 - out).abs().amax(dim=(0, 2, 3)) > 0
    assert moved.tolist() == [h < g for h in range(hq)]


@pytest.mark.parametrize("seqlens", [(17, 33), (33, 17), (1, 17), (17, 1), (33, 33)], ids=str)
def test_causal_is_bottom_right(seqlens):
    nq, nk = seqlens
    q, k, v = rand(2, 2, nq, 8), rand(2, 2, nk, 8), rand(2, 2, nk, 8)
    out, lse = reference_attention(q, k, v, causal=True)
    exp_out, exp_lse = explicit(q, k, v, causal=True)
    torch.testing.assert_close(out, exp_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, exp_lse, rtol=1e-12, atol=1e-12)
    # the last query row always sees every key
    full, _ = reference_attention(q[:, :, -1:], k, v)
    torch.testing.assert_close(out[:, :, -1:], full, rtol=1e-12, atol=1e-12)


def test_rows_without_keys_give_zero_and_minus_inf():
    nq, nk = 33, 17
    q, k, v = (rand(1, 2, n, 8, requires_grad=True) for n in (nq, nk, nk))
    out, lse = reference_attention(q, k, v, causal=True)
    empty = nq - nk
    assert torch.all(out[:, :, :empty] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :empty]))
    assert torch.isfinite(lse[:, :, empty:]).all()
    assert torch.isfinite(out).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :, :empty] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_matches_torch_logsumexp(causal):
    q, k, v = rand(2, 4, 17, 16), rand(2, 2, 33, 16), rand(2, 2, 33, 16)
    scale = 0.37
    _, lse = reference_attention(q, k, v, causal=causal, scale=scale)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * scale
    mask = visible_mask(17, 33, causal, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        reference_lse(q, k, causal=causal, scale=scale), lse.float(), rtol=1e-6, atol=1e-6
    )


def test_any_strides_and_half_inputs():
    # (B, N, H, D) storage seen as (B, H, N, D), and a slice of a packed qkv tensor
    qkv = rand(2, 17, 3, 4, 16, dtype=torch.float16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out, lse = reference_attention(q, k, v, causal=True)
    exp_out, exp_lse = explicit(*(t.double() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out, exp_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, exp_lse, rtol=1e-12, atol=1e-12)


def test_float32_compute_is_close():
    q, k, v = rand(1, 2, 33, 16), rand(1, 2, 33, 16), rand(1, 2, 33, 16)
    out32, lse32 = reference_attention(q, k, v, compute_dtype=torch.float32)
    out64, lse64 = reference_attention(q, k, v)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse32.double(), lse64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [1, 40, 600], ids=lambda b: f"budget{b}")
def test_tiling_does_not_change_results(monkeypatch, budget):
    q, k, v = rand(3, 4, 17, 8), rand(3, 2, 9, 8), rand(3, 2, 9, 8)
    dout = rand(3, 4, 17, 8)
    whole = reference_attention(q, k, v, causal=True)
    grads = reference_attention_backward(dout, q, k, v, causal=True)
    monkeypatch.setattr(reference_module, "MAX_SCORE_ELEMENTS", budget)
    tiled = reference_attention(q, k, v, causal=True)
    tiled_grads = reference_attention_backward(dout, q, k, v, causal=True)
    for a, b in zip((*whole, *grads), (*tiled, *tiled_grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "shape", [(2, 4, 2, 17, 33, 8), (1, 3, 1, 33, 17, 16), (1, 1, 1, 1, 1, 4)], ids=str
)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_autograd(shape, causal):
    b, hq, hkv, nq, nk, d = shape
    q, k, v = (rand(b, h, n, d, requires_grad=True) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    dout = rand(b, hq, nq, d)
    exp_out, _ = explicit(q, k, v, causal=causal, scale=0.5)
    expected = torch.autograd.grad(exp_out, (q, k, v), dout)
    got = reference_attention_backward(dout, q, k, v, causal=causal, scale=0.5)
    through_autograd = torch.autograd.grad(
        reference_attention(q, k, v, causal=causal, scale=0.5)[0], (q, k, v), dout
    )
    for e, g, a in zip(expected, got, through_autograd, strict=True):
        assert g.dtype == F64
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        reference_attention(rand(1, 3, 4, 8), rand(1, 2, 4, 8), rand(1, 2, 4, 8))
    with pytest.raises(ValueError, match="4-d"):
        reference_attention(rand(3, 4, 8), rand(3, 4, 8), rand(3, 4, 8))
    with pytest.raises(ValueError, match="shapes do not match"):
        reference_attention(rand(1, 2, 4, 8), rand(1, 2, 4, 8), rand(1, 2, 5, 8))


class TestBackend:
    problem = Problem("fwd", "float16", 2, 4, 2, 17, 33, 16, True)

    def test_identity(self):
        b = ReferenceBackend()
        assert b.name == "reference" and b.tunable is False
        assert b.unavailable_reasons() == []
        assert list(b.configs()) == ["float32", "float64"]
        assert list(ReferenceBackend(torch.float64).configs()) == ["float64", "float32"]
        assert b.default_config(self.problem) == "float32"
        with pytest.raises(ValueError, match="float32 or float64"):
            ReferenceBackend(torch.float16)

    def test_supports_everything_but_unknown_configs(self):
        b = ReferenceBackend()
        assert b.not_supported_reasons(self.problem) == []
        assert b.not_supported_reasons(self.problem, "float64") == []
        (reason,) = b.not_supported_reasons(self.problem, "int8")
        assert "unknown config 'int8'" in reason

    @pytest.mark.parametrize("config", ["float32", "float64"])
    def test_forward_writes_out_and_returns_lse(self, config):
        q = rand(2, 17, 4, 16, dtype=torch.float16).transpose(1, 2)  # a BNHD view
        k, v = rand(2, 2, 33, 16, dtype=torch.float16), rand(2, 2, 33, 16, dtype=torch.float16)
        out_storage = torch.full((2, 17, 4, 16), float("nan"), dtype=torch.float16)
        out = out_storage.transpose(1, 2)
        lse = ReferenceBackend().forward(q, k, v, out, config=config, causal=True, scale=0.25)
        exp_out, exp_lse = reference_attention(q, k, v, causal=True, scale=0.25)
        torch.testing.assert_close(out, exp_out.half(), rtol=0, atol=1e-3)
        assert lse.dtype == torch.float32 and lse.shape == (2, 4, 17)
        torch.testing.assert_close(lse, exp_lse.float(), rtol=1e-5, atol=1e-5)
        assert (
            ReferenceBackend().forward(
                q, k, v, out, config=config, causal=True, scale=0.25, need_lse=False
            )
            is None
        )

    def test_backward_writes_grads(self):
        q, k, v = rand(1, 4, 17, 8), rand(1, 2, 33, 8), rand(1, 2, 33, 8)
        dout = rand(1, 4, 17, 8)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        ReferenceBackend().backward(
            dout, q, k, v, None, None, dq, dk, dv, config="float64", causal=True, scale=0.3
        )
        expected = reference_attention_backward(dout, q, k, v, causal=True, scale=0.3)
        for g, e in zip((dq, dk, dv), expected, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)

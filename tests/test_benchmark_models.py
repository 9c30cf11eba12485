"""``python -m sparktune.benchmark.models``: the end-to-end model benchmark's wiring, on the CPU
with the tiny preset (the timing runs themselves need a GPU)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sparktune.benchmark import models  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:sparktune. attention runs on the fallback")

TINY = ["--device", "cpu", "--preset", "tiny", "--seqlen", "16", "--warmup", "1", "--steps", "1"]


def test_help_needs_no_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        models.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--target" in out and "llama-hd64" in out and "gpt2" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
def test_timing_runs_need_a_gpu(capsys):
    assert models.main(["--preset", "tiny"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_presets_of_the_issue():
    llama, hd64, gpt2 = (
        models.PRESETS["llama"],
        models.PRESETS["llama-hd64"],
        models.PRESETS["gpt2"],
    )
    assert (llama.hidden, llama.heads, llama.heads_kv, llama.head_dim, llama.layers) == (
        2048, 16, 4, 128, 8,
    )  # fmt: skip
    assert (llama.intermediate, llama.vocab) == (5632, 32000)
    assert hd64.head_dim == 64 and hd64.heads % hd64.heads_kv == 0
    assert gpt2.head_dim == 64 and gpt2.heads == gpt2.heads_kv
    for preset in models.PRESETS.values():
        assert preset.hidden == preset.heads * preset.head_dim
        preset.config(max_positions=64)  # a valid transformers config


def test_cpu_run_reports_both_implementations(capsys):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa_before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert models.main([*TINY, "--rounds", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["environment"]["transformers"] == transformers.__version__
    assert doc["settings"]["attention_timing"] is True
    cases = doc["cases"]
    assert [(c["mode"], c["seqlen"]) for c in cases] == [("train", 16), ("prefill", 16)]
    layers = models.PRESETS["tiny"].layers
    for case in cases:
        assert set(case["results"]) == {"sparktune", "sdpa"}
        for result in case["results"].values():
            assert len(result["step_ms_all"]) == 2  # 2 rounds x 1 step
            assert result["tokens_per_s"] > 0
            assert 0 < result["attention_share"] < 1
            assert result["peak_gib"] is None  # CPU
        st, sd = case["results"]["sparktune"], case["results"]["sdpa"]
        assert case["ratio"] == pytest.approx(st["tokens_per_s"] / sd["tokens_per_s"])
        # every attention call of the sparktune steps ran on sparktune, chosen by dispatch
        assert case["integration"] == {"sparktune": 2 * layers}
        assert sum(case["dispatch"].values()) >= 2 * layers
        assert case["difference"] < 0.1  # same weights, same inputs
    # the timing wrappers are gone
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_before
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping


def test_control_run_puts_sdpa_on_both_sides(capsys):
    """--control (an A/A run): the sparktune side runs transformers' sdpa function, so no call
    reaches sparktune, the results agree exactly, and sparktune's function is registered again
    afterwards."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from sparktune.integrations import transformers as hf

    assert models.main([*TINY, "--mode", "train", "--rounds", "2", "--control", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["control"] is True
    (case,) = doc["cases"]
    assert case["integration"] == {} and sum(case["dispatch"].values()) == 0
    assert case["difference"] == 0.0
    assert ALL_ATTENTION_FUNCTIONS[hf.NAME] is hf.attention_forward


def test_cpu_decode_generates_the_same_tokens_on_the_decode_route(capsys):
    """The decode mode: greedy steps against a static cache prefilled once, the sparktune steps
    through attention_with_kvcache (the integration's decode count), the same tokens as SDPA,
    and tokens per second counting the generated tokens."""
    new = 3
    assert models.main([*TINY, "--mode", "decode", "--new-tokens", str(new), "--rounds", "2",
                        "--json", "--no-attention-timing"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (case,) = doc["cases"]
    assert case["mode"] == "decode" and doc["settings"]["new_tokens"] == new
    layers = models.PRESETS["tiny"].layers
    # the timed sparktune steps: 2 rounds x 1 step x new tokens x layers, all on the decode route
    assert case["integration"] == {"sparktune": 2 * new * layers, "sparktune_decode": 2 * new * layers}
    assert case["difference"] == 0.0  # the same generated token ids
    for result in case["results"].values():
        assert len(result["step_ms_all"]) == 2
        median = statistics.median(result["step_ms_all"])
        assert result["tokens_per_s"] == pytest.approx(1 * new / (median / 1e3))


def test_table_and_target(capsys):
    argv = [*TINY, "--rounds", "1", "--mode", "prefill", "--no-attention-timing"]
    assert models.main([*argv, "--target", "1e9"]) == 1
    captured = capsys.readouterr()
    assert "geomean ratio" in captured.out
    assert "below target" in captured.err and "tiny prefill 16" in captured.err
    assert models.main([*argv, "--target", "0"]) == 0


def test_attention_timer_brackets_forward_and_backward():
    timer = models._AttentionTimer(models._Clock(torch.device("cpu")))

    def attention(module, q, k, v, mask, **kwargs):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v, None

    timed = timer.wrap(attention)
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    timed(None, q, k, v, None)  # disabled: nothing recorded
    assert timer.spans == []
    timer.enabled = True
    out, weights = timed(None, q, k, v, None)
    assert weights is None and len(timer.spans) == 1
    out.sum().backward()
    assert len(timer.spans) == 2 and timer.open == []
    assert q.grad is not None and k.grad is not None and v.grad is not None
    assert timer.total_ms() >= 0


def test_attention_timer_counts_its_spans_and_the_table_marks_unpaired_ones():
    timer = models._AttentionTimer(models._Clock(torch.device("cpu")))

    def attention(module, q, k, v, mask, **kwargs):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v, None

    timed = timer.wrap(attention)
    timer.enabled = True
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    outs = [timed(None, q, k, v, None)[0] for _ in range(3)]
    assert timer.counts() == (3, 0, 0)
    sum(o.sum() for o in outs).backward()
    assert timer.counts() == (3, 3, 0)
    # a backward end without its start (as if a start's mark were lost): counted, not paired
    models._BackwardEnds.apply(timer, q, k, v)[0].sum().backward()
    assert timer.counts() == (3, 3, 1) and len(timer.spans) == 6
    # a start still open at the end of the step counts as unpaired too
    timer.reset()
    out = timed(None, q, k, v, None)[0]
    models._BackwardStarts.apply(timer, out.detach().requires_grad_()).sum().backward()
    assert timer.counts() == (1, 0, 1)

    def result(spans):
        return models.ImplResult("x", 1.0, [1.0], 1.0, None, 0.1, 0.1, spans)

    assert models._doubt("train", result((4, 4, 0))) == ""
    assert models._doubt("train", result((4, 3, 0))) == "?"
    assert models._doubt("train", result((4, 4, 1))) == "?"
    assert models._doubt("prefill", result((4, 0, 0))) == ""
    assert models._doubt("train", result(None)) == ""

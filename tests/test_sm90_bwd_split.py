"""The Hopper backward's group split (sparktune/kernels/sm90_bwd_split.py): which problems it
splits, its variable, and the model it decides with. No GPU needed (the gradients of every
split are checked on the GPU by tests/test_spark_bwd.py)."""

from __future__ import annotations

import pytest

from sparktune.kernels.sm90_bwd_split import group_split, modelled_time, split_from_env

SMS = 132


RULE = {"SPARKTUNE_SM90_BWD_GROUP_SPLIT": "rule"}


def _split(batch, hk, group, n, d=128, causal=True, window=None, sms=SMS, env=None, **kw):
    # the head dim 128 and 64 defaults: 64 query rows x 128 keys a block, 16-bit inputs; the
    # rule's choice (the variable at "rule") unless env says otherwise
    return group_split(batch, hk, group, n, n, 64, 128, d, 2, causal, window, sms,
                       environ=env if env is not None else RULE, **kw)


@pytest.mark.parametrize("batch, hk, group, n, d, causal, expected", [
    # Llama-style 16:4 at batch 1: 4 pairs x 32 key blocks at 4k, under one wave, splits
    (1, 4, 4, 4096, 128, True, 2),
    (1, 4, 4, 2048, 128, True, 4),
    (1, 4, 4, 1024, 128, True, 4),
    # 8k is two waves taken heaviest first (0.99 of the ideal in the model): no split
    (1, 4, 4, 8192, 128, True, 1),
    (1, 4, 4, 16384, 128, True, 1),
    # GQA 32:8 at 4k (256 blocks) and more batches: enough blocks already
    (1, 8, 4, 4096, 128, True, 1),
    (4, 4, 4, 4096, 128, True, 1),
    # equal blocks (not causal) of one wave: a split only adds waves
    (1, 4, 4, 4096, 128, False, 1),
    # MHA: nothing to split
    (1, 16, 1, 1024, 128, True, 1),
    # MQA, 8 heads on one: split
    (1, 1, 8, 4096, 128, True, 8),
])
def test_which_problems_split(batch, hk, group, n, d, causal, expected):
    assert _split(batch, hk, group, n, d, causal) == expected


def test_packed_sequences_and_degenerate_sizes_never_split():
    assert _split(1, 4, 4, 4096, packed=True) == 1
    assert _split(1, 4, 4, 0) == 1
    assert _split(1, 4, 4, 4096, sms=0) == 1


def test_a_split_is_always_a_divisor_of_the_group_and_keeps_the_grid_small():
    for group in (2, 3, 4, 6, 8):
        for n in (128, 777, 2048, 4096):
            for hk in (1, 2, 4):
                s = _split(1, hk, group, n)
                assert group % s == 0
                if s > 1:
                    assert hk * s * -(-n // 128) <= 4 * SMS


def test_a_window_of_few_keys_is_modelled_by_the_rows_it_sees():
    # a narrow window: each key block sees few row blocks, the grid's blocks weigh the same
    # and one wave holds them: no split; the model's time falls with the window
    full = modelled_time(1, 1, 4, 4, 4096, 4096, 64, 128, 128, 2, True, None, SMS)
    narrow = modelled_time(1, 1, 4, 4, 4096, 4096, 64, 128, 128, 2, True, (256, 0), SMS)
    assert narrow < full / 4
    assert _split(1, 4, 4, 4096, window=(256, 0)) == 1


def test_unset_the_rule_decides_only_where_it_is_on(monkeypatch):
    import sparktune.kernels.sm90_bwd_split as split

    monkeypatch.setattr(split, "RULE_ON", False)
    assert _split(1, 4, 4, 4096, env={}) == 1
    monkeypatch.setattr(split, "RULE_ON", True)
    assert _split(1, 4, 4, 4096, env={}) == _split(1, 4, 4, 4096) == 2


@pytest.mark.parametrize("raw, group, expected", [
    ("", 4, None), ("  ", 4, None), ("rule", 4, None), ("1", 4, 1), ("0", 4, 1), ("-3", 4, 1), ("2", 4, 2),
    ("4", 4, 4), ("3", 4, 2), ("16", 4, 4), ("5", 6, 3),
])
def test_the_variable(raw, group, expected):
    assert split_from_env({"SPARKTUNE_SM90_BWD_GROUP_SPLIT": raw}, group) == expected


def test_the_variable_overrides_the_rule_and_a_bad_value_says_what_is_wrong():
    env = {"SPARKTUNE_SM90_BWD_GROUP_SPLIT": "1"}
    assert _split(1, 4, 4, 4096, env=env) == 1
    assert _split(1, 4, 4, 8192, env={"SPARKTUNE_SM90_BWD_GROUP_SPLIT": "4"}) == 4
    with pytest.raises(ValueError, match="SPARKTUNE_SM90_BWD_GROUP_SPLIT must be an integer"):
        _split(1, 4, 4, 4096, env={"SPARKTUNE_SM90_BWD_GROUP_SPLIT": "two"})


def test_the_model_against_two_measured_launches():
    """The model's unsplit time of GQA 16:4 bf16 hd128 causal backward launches against the
    tuner's measurements on an H100 (BENCHMARKS.md, "Few pairs: the whole grid as one
    section"): 4k at 260 TFLOP/s (0.66 ms) and 8k at 453-476 (1.44-1.52 ms), within 10%."""
    for n, measured_ms in ((4096, 0.661), (8192, 1.47)):
        t = modelled_time(1, 1, 4, 4, n, n, 64, 128, 128, 2, True, None, SMS)
        assert abs(t * 1e3 - measured_ms) <= 0.1 * measured_ms, (n, t)

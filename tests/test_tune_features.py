"""The tuner's workload and reference check for problems with features (CPU), and the
recipes and CLI flags that make such problems."""

from __future__ import annotations

import math

import pytest
import torch

from sparktune.backends.base import Backend, Candidate
from sparktune.backends.reference import ReferenceBackend
from sparktune.backends.torch_sdpa import TorchSDPABackend
from sparktune.problem import Problem
from sparktune.tune import Workload
from sparktune.tune._workload import alibi_slopes, feature_arguments, varlen_lengths


def _p(**kw):
    base = dict(op="fwd", dtype="float16", batch=2, heads_q=4, heads_kv=2, seqlen_q=40,
                seqlen_k=56, head_dim=16, causal=True)
    base.update(kw)
    return Problem(**base)


PROBLEMS = [
    _p(window_left=8),
    _p(softcap=True),
    _p(alibi=True, causal=False, window_left=5, window_right=3),
    _p(dropout=True),
    _p(varlen=True, total_q=60, total_k=90),
    _p(op="bwd", softcap=True, window_left=8),
    _p(op="bwd", deterministic=True, alibi=True),
    _p(op="bwd", varlen=True, total_q=70, total_k=100, window_left=4, dropout=True),
]


def _run(workload, backend, config):
    fn, outs = workload.launch(backend, Candidate(backend.name, config), workload.check_inputs(), fill=math.nan)
    fn()
    return workload.check(outs)


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_the_reference_passes_the_check_of_a_problem_with_features(problem):
    w = Workload(problem, "cpu")
    assert w.features  # the problem's features become arguments
    result = _run(w, ReferenceBackend(), "float32")
    assert result.ok, result.message


def test_torch_configs_pass_the_check_where_they_take_the_features():
    for problem, config in ((_p(window_left=8), "math"), (_p(alibi=True), "auto"), (_p(softcap=True), "flex"),
                            (_p(varlen=True, total_q=60, total_k=90, window_left=3), "flex")):
        tb = TorchSDPABackend()
        assert not tb.runnable_reasons(problem, config), config
        result = _run(Workload(problem, "cpu"), tb, config)
        assert result.ok, (config, result.message)


class _IgnoresFeatures(ReferenceBackend):
    """Runs every problem as if it had no feature: the check must catch it."""

    name = "ignores"

    def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True, **features):
        varlen = {n: features[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in features}
        return super().forward(q, k, v, out, config=config, causal=causal, scale=scale, need_lse=need_lse, **varlen)


@pytest.mark.parametrize("problem", [_p(window_left=8), _p(softcap=True), _p(alibi=True), _p(dropout=True)], ids=str)
def test_a_backend_that_ignores_a_feature_fails_the_check(problem):
    result = _run(Workload(problem, "cpu"), _IgnoresFeatures(), "float32")
    assert not result.ok


def test_feature_arguments_and_lengths():
    assert varlen_lengths(4, 10, 25) == [10, 5, 5, 5]
    assert varlen_lengths(3, 10, 30) == [10, 10, 10]
    assert varlen_lengths(1, 7, 7) == [7]
    kw = feature_arguments(_p(varlen=True, total_q=60, total_k=90), "cpu")
    assert kw["cu_seqlens_q"].tolist() == [0, 40, 60] and kw["cu_seqlens_k"].tolist() == [0, 56, 90]
    assert kw["cu_seqlens_q"].dtype == torch.int32 and kw["max_seqlen_k"] == 56
    assert feature_arguments(_p(), "cpu") == {}
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(h + 1) for h in range(8)]))


def test_workload_inputs_of_a_varlen_problem_are_packed():
    w = Workload(_p(op="bwd", varlen=True, total_q=60, total_k=90), "cpu")
    t = w.inputs(0)
    assert t["q"].shape == (60, 4, 16) and t["k"].shape == (90, 2, 16) and t["lse"].shape == (4, 60)
    assert isinstance(Backend, type)


# --------------------------------------------------------------------------- CLI and recipes


def _cli_problems(*argv):
    from sparktune.cli import build_parser
    from sparktune.cli import tune as tune_cli

    return tune_cli.problems_from_args(build_parser().parse_args(["tune", *argv]))[0]


def test_tune_cli_feature_flags_make_the_problems():
    fwd, bwd = _cli_problems("--seqlen", "4096", "--heads", "8", "--causal", "--window", "1024", "0",
                             "--softcap", "--alibi", "--dropout", "--deterministic")
    assert (fwd.op, fwd.window, fwd.softcap, fwd.alibi, fwd.dropout, fwd.deterministic) == (
        "fwd", (1024, -1), True, True, True, False)
    assert bwd.op == "bwd" and bwd.deterministic and bwd.window == (1024, -1)
    (p,) = _cli_problems("--heads", "8", "--varlen", "4096,1024,0,2048", "--op", "fwd", "--window", "128", "128")
    assert (p.varlen, p.batch, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k) == (True, 4, 4096, 4096, 7168, 7168)
    assert p.window == (128, 128)
    (p,) = _cli_problems("--heads", "8", "--varlen", "100,50", "--varlen-k", "200,300", "--op", "fwd")
    assert (p.seqlen_q, p.seqlen_k, p.total_q, p.total_k) == (100, 300, 150, 500)
    # a window wider than the sequences masks nothing: the plain problem
    (p,) = _cli_problems("--seqlen", "512", "--heads", "8", "--window", "4096", "-1", "--op", "fwd")
    assert not p.features


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--seqlen", "64", "--heads", "2", "--window", "-3", "0"], "window left must be >= 0, or -1"),
        (["--seqlen", "64", "--heads", "2", "--deterministic", "--op", "fwd"], "property of the backward"),
        (["--heads", "2", "--varlen", "4,x"], "--varlen must be comma-separated integers"),
        (["--heads", "2", "--varlen", "4,5", "--varlen-k", "3"], "2 query lengths and 1 key lengths"),
        (["--seqlen", "64", "--heads", "2", "--varlen-k", "3"], "--varlen-k needs --varlen"),
    ],
)
def test_tune_cli_bad_feature_flags(argv, match):
    with pytest.raises(ValueError, match=match):
        _cli_problems(*argv)


def test_recipe_feature_fields():
    from sparktune.tune import RecipeError, parse_recipe

    r = parse_recipe(
        "name: feats\nshapes:\n  - {seqlen: 4096, heads: 8, head_dim: 128, causal: true,"
        " window_left: [1024, -1], softcap: true, deterministic: true}\n"
    )
    keys = sorted((p.op, p.window, p.softcap, p.deterministic) for p in r.problems)
    assert keys == [("bwd", (-1, -1), True, True), ("bwd", (1024, -1), True, True)]
    with pytest.raises(RecipeError, match="window_left: expected an integer >= 0, or -1"):
        parse_recipe("name: x\nshapes:\n  - {seqlen: 64, heads: 2, head_dim: 64, window_left: -4}\n")

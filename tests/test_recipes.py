"""Recipes: the shipped ones expand as documented; invalid ones name file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparktune.problem import Problem
from sparktune.tune import RecipeError, load_recipe, parse_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def test_fa2_long_sequence_sweep():
    r = load_recipe(RECIPES / "fa2-long-sequence.yaml")
    assert r.name == "fa2-long-sequence" and len(r.problems) == 48
    assert {p.seqlen_q for p in r.problems} == {512, 1024, 2048, 4096, 8192, 16384}
    assert all(p.batch * p.seqlen_q == 16384 for p in r.problems)
    assert {(p.head_dim, p.causal, p.op) for p in r.problems} == {
        (d, c, o) for d in (64, 128) for c in (False, True) for o in ("fwd", "bwd")
    }
    assert {(p.heads_q, p.heads_kv, p.dtype) for p in r.problems} == {(12, 12, "float16")}


def test_gpt2_small():
    r = load_recipe(RECIPES / "gpt2-small.yaml")
    assert {(p.heads_q, p.head_dim, p.causal) for p in r.problems} == {(12, 64, True)}
    assert {(p.batch, p.seqlen_q) for p in r.problems} == {(8, 1024), (16, 1024), (32, 1024), (32, 512)}
    assert {p.dtype for p in r.problems} == {"float16", "bfloat16"}


def test_llama_gqa():
    r = load_recipe(RECIPES / "llama-gqa.yaml")
    assert {(p.heads_q, p.heads_kv) for p in r.problems} == {(32, 8), (64, 8)}
    assert all(p.group_size > 1 and p.causal and p.dtype == "bfloat16" for p in r.problems)
    assert all(p.batch * p.seqlen_q == 16384 for p in r.problems)


def test_every_shipped_recipe_is_valid():
    files = sorted(RECIPES.glob("*.yaml"))
    assert len(files) >= 3
    for f in files:
        assert load_recipe(f).problems


MINIMAL = """\
name: t
shapes:
  - {seqlen: 128, heads: 4, head_dim: 64}
"""


def test_defaults_of_a_minimal_recipe():
    r = parse_recipe(MINIMAL)
    assert r.problems == (
        Problem("fwd", "float16", 1, 4, 4, 128, 128, 64, False),
        Problem("bwd", "float16", 1, 4, 4, 128, 128, 64, False),
    )
    assert (r.trials, r.timeout, r.backends) == (None, None, None)


def test_budget_backends_aliases_and_dedup():
    r = parse_recipe(
        "name: t\nbudget: {trials: 7, timeout: 30}\nbackends: [spark, torch]\n"
        "defaults: {dtype: bf16, ops: fwd, heads: 8, heads_kv: 2, head_dim: 128}\n"
        "shapes:\n  - {seqlen: 256, seqlen_k: 512}\n  - {seqlen: 256, seqlen_k: 512}\n"
    )
    assert (r.trials, r.timeout, r.backends) == (7, 30.0, ("spark", "torch"))
    assert r.problems == (Problem("fwd", "bfloat16", 1, 8, 2, 256, 512, 128, False),)


def test_decode_recipe():
    r = load_recipe(RECIPES / "decode.yaml")
    assert r.name == "decode" and len(r.problems) == 24
    assert {p.op for p in r.problems} == {"decode"}
    assert {(p.batch, p.seqlen_k, p.page_size) for p in r.problems} == {
        (b, c, ps) for b in (1, 8, 64) for c in (1024, 8192, 32768, 131072) for ps in (0, 256)
    }
    assert {(p.heads_q, p.heads_kv, p.head_dim, p.dtype, p.seqlen_q, p.causal, p.appends)
            for p in r.problems} == {(32, 8, 128, "bfloat16", 1, True, 0)}


DECODE = """\
name: d
shapes:
  - {ops: decode, heads: 8, heads_kv: 2, head_dim: 64, cache_len: 3000}
"""


def test_decode_shape_defaults_and_bucket():
    (p,) = parse_recipe(DECODE).problems
    assert p == Problem("decode", "float16", 1, 8, 2, 1, 4096, 64, True)
    (p,) = parse_recipe(DECODE.replace("cache_len: 3000", "cache_len: 512, page_size: 16, appends: 2, "
                                       "seqlen: 4, softcap: true, window_left: 100")).problems
    assert (p.seqlen_q, p.seqlen_k, p.page_size, p.appends, p.softcap, p.window) == (4, 512, 16, 2, True, (100, -1))


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (DECODE.replace(", cache_len: 3000", ""), "r.yaml:3: shapes[0].cache_len: missing"),
        (DECODE.replace("ops: decode", "ops: [decode, fwd]"), "r.yaml:3: shapes[0].ops: a shape is decode or fwd/bwd"),
        (DECODE.replace("cache_len: 3000", "cache_len: 3000, dropout: true"), "r.yaml:3: shapes[0].dropout: not for decode shapes"),
        (DECODE.replace("cache_len: 3000", "cache_len: 3000, page_size: -1"), "r.yaml:3: shapes[0].page_size: expected an integer >= 0"),
        (DECODE.replace("cache_len: 3000", "cache_len: 64, page_size: 128"), "r.yaml:3: shapes[0]: page_size (128) must not exceed"),
        (MINIMAL.replace("head_dim: 64", "head_dim: 64, cache_len: 1024"), "r.yaml:3: shapes[0].cache_len: for decode shapes only"),
    ],
)
def test_decode_recipe_errors(text, expect):
    issues = _issues(text)
    assert any(i.startswith(expect) for i in issues), issues


def _issues(text: str) -> list[str]:
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "r.yaml")
    return [str(i) for i in info.value.issues]


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (MINIMAL.replace("head_dim: 64", "head_dim: sixty"), "r.yaml:3: shapes[0].head_dim: expected a positive integer, got 'sixty'"),
        (MINIMAL.replace("head_dim: 64", "head_dim: 0"), "r.yaml:3: shapes[0].head_dim: expected a positive integer, got 0"),
        (MINIMAL.replace("head_dim: 64", "head_dims: 64"), "r.yaml:3: shapes[0].head_dims: unknown field (did you mean 'head_dim'?)"),
        (MINIMAL.replace(", head_dim: 64", ""), "r.yaml:3: shapes[0].head_dim: missing"),
        (MINIMAL.replace("seqlen: 128", "seqlen: [128, -1]"), "r.yaml:3: shapes[0].seqlen: expected a positive integer, got -1"),
        (MINIMAL + "  - {seqlen: 64, heads: 4, head_dim: 64, causal: maybe}\n", "r.yaml:4: shapes[1].causal: expected true or false"),
        (MINIMAL + "  - {seqlen: 64, heads: 4, head_dim: 64, dtype: fp8}\n", "r.yaml:4: shapes[1].dtype: expected one of"),
        (MINIMAL + "  - {seqlen: 64, heads: 4, head_dim: 64, ops: [fwd, sideways]}\n", "r.yaml:4: shapes[1].ops: expected fwd, bwd or decode, got 'sideways'"),
        (MINIMAL + "  - {seqlen: 64, heads: 6, heads_kv: 4, head_dim: 64}\n", "r.yaml:4: shapes[1]: heads_q (6) must be a multiple of heads_kv (4)"),
        (MINIMAL + "  - {seqlen: 100, tokens: 1024, heads: 4, head_dim: 64}\n", "r.yaml:4: shapes[1].tokens: 1024 tokens is not a multiple of seqlen 100"),
        (MINIMAL + "  - {seqlen: 64, tokens: 1024, batch: 2, heads: 4, head_dim: 64}\n", "r.yaml:4: shapes[1]: give batch or tokens, not both"),
        (MINIMAL + "  - 17\n", "r.yaml:4: shapes[1]: expected a mapping, got 17"),
        ("name: t\ndefaults: {heads: x}\nshapes:\n  - {seqlen: 1, head_dim: 8}\n", "r.yaml:2: defaults.heads: expected a positive integer"),
        ("name: t\nshapes: []\n", "r.yaml:2: shapes: required: a non-empty list of shapes"),
        ("shapes:\n  - {seqlen: 1, heads: 1, head_dim: 8}\n", "r.yaml:1: name: required"),
        ("name: t\nbudget: {trials: -3}\n" + MINIMAL.split("\n", 1)[1], "r.yaml:2: budget.trials: expected a positive integer, got -3"),
        ("name: t\nbudget: {trails: 3}\n" + MINIMAL.split("\n", 1)[1], "r.yaml:2: budget.trails: unknown field (did you mean 'trials'?)"),
        ("name: t\nbackends: spark\n" + MINIMAL.split("\n", 1)[1], "r.yaml:2: backends: expected a non-empty list"),
        ("name: t\nname: u\n" + MINIMAL.split("\n", 1)[1], "r.yaml:2: not valid YAML: duplicate key 'name' (first on line 1)"),
        ("name: t\nshapes:\n  - {seqlen: 1\n", "r.yaml:4: not valid YAML"),
        ("- just\n- a list\n", "r.yaml:1: expected a mapping, got a list"),
        ("name: !!python/object/apply:os.system ['true']\n", "r.yaml:1: not valid YAML: could not determine a constructor"),
    ],
)
def test_errors_name_file_line_and_field(text, expect):
    issues = _issues(text)
    assert any(i.startswith(expect) for i in issues), issues


def test_all_errors_are_reported_together():
    issues = _issues("name: 3\nshapes:\n  - {seqlen: a, heads: 4, head_dim: 64}\n  - {seqlen: 8, heads: b, head_dim: 64}\n")
    assert [i.split(":")[1] for i in issues] == ["1", "3", "4"]


def test_unreadable_file(tmp_path):
    with pytest.raises(RecipeError, match="cannot read"):
        load_recipe(tmp_path / "absent.yaml")

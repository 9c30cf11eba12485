"""Recipes: YAML files naming the shapes to tune and the budget.

Schema (every shape field takes a value or a list of values; lists expand to every
combination)::

    name: fa2-long-sequence            # required
    description: ...                   # optional
    budget: {trials: 64, timeout: 120} # optional, per problem and op; the CLI overrides
    backends: [spark, torch]           # optional: tune only these backends
    defaults: {...shape fields...}     # optional, under every shape
    shapes:                            # required, a non-empty list of shape fields
      - {seqlen: [512, 1024], tokens: 16384}

Shape fields: ``seqlen`` (required), ``seqlen_k`` (default seqlen), ``heads`` (required),
``heads_kv`` (default heads), ``head_dim`` (required), ``batch`` or ``tokens`` (batch =
tokens / seqlen; default batch 1), ``causal`` (default false), ``dtype`` (float16, bfloat16,
fp16, bf16; default float16), ``ops`` (fwd, bwd; default both), ``allow_fp16_accum`` (default
false), and the attention features (docs/FEATURES.md): ``window_left``/``window_right``
(keys each side of the diagonal, -1 unlimited, the default; causal shapes ignore the right
side), ``softcap``, ``alibi``, ``dropout`` (default false) and ``deterministic`` (default
false; for the backward only).

Decode shapes (``ops: decode``, docs/DECODING.md; a shape is decode or fwd/bwd, not both):
``cache_len`` (required: the cache's capacity; the problem holds its power-of-two bucket),
``seqlen`` the queries per sequence (default 1), ``page_size`` (0, the default: a contiguous
cache), ``appends`` (default 0); ``causal`` defaults to true; windows, ``softcap`` and
``alibi`` apply; ``seqlen_k``, ``tokens``, ``allow_fp16_accum``, ``dropout`` and
``deterministic`` do not.

Loading is safe (no Python objects); every error names the file, the line and the field.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..problem import Problem

__all__ = ["DTYPE_ALIASES", "feature_fields", "Recipe", "RecipeError", "RecipeIssue", "load_recipe", "parse_recipe"]

DTYPE_ALIASES = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
_TOP_FIELDS = ("name", "description", "budget", "backends", "defaults", "shapes")
_BUDGET_FIELDS = ("trials", "timeout")
_SHAPE_FIELDS = (
    "dtype", "head_dim", "causal", "heads", "heads_kv", "seqlen", "seqlen_k", "batch", "tokens",
    "allow_fp16_accum", "ops", "window_left", "window_right", "softcap", "alibi", "dropout",
    "deterministic", "cache_len", "page_size", "appends",
)
#: the shape fields of decode shapes only, and of fwd/bwd shapes only
_DECODE_ONLY = ("cache_len", "page_size", "appends")
_DENSE_ONLY = ("seqlen_k", "tokens", "allow_fp16_accum", "dropout", "deterministic")


@dataclass(frozen=True)
class RecipeIssue:
    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class RecipeError(ValueError):
    """A recipe that cannot be used; ``issues`` lists every problem found."""

    def __init__(self, issues: list[RecipeIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


@dataclass(frozen=True)
class Recipe:
    name: str
    path: str
    problems: tuple[Problem, ...]
    description: str = ""
    trials: int | None = None
    timeout: float | None = None
    backends: tuple[str, ...] | None = None
    #: problem -> the line of the shape it came from
    lines: dict[Problem, int] = field(default_factory=dict, compare=False)


# --------------------------------------------------------------------------- YAML with lines


class _Map(dict):
    line: int = 0
    key_lines: dict[Any, int]


class _Seq(list):
    line: int = 0
    item_lines: list[int]


@functools.cache
def _loader() -> Any:
    """A SafeLoader that remembers the line of every mapping key and sequence item and refuses
    duplicate keys (PyYAML is imported on first use)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)
    Loader.add_constructor("tag:yaml.org,2002:seq", _construct_seq)
    return Loader


def _construct_map(loader: Any, node: Any) -> _Map:
    import yaml

    loader.flatten_mapping(node)
    m = _Map()
    m.line = node.start_mark.line + 1
    m.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise yaml.constructor.ConstructorError(None, None, "a mapping key must be a plain value", key_node.start_mark)
        if key in m:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {m.key_lines[key]})", key_node.start_mark
            )
        m[key] = loader.construct_object(value_node, deep=True)
        m.key_lines[key] = line
    return m


def _construct_seq(loader: Any, node: Any) -> _Seq:
    s = _Seq(loader.construct_object(child, deep=True) for child in node.value)
    s.line = node.start_mark.line + 1
    s.item_lines = [child.start_mark.line + 1 for child in node.value]
    return s


# --------------------------------------------------------------------------- validation


class _Checker:
    def __init__(self, file: str) -> None:
        self.file = file
        self.issues: list[RecipeIssue] = []

    def err(self, line: int, fld: str, message: str) -> None:
        self.issues.append(RecipeIssue(self.file, line, fld, message))

    def mapping(self, value: Any, line: int, fld: str, allowed: tuple[str, ...]) -> _Map | None:
        if not isinstance(value, _Map):
            self.err(line, fld, f"expected a mapping, got {_show(value)}")
            return None
        for key in value:
            if key not in allowed:
                hint = _closest(str(key), allowed)
                name = f"{fld}.{key}" if fld else str(key)
                self.err(value.key_lines[key], name, "unknown field" + (f" (did you mean {hint!r}?)" if hint else "")
                         + f"; allowed: {', '.join(allowed)}")
        return value


def _show(v: Any) -> str:
    if isinstance(v, _Map):
        return "a mapping"
    if isinstance(v, _Seq):
        return "a list"
    if v is None:
        return "nothing"
    return f"{v!r}"


def _closest(word: str, options: tuple[str, ...]) -> str | None:
    import difflib

    found = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return found[0] if found else None


def _values(c: _Checker, raw: Any, line: int, fld: str, kind: str) -> list[Any] | None:
    """A field's values (a scalar is a list of one), each checked for ``kind``."""
    items = list(raw) if isinstance(raw, _Seq) else [raw]
    lines = raw.item_lines if isinstance(raw, _Seq) else [line]
    if not items:
        c.err(line, fld, "an empty list")
        return None
    out = []
    for v, ln in zip(items, lines, strict=True):
        if kind == "int":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                c.err(ln, fld, f"expected a positive integer, got {_show(v)}")
                return None
        elif kind == "window":
            if isinstance(v, bool) or not isinstance(v, int) or v < -1:
                c.err(ln, fld, f"expected an integer >= 0, or -1 for unlimited, got {_show(v)}")
                return None
        elif kind == "bool":
            if not isinstance(v, bool):
                c.err(ln, fld, f"expected true or false, got {_show(v)}")
                return None
        elif kind == "dtype":
            if not isinstance(v, str) or v.lower() not in DTYPE_ALIASES:
                c.err(ln, fld, f"expected one of {', '.join(DTYPE_ALIASES)}, got {_show(v)}")
                return None
            v = DTYPE_ALIASES[v.lower()]
        elif kind == "op":
            if v not in ("fwd", "bwd", "decode"):
                c.err(ln, fld, f"expected fwd, bwd or decode, got {_show(v)}")
                return None
        elif kind == "count":
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                c.err(ln, fld, f"expected an integer >= 0, got {_show(v)}")
                return None
        out.append(v)
    return out


_KINDS = {
    "dtype": "dtype", "head_dim": "int", "causal": "bool", "heads": "int", "heads_kv": "int",
    "seqlen": "int", "seqlen_k": "int", "batch": "int", "tokens": "int", "allow_fp16_accum": "bool",
    "ops": "op", "window_left": "window", "window_right": "window", "softcap": "bool", "alibi": "bool",
    "dropout": "bool", "deterministic": "bool", "cache_len": "int", "page_size": "count",
    "appends": "count",
}


def _expand(c: _Checker, shape: _Map, defaults: _Map | None, fld: str) -> list[Problem]:
    merged: dict[str, tuple[Any, int, str]] = {}
    for src, prefix in ((defaults, "defaults"), (shape, fld)):
        if src is None:
            continue
        for key, value in src.items():
            if key in _KINDS:
                merged[key] = (value, src.key_lines[key], prefix)
    vals: dict[str, list[Any]] = {}
    ok = True
    for key, (raw, line, prefix) in merged.items():
        v = _values(c, raw, line, f"{prefix}.{key}", _KINDS[key])
        if v is None:
            ok = False
        else:
            vals[key] = v
    if not ok:
        return []
    ops = vals.get("ops", ["fwd", "bwd"])
    if "decode" in ops:
        if set(ops) != {"decode"}:
            c.err(merged["ops"][1], f"{merged['ops'][2]}.ops", "a shape is decode or fwd/bwd, not both "
                  "(give the decode shapes their own entry)")
            return []
        return _expand_decode(c, shape, merged, vals, fld)
    ok = _fields_allowed(c, shape, merged, fld, _DECODE_ONLY, "for decode shapes only (ops: decode)",
                         ("seqlen", "heads", "head_dim"))
    if "batch" in merged and "tokens" in merged:
        c.err(shape.line, fld, "give batch or tokens, not both (one of them may come from defaults)")
        ok = False
    if not ok:
        return []
    vals.setdefault("dtype", ["float16"])
    vals.setdefault("causal", [False])
    vals.setdefault("allow_fp16_accum", [False])
    vals.setdefault("ops", ["fwd", "bwd"])
    problems: list[Problem] = []
    axes = ["dtype", "head_dim", "causal", "heads", "heads_kv", "seqlen", "seqlen_k", "batch", "tokens", "allow_fp16_accum",
            "window_left", "window_right", "softcap", "alibi", "dropout", "deterministic"]
    present = [a for a in axes if a in vals]
    for combo in itertools.product(*(vals[a] for a in present)):
        d = dict(zip(present, combo, strict=True))
        seqlen = d["seqlen"]
        if "tokens" in d:
            if d["tokens"] % seqlen:
                c.err(merged["tokens"][1], f"{merged['tokens'][2]}.tokens", f"{d['tokens']} tokens is not a multiple of seqlen {seqlen}")
                return []
            batch = d["tokens"] // seqlen
        else:
            batch = d.get("batch", 1)
        fields = feature_fields(
            window=(d.get("window_left", -1), d.get("window_right", -1)), causal=d["causal"],
            seqlen_q=seqlen, seqlen_k=d.get("seqlen_k", seqlen), softcap=d.get("softcap", False),
            alibi=d.get("alibi", False), dropout=d.get("dropout", False),
        )  # fmt: skip
        for op in vals["ops"]:
            if d.get("deterministic") and op == "fwd":
                continue  # a property of the backward: the forward is the same problem
            try:
                problems.append(
                    Problem(
                        op=op,
                        dtype=d["dtype"],
                        batch=batch,
                        heads_q=d["heads"],
                        heads_kv=d.get("heads_kv", d["heads"]),
                        seqlen_q=seqlen,
                        seqlen_k=d.get("seqlen_k", seqlen),
                        head_dim=d["head_dim"],
                        causal=d["causal"],
                        allow_fp16_accum=d["allow_fp16_accum"],
                        deterministic=bool(d.get("deterministic")) and op == "bwd",
                        **fields,
                    )
                )
            except ValueError as e:
                c.err(shape.line, fld, str(e))
                return []
    return problems


def _fields_allowed(c: _Checker, shape: _Map, merged: dict[str, tuple[Any, int, str]], fld: str,
                    refused: tuple[str, ...], why: str, required: tuple[str, ...]) -> bool:
    """Report every field of ``refused`` the shape has (with ``why``) and every one of
    ``required`` it lacks; True when there is none of either."""
    ok = True
    for key in refused:
        if key in merged:
            c.err(merged[key][1], f"{merged[key][2]}.{key}", why)
            ok = False
    for key in required:
        if key not in merged:
            c.err(shape.line, f"{fld}.{key}", "missing (give it in the shape or in defaults)")
            ok = False
    return ok


def _expand_decode(c: _Checker, shape: _Map, merged: dict[str, tuple[Any, int, str]],
                   vals: dict[str, list[Any]], fld: str) -> list[Problem]:
    """The decode problems of a shape with ``ops: decode`` (already checked field by field)."""
    from .._kvcache import cache_bucket

    if not _fields_allowed(c, shape, merged, fld, _DENSE_ONLY, "not for decode shapes (ops: decode)",
                           ("cache_len", "heads", "head_dim")):
        return []
    vals.setdefault("dtype", ["float16"])
    vals.setdefault("causal", [True])
    vals.setdefault("seqlen", [1])
    axes = ["dtype", "head_dim", "causal", "heads", "heads_kv", "seqlen", "batch", "cache_len", "page_size",
            "appends", "window_left", "window_right", "softcap", "alibi"]
    present = [a for a in axes if a in vals]
    problems: list[Problem] = []
    for combo in itertools.product(*(vals[a] for a in present)):
        d = dict(zip(present, combo, strict=True))
        try:
            fields = feature_fields(
                window=(d.get("window_left", -1), d.get("window_right", -1)), causal=d["causal"],
                softcap=d.get("softcap", False), alibi=d.get("alibi", False),
            )  # fmt: skip
            fields.pop("dropout")
            problems.append(
                Problem(
                    op="decode", dtype=d["dtype"], batch=d.get("batch", 1), heads_q=d["heads"],
                    heads_kv=d.get("heads_kv", d["heads"]), seqlen_q=d["seqlen"],
                    seqlen_k=cache_bucket(d["cache_len"]), head_dim=d["head_dim"], causal=d["causal"],
                    page_size=d.get("page_size", 0), appends=d.get("appends", 0), **fields,
                )  # fmt: skip
            )
        except ValueError as e:
            c.err(shape.line, fld, str(e))
            return []
    return problems


def feature_fields(
    *,
    window: tuple[int, int] = (-1, -1),
    causal: bool = False,
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    softcap: bool = False,
    alibi: bool = False,
    dropout: bool = False,
    varlen_q: list[int] | None = None,
    varlen_k: list[int] | None = None,
) -> dict[str, Any]:
    """The Problem fields of the features as a call normalises them (docs/FEATURES.md): a
    causal window's right side is -1, and for dense shapes a side that masks nothing is -1;
    ``varlen_q``/``varlen_k``: the sequence lengths of a packed batch (then the fields include
    batch, seqlen_q/seqlen_k, the longest, and the totals). Raises ValueError."""
    from .._checks import check_window, trim_window

    left, right = check_window(tuple(window), causal)
    fields: dict[str, Any] = {"softcap": bool(softcap), "alibi": bool(alibi), "dropout": bool(dropout)}
    if varlen_q is not None or varlen_k is not None:
        lq = list(varlen_q if varlen_q is not None else varlen_k or [])
        lk = list(varlen_k if varlen_k is not None else lq)
        if len(lq) != len(lk) or not lq:
            raise ValueError(f"varlen: {len(lq)} query lengths and {len(lk)} key lengths; give one per sequence")
        if any(n < 0 for n in lq + lk) or not max(lq) or not max(lk):
            raise ValueError("varlen lengths must be >= 0, with at least one sequence of each non-empty")
        fields.update(varlen=True, batch=len(lq), seqlen_q=max(lq), seqlen_k=max(lk), total_q=sum(lq), total_k=sum(lk))
    elif seqlen_q is not None and seqlen_k is not None:
        left, right = trim_window((left, right), seqlen_q, seqlen_k)
    fields.update(window_left=left, window_right=right)
    return fields


def parse_recipe(text: str, file: str = "<recipe>") -> Recipe:
    """Validate and expand a recipe given as YAML text; raises :class:`RecipeError`."""
    import yaml

    c = _Checker(file)
    try:
        doc = yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else 0
        raise RecipeError([RecipeIssue(file, line, "", f"not valid YAML: {e.problem or e}")]) from None
    except yaml.YAMLError as e:
        raise RecipeError([RecipeIssue(file, 0, "", f"not valid YAML: {e}")]) from None
    top = c.mapping(doc, 1, "", _TOP_FIELDS)
    if top is None:
        raise RecipeError(c.issues)
    lines = top.key_lines
    name = top.get("name")
    if not isinstance(name, str) or not name.strip():
        c.err(lines.get("name", top.line), "name", "required: a non-empty string" + (f", got {_show(name)}" if "name" in top else ""))
    description = top.get("description", "")
    if not isinstance(description, str):
        c.err(lines["description"], "description", f"expected a string, got {_show(description)}")
        description = ""
    trials = timeout = None
    if "budget" in top:
        budget = c.mapping(top["budget"], lines["budget"], "budget", _BUDGET_FIELDS)
        if budget is not None:
            if "trials" in budget:
                t = budget["trials"]
                if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                    c.err(budget.key_lines["trials"], "budget.trials", f"expected a positive integer, got {_show(t)}")
                else:
                    trials = t
            if "timeout" in budget:
                t = budget["timeout"]
                if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
                    c.err(budget.key_lines["timeout"], "budget.timeout", f"expected a positive number of seconds, got {_show(t)}")
                else:
                    timeout = float(t)
    backends = None
    if "backends" in top:
        raw = top["backends"]
        if not isinstance(raw, _Seq) or not raw or not all(isinstance(b, str) and b for b in raw):
            c.err(lines["backends"], "backends", f"expected a non-empty list of backend names, got {_show(raw)}")
        else:
            backends = tuple(raw)
    defaults = None
    if "defaults" in top:
        defaults = c.mapping(top["defaults"], lines["defaults"], "defaults", _SHAPE_FIELDS)
    problems: list[Problem] = []
    where: dict[Problem, int] = {}
    shapes = top.get("shapes")
    if not isinstance(shapes, _Seq) or not shapes:
        c.err(lines.get("shapes", top.line), "shapes", "required: a non-empty list of shapes" + (f", got {_show(shapes)}" if "shapes" in top else ""))
    else:
        for i, (shape, line) in enumerate(zip(shapes, shapes.item_lines, strict=True)):
            fld = f"shapes[{i}]"
            m = c.mapping(shape, line, fld, _SHAPE_FIELDS)
            if m is None:
                continue
            for p in _expand(c, m, defaults, fld):
                if p not in where:
                    where[p] = line
                    problems.append(p)
    if c.issues:
        raise RecipeError(c.issues)
    return Recipe(
        name=str(name),
        path=file,
        problems=tuple(problems),
        description=description,
        trials=trials,
        timeout=timeout,
        backends=backends,
        lines=where,
    )


def load_recipe(path: str | Path) -> Recipe:
    """Read, validate and expand the recipe at ``path``; raises :class:`RecipeError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise RecipeError([RecipeIssue(str(p), 0, "", f"cannot read: {e.strerror or e}")]) from None
    return parse_recipe(text, str(p))

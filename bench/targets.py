#!/usr/bin/env python3
"""The benchmark targets, as ratios measured in one ``sparktune bench --json`` run.

    python bench/targets.py bench.json

Prints, per dtype and op: own / flash (min, geometric mean), dispatch / the fastest candidate
(min, and the shapes below 0.97), dispatch / flash (min, and the shapes below 1.0), and for
forward+backward at seqlen 8192 dispatch and own against plain attention. Then each target
(``TARGETS``; BENCHMARKS.md states them) as met, missed or not measured (the run has none of
the candidates or shapes it compares).

Exit status: 0 when no target is missed, 1 when one is, 2 when the document cannot be read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: (dtype, op, head_dim, causal, seqlen) -> candidate -> TFLOP/s
Shapes = dict[tuple, dict[str, float]]


@dataclass(frozen=True)
class Target:
    """At least ``floor`` for every ratio ``ratios`` gives (or for their geometric mean)."""

    text: str
    floor: float
    ratios: Callable[[Shapes], list[tuple[float, tuple]]]
    geomean: bool = False


def _ratio(num: str, den: str, ops: Iterable[str] | None = None,
           seqlen: int | None = None) -> Callable[[Shapes], list[tuple[float, tuple]]]:
    """num / den at each shape that has both (of ``ops`` and ``seqlen`` when given); den
    "fastest": the fastest candidate of the shape, num included."""
    keep = set(ops) if ops is not None else None

    def ratios(by_shape: Shapes) -> list[tuple[float, tuple]]:
        out = []
        for k, c in sorted(by_shape.items()):
            if keep is not None and k[1] not in keep or seqlen is not None and k[4] != seqlen:
                continue
            best = max(c.values()) if c else 0.0
            d = best if den == "fastest" else c.get(den)
            if num in c and d:
                out.append((c[num] / d, k))
        return out

    return ratios


TARGETS: tuple[Target, ...] = (
    Target("dispatch / flash >= 1.0 at every shape and op", 1.0, _ratio("dispatch", "flash")),
    Target("dispatch / the fastest candidate >= 0.97 at every shape and op", 0.97,
           _ratio("dispatch", "fastest")),
    Target("own / flash >= 1.0 at every forward shape", 1.0, _ratio("own", "flash", ["fwd"])),
    Target("own / flash >= 1.10 in geometric mean over the forward shapes", 1.10,
           _ratio("own", "flash", ["fwd"]), geomean=True),
    Target("forward+backward at seqlen 8192: dispatch / plain >= 2.2", 2.2,
           _ratio("dispatch", "plain", ["fwd+bwd"], 8192)),
)


def _where(k: tuple) -> str:
    return f"{k[0]} {k[1]} hd{k[2]} causal={int(k[3])} n={k[4]}"


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def judge(target: Target, by_shape: Shapes) -> tuple[str, list[str]]:
    """("met" | "missed" | "not measured", the lines that say where it was missed)."""
    ratios = target.ratios(by_shape)
    if not ratios:
        return "not measured", []
    if target.geomean:
        gm = _geomean([r for r, _ in ratios])
        return ("met", []) if gm >= target.floor else ("missed", [f"geometric mean {gm:.3f}"])
    low = [f"{_where(k)}: {r:.3f}" for r, k in ratios if r < target.floor]
    return ("missed" if low else "met"), low


def shapes_of(doc: dict) -> Shapes:
    by_shape: Shapes = defaultdict(dict)
    for r in doc["results"]:
        if r["status"] != "ok":
            continue
        key = (r["dtype"], r["op"], r["head_dim"], r["causal"], r["seqlen"])
        by_shape[key][r["candidate"]] = r["tflops"]
    return by_shape


def print_ratios(by_shape: Shapes) -> None:
    for dtype, op in sorted({k[:2] for k in by_shape}):
        keys = sorted(k for k in by_shape if k[:2] == (dtype, op))
        own = [by_shape[k]["own"] / by_shape[k]["flash"] for k in keys
               if "own" in by_shape[k] and "flash" in by_shape[k]]
        disp = []
        low = []
        for k in keys:
            c = by_shape[k]
            if "dispatch" not in c:
                continue
            best_name = max(c, key=c.get)
            ratio = c["dispatch"] / c[best_name]
            disp.append(ratio)
            if ratio < 0.97:
                low.append(f"hd{k[2]} causal={int(k[3])} n={k[4]}: {ratio:.3f} (fastest {best_name})")
        print(f"{dtype} {op}: own/flash min {min(own, default=float('nan')):.3f} geomean {_geomean(own):.3f} over "
              f"{len(own)} shapes; dispatch/fastest min {min(disp, default=float('nan')):.3f}, {len(low)} "
              f"of {len(disp)} below 0.97")
        for line in low:
            print(f"    {line}")
        vs_flash = [(by_shape[k]["dispatch"] / by_shape[k]["flash"], k) for k in keys
                    if "dispatch" in by_shape[k] and "flash" in by_shape[k]]
        below = [f"hd{k[2]} causal={int(k[3])} n={k[4]}: {r:.3f}" for r, k in vs_flash if r < 1.0]
        print(f"    dispatch/flash min {min((r for r, _ in vs_flash), default=float('nan')):.3f}, "
              f"{len(below)} of {len(vs_flash)} below 1.0" + ("".join(f"\n      {b}" for b in below)))
        if op == "fwd+bwd":
            for k in keys:
                c = by_shape[k]
                if k[4] == 8192 and "plain" in c and "dispatch" in c and "own" in c:
                    print(f"    n=8192 hd{k[2]} causal={int(k[3])}: dispatch/plain {c['dispatch'] / c['plain']:.2f}, "
                          f"own/plain {c['own'] / c['plain']:.2f}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Exit status: 0 no target missed, 1 one missed, 2 unreadable.")
    ap.add_argument("json", help="the document of `sparktune bench --json`")
    args = ap.parse_args(argv)
    try:
        with open(args.json, encoding="utf-8") as f:
            by_shape = shapes_of(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"bench/targets.py: cannot read {args.json}: {e}", file=sys.stderr)
        return 2
    print_ratios(by_shape)
    print("targets:")
    missed = 0
    for t in TARGETS:
        verdict, where = judge(t, by_shape)
        missed += verdict == "missed"
        print(f"  {verdict:<12} {t.text}" + "".join(f"\n      {w}" for w in where))
    if missed:
        print(f"{missed} of {len(TARGETS)} targets missed")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""``sparktune bench``: sparktune's kernels next to PyTorch's attention, as a table, CSV, JSON
and PNG bar charts."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from typing import Any

__all__ = ["add_parser", "parse_size"]

_CANDIDATE_HELP = (
    "dispatch (sparktune.attention), own (the faster of sparktune's spark and triton kernels: "
    "the tuning store's best record for this GPU, else the default config), flash, efficient, "
    "cudnn, math (PyTorch SDPA forced to that backend), plain (matmul, softmax, matmul in "
    "PyTorch)"
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark sparktune against PyTorch's attention (table, CSV, JSON, PNG charts)",
        description="Time sparktune.attention, sparktune's own best kernel and PyTorch's attention "
        "backends on a sweep of shapes, each checked against the float64 reference on the same "
        "inputs first (the tuner's check), timed like the tuner (CUDA events, warm-up, L2 flush, "
        "median). Default sweep: 16384 tokens (batch = 16384 / seqlen), seqlen 512 to 16384, 12 "
        "heads, head dim 64 and 128, causal and not, forward, backward and forward+backward, "
        "float16 only (add bfloat16 with --dtype float16,bfloat16). FLOPs: forward "
        "4*B*H*N^2*D, halved when causal; backward 2.5x; forward+backward 3.5x.",
    )
    shape = p.add_argument_group("the sweep (not with --recipe)")
    shape.add_argument("--seqlens", metavar="N,N", help="sequence lengths (default 512,1024,2048,4096,8192,16384)")
    shape.add_argument("--head-dims", metavar="D,D", help="head dimensions (default 64,128)")
    shape.add_argument("--causal", metavar="LIST", help="0, 1 or 0,1 (default 0,1: without and with the mask)")
    shape.add_argument("--heads", type=int, metavar="N", help="heads (default 12)")
    shape.add_argument("--tokens", type=int, metavar="N",
                       help="tokens per batch, batch = tokens / seqlen (default 16384)")
    shape.add_argument("--dtype", metavar="LIST",
                       help="float16, bfloat16 or float16,bfloat16 (default float16 only; bfloat16 "
                       "runs where the GPU has it, sm_80 and later)")
    p.add_argument("--recipe", metavar="FILE", help="the shapes (and dtypes) of a recipe (YAML, see recipes/) "
                   "instead of the sweep")
    p.add_argument("--ops", metavar="LIST", help="fwd, bwd, fwd+bwd, comma-separated (default all three; with "
                   "--recipe: the recipe's ops, and fwd+bwd when it has both)")
    p.add_argument("--candidates", metavar="LIST", help=f"comma-separated, default all: {_CANDIDATE_HELP}")
    p.add_argument("--baseline", metavar="NAME", help="speedups are over this candidate (default flash, when it is among the candidates)")
    p.add_argument(
        "--max-quadratic-bytes", default="4GiB", metavar="SIZE",
        help="skip math and plain where one N^2 score matrix (B*H*Nq*Nk, 2 bytes each) would "
        "need more than this (default 4GiB: they run up to seqlen 8192 of the default sweep, "
        "16384 is skipped); e.g. 512MiB, 8G, inf",
    )
    timing = p.add_argument_group("timing (per candidate, shape and op)")
    timing.add_argument("--warmup-ms", type=float, default=10.0, metavar="MS", help="warm-up (default 10)")
    timing.add_argument("--rep-ms", type=float, default=50.0, metavar="MS",
                        help="timed runs fill about this long, at least 10 runs (default 50)")
    timing.add_argument("--passes", type=int, default=2, metavar="N",
                        help="time a shape's candidates N times, in alternating order, and keep each one's "
                        "faster median (default 2)")
    out = p.add_argument_group("output")
    out.add_argument("--csv", metavar="PATH", help="write one row per shape, op and candidate")
    out.add_argument("--out", metavar="DIR", help="write PNG bar charts here, one per op and dtype (needs matplotlib)")
    out.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--from-json", metavar="FILE",
                     help="measure nothing: show the table (and write --csv, --out) of a --json document")
    p.add_argument("--db", metavar="URL", help="tuning database for dispatch and own (default: $SPARKTUNE_DB or "
                   "the user cache)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    # for tests and CI: run the CPU-capable candidates on CPU tensors with a wall-clock timer
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--cpu-runs", type=int, default=3, help=argparse.SUPPRESS)
    p.set_defaults(func=_main)


def _fail(message: str, code: int = 2) -> int:
    print(f"sparktune bench: {message}", file=sys.stderr)
    return code


def _say(message: str) -> None:
    print(f"sparktune bench: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- parsing

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> float:
    """Bytes of "4GiB", "512M", "1e9", "inf" (K, M, G, T are powers of 1024)."""
    if text.strip().lower() in ("inf", "none", "unlimited"):
        return math.inf
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"--max-quadratic-bytes: expected a size such as 4GiB, 512M or inf, got {text!r}")
    value = float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower())
    if value <= 0:
        raise ValueError(f"--max-quadratic-bytes must be positive, got {text!r}")
    return value


def _list(text: str, option: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not items or any(not x for x in items):
        raise ValueError(f"{option}: expected a comma-separated list, got {text!r}")
    return items


def _ints(text: str, option: str) -> list[int]:
    out = []
    for x in _list(text, option):
        try:
            n = int(x)
        except ValueError:
            raise ValueError(f"{option}: expected positive integers, got {x!r}") from None
        if n < 1:
            raise ValueError(f"{option}: expected positive integers, got {x!r}")
        out.append(n)
    return list(dict.fromkeys(out))


_BOOLS = {"0": False, "1": True, "false": False, "true": True, "no": False, "yes": True}


def _causal(text: str) -> list[bool]:
    if text.strip().lower() == "both":
        return [False, True]
    out = []
    for x in _list(text, "--causal"):
        if x.lower() not in _BOOLS:
            raise ValueError(f"--causal: expected 0, 1 or 0,1, got {x!r}")
        out.append(_BOOLS[x.lower()])
    return list(dict.fromkeys(out))


def _choices(text: str, option: str, allowed: tuple[str, ...]) -> list[str]:
    out = []
    for x in _list(text, option):
        if x not in allowed:
            raise ValueError(f"{option}: unknown {x!r}; choose from {', '.join(allowed)}")
        out.append(x)
    return list(dict.fromkeys(out))


def _plan(args: argparse.Namespace) -> tuple[list[Any], Any]:
    """(shapes, settings) from the arguments; raises ValueError (or RecipeError) for the user."""
    from ..benchmark import (
        CANDIDATES,
        CPU_CANDIDATES,
        DEFAULT_HEAD_DIMS,
        DEFAULT_HEADS,
        DEFAULT_SEQLENS,
        DEFAULT_TOKENS,
        OPS,
        SweepSettings,
        recipe_shapes,
        sweep_shapes,
    )
    from ..tune import DTYPE_ALIASES, load_recipe

    device = args.device.strip().lower()
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device: expected cuda, cuda:N or cpu, got {args.device!r}")
    ops: tuple[str, ...] | None = tuple(_choices(args.ops, "--ops", OPS)) if args.ops else None
    if args.recipe:
        given = [f"--{n.replace('_', '-')}" for n in ("seqlens", "head_dims", "causal", "heads", "tokens", "dtype")
                 if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with --recipe (the recipe gives the shapes)")
        recipe = load_recipe(args.recipe)
        shapes, recipe_ops = recipe_shapes(recipe.problems)
        ops = ops or recipe_ops
    else:
        dtypes = []
        for x in _list(args.dtype or "float16", "--dtype"):
            if x.lower() not in DTYPE_ALIASES:
                raise ValueError(f"--dtype: expected float16 and/or bfloat16, got {x!r}")
            dtypes.append(DTYPE_ALIASES[x.lower()])
        for name in ("heads", "tokens"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name} must be a positive integer, got {getattr(args, name)}")
        shapes = sweep_shapes(
            dtypes=list(dict.fromkeys(dtypes)),
            head_dims=_ints(args.head_dims, "--head-dims") if args.head_dims else DEFAULT_HEAD_DIMS,
            causal=_causal(args.causal) if args.causal else [False, True],
            seqlens=_ints(args.seqlens, "--seqlens") if args.seqlens else DEFAULT_SEQLENS,
            heads=args.heads or DEFAULT_HEADS,
            tokens=args.tokens or DEFAULT_TOKENS,
        )
    default_cands = CPU_CANDIDATES if device == "cpu" else CANDIDATES
    cands = tuple(_choices(args.candidates, "--candidates", CANDIDATES)) if args.candidates else default_cands
    if args.baseline is not None:
        if args.baseline not in cands:
            raise ValueError(f"--baseline {args.baseline!r} is not among the candidates ({', '.join(cands)})")
        baseline = args.baseline
    else:
        baseline = "flash" if "flash" in cands else ""
    if args.warmup_ms < 0 or args.rep_ms <= 0:
        raise ValueError("--warmup-ms must be at least 0 and --rep-ms positive")
    if args.passes < 1:
        raise ValueError(f"--passes must be a positive integer, got {args.passes}")
    if args.cpu_runs < 1:
        raise ValueError("--cpu-runs must be at least 1")
    settings = SweepSettings(
        ops=ops or OPS,
        candidates=cands,
        baseline=baseline,
        max_quadratic_bytes=parse_size(args.max_quadratic_bytes),
        seed=args.seed,
        torch_device=device,
        db=args.db,
        compile_processes=max(1, min(16, (os.cpu_count() or 2) // 2)),
        passes=args.passes,
    )
    return shapes, settings


# --------------------------------------------------------------------------- running


def _progress_bar(total: int, *, disable: bool) -> Any:
    from ._progress import progress_bar

    return progress_bar(total, unit="run", disable=disable)


def _emit(report: Any, args: argparse.Namespace, *, plots_possible: bool) -> int:
    """Write the CSV and PNGs, print the table or the JSON document; the exit code."""
    from ..benchmark import issues, render_table, write_charts, write_csv

    files: dict[str, Any] = {}
    failed: list[str] = []
    if args.csv:
        try:
            write_csv(report, args.csv)
            files["csv"] = os.path.abspath(args.csv)
        except OSError as e:
            failed.append(f"cannot write {args.csv}: {e.strerror or e}")
    if args.out and plots_possible:
        try:
            files["png"] = [str(p.resolve()) for p in write_charts(report, args.out)]
        except OSError as e:
            failed.append(f"cannot write the charts under {args.out}: {e.strerror or e}")
    if args.json:
        doc = report.to_json()
        doc["unavailable"] = issues(report)
        doc["files"] = files
        if args.out and not plots_possible:
            doc["files"]["png_skipped"] = "matplotlib is not installed"
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        print(render_table(report))
        if "csv" in files:
            print(f"CSV: {files['csv']}")
        for path in files.get("png", []):
            print(f"PNG: {path}")
    for text in failed:
        _say(text)
    stopped = report.meta.get("stopped")
    if stopped == "interrupted":
        return 130
    wrong = report.wrong()
    if wrong:
        _say(f"{len(wrong)} result(s) failed the reference check: {'; '.join(wrong[:5])}")
    return 1 if stopped or wrong or failed else 0


def _plots_possible(args: argparse.Namespace) -> bool:
    """Whether the charts asked for can be drawn; says so in one line when they cannot."""
    if not args.out:
        return False
    from ..benchmark import MISSING_MATPLOTLIB, matplotlib_missing

    if matplotlib_missing():
        _say(MISSING_MATPLOTLIB)
        return False
    return True


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _on_sigterm(handler: Any) -> Any:
    """Install ``handler`` for SIGTERM where this thread may; the previous one (or None)."""
    import signal
    import threading

    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def _main(args: argparse.Namespace) -> int:
    from ..tune import RecipeError

    if args.from_json:
        from ..benchmark import BenchReport

        try:
            with open(args.from_json, encoding="utf-8") as f:
                report = BenchReport.from_json(json.load(f))
        except OSError as e:
            return _fail(f"cannot read {args.from_json}: {e.strerror or e}")
        except (ValueError, TypeError) as e:
            return _fail(f"{args.from_json}: {e}")
        return _emit(report, args, plots_possible=_plots_possible(args))
    try:
        shapes, settings = _plan(args)
    except RecipeError as e:
        print(str(e), file=sys.stderr)
        return _fail(f"invalid recipe ({len(e.issues)} error(s))")
    except ValueError as e:
        return _fail(str(e))
    if args.csv:
        parent = os.path.dirname(os.path.abspath(args.csv))
        if not os.path.isdir(parent):
            return _fail(f"--csv {args.csv}: the directory {parent} does not exist")
    import torch

    cuda = settings.torch_device != "cpu"
    if cuda and not torch.cuda.is_available():
        return _fail("no CUDA GPU is available (torch.cuda.is_available() is False); the benchmark "
                     "times kernels on a GPU")
    if cuda:
        index = torch.device(settings.torch_device).index
        if index is not None and index >= torch.cuda.device_count():
            return _fail(f"--device {settings.torch_device}: torch sees {torch.cuda.device_count()} GPU(s)")
    plots_possible = _plots_possible(args)
    from .. import dispatch
    from ..benchmark import Sweep, WallClockTimer
    from ..problem import DeviceInfo

    if args.db is not None:
        dispatch.configure(args.db)
    if cuda:
        from ..tune import CudaEventTimer

        timer: Any = CudaEventTimer(
            warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_runs=10, max_runs=300, max_rel_iqr=0.03,
            device=settings.torch_device,
        )
        device = DeviceInfo.from_torch(settings.torch_device)
    else:
        timer = WallClockTimer(runs=args.cpu_runs)
        device = None
    sweep = Sweep(shapes, settings, timer=timer, device=device)
    if sweep.tuned.note:
        _say(sweep.tuned.note)
    bar = _progress_bar(sweep.total, disable=args.json or args.no_progress or not sys.stderr.isatty())

    def on_row(row: Any, done: int, total: int) -> None:
        if bar is None:
            return
        bar.set_description(f"{row.op} {row.dtype} hd{row.head_dim} c{int(row.causal)} n{row.seqlen}", refresh=False)
        bar.set_postfix_str(row.candidate, refresh=False)
        bar.update(1)

    sweep.progress = on_row
    sweep.say = _say
    seen: list[str] = []
    # a SIGTERM (e.g. from `timeout`) stops the sweep like Ctrl-C: what was measured is reported
    previous = _on_sigterm(_interrupt)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = sweep.run()
        for w in caught:
            text = str(w.message)
            if text not in seen:
                seen.append(text)
    finally:
        _on_sigterm(previous)
        if bar is not None:
            bar.close()
    report.meta["warnings"] = seen
    if not args.json:
        for text in seen:
            _say(f"warning: {text}")
    if report.meta.get("stopped") and report.meta["stopped"] != "interrupted":
        _say(f"stopped: {report.meta['stopped']}")
    return _emit(report, args, plots_possible=plots_possible)

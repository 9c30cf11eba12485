"""``sparktune tune``: measure every candidate for problem shapes and keep the results."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

__all__ = ["add_parser", "problems_from_args", "run"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tune",
        help="tune kernels for a problem shape (or a recipe) on this GPU",
        description="Measure every kernel that can run the problem on this GPU (checked against "
        "the reference first), store every measurement, and show the best. Dispatch uses the "
        "winners from then on.",
    )
    shape = p.add_argument_group("problem (ignored with --recipe, but for --op fwd or bwd: that "
                                 "op's problems of the recipe)")
    shape.add_argument("--seqlen", type=int, metavar="N", help="query sequence length (required without --recipe)")
    shape.add_argument("--seqlen-k", type=int, metavar="N", help="key/value sequence length (default: --seqlen)")
    shape.add_argument("--batch", type=int, default=1, metavar="N", help="batch size (default 1)")
    shape.add_argument("--heads", type=int, metavar="N", help="query heads (required without --recipe)")
    shape.add_argument("--heads-kv", type=int, metavar="N", help="key/value heads, for GQA (default: --heads)")
    shape.add_argument("--head-dim", type=int, default=128, metavar="D", help="head dimension (default 128)")
    shape.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                       help="causal mask (default off; on with --decode)")
    shape.add_argument("--dtype", default="float16", help="float16 (fp16) or bfloat16 (bf16); default float16")
    shape.add_argument("--op", choices=("fwd", "bwd", "both"), default=None, help="forward, backward or both (default)")
    shape.add_argument(
        "--allow-fp16-accum", action="store_true", help="also tune kernels that accumulate in float16 (less accurate)"
    )
    feats = p.add_argument_group("attention features (docs/FEATURES.md; ignored with --recipe)")
    feats.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"),
                       help="sliding window: keys left and right of each query's diagonal, -1 unlimited")
    feats.add_argument("--softcap", action="store_true", help="logit soft-capping (tuned at softcap 2)")
    feats.add_argument("--alibi", action="store_true", help="ALiBi biases (tuned with the geometric slopes)")
    feats.add_argument("--dropout", action="store_true", help="attention dropout (tuned at p 0.1)")
    feats.add_argument("--deterministic", action="store_true",
                       help="the backward with bitwise reproducible gradients (the forward is unchanged)")
    feats.add_argument("--varlen", metavar="LENGTHS",
                       help="packed variable-length batch: comma-separated query lengths, e.g. 4096,2048,1024 "
                       "(replaces --seqlen and --batch)")
    feats.add_argument("--varlen-k", metavar="LENGTHS", help="key lengths of the packed batch (default: --varlen)")
    dec = p.add_argument_group(
        "decoding against a KV cache (docs/DECODING.md; ignored with --recipe)",
        "--decode tunes sparktune.attention_with_kvcache for --batch sequences of --nq queries with "
        "--heads/--heads-kv/--head-dim against a cache of --cache-len keys (the key holds its "
        "power-of-two bucket), contiguous or --paged; --window, --softcap and --alibi apply.",
    )
    dec.add_argument("--decode", action="store_true", help="tune the decode problem instead of fwd/bwd")
    dec.add_argument("--cache-len", type=int, metavar="N", help="the cache's capacity in keys (required with --decode)")
    dec.add_argument("--nq", type=int, default=1, metavar="N", help="queries per sequence (default 1)")
    dec.add_argument("--paged", action="store_true", help="a paged cache (pages of --page-size keys)")
    dec.add_argument("--page-size", type=int, metavar="N", help="keys per page of a paged cache (default 256)")
    dec.add_argument("--appends", type=int, default=0, metavar="N",
                     help="new tokens written into the cache before attending (default 0)")
    p.add_argument("--recipe", metavar="FILE", help="tune the shapes of a recipe (YAML, see recipes/)")
    budget = p.add_argument_group("budget (per problem and op)")
    budget.add_argument("--trials", type=int, metavar="N", help="trials (default: the recipe's, else 100); every "
                        "candidate is measured when they fit, TPE chooses otherwise")
    budget.add_argument("--timeout", type=float, metavar="SECONDS", help="stop a study after this long")
    p.add_argument("--db", metavar="URL", help="tuning database URL or SQLite path (default: $SPARKTUNE_DB or the user cache)")
    p.add_argument(
        "--optuna-storage",
        choices=("db", "memory"),
        default="db",
        help="keep the Optuna studies in the tuning database (default; optuna-dashboard can show them) or in memory",
    )
    dist = p.add_argument_group(
        "distributed tuning",
        "With --recipe (or --run), the problems are claimed one by one with a lease in the database, so "
        "that the same command started on several processes or hosts against one database (e.g. "
        "--db postgresql+psycopg://user@host/db) divides the work: no problem is tuned twice, a "
        "crashed worker's problem is taken over when its lease expires, and problems finished in "
        "an earlier run of the same name are skipped.",
    )
    dist.add_argument("--run", metavar="NAME", help="name of the run (default: the same for every run, so a rerun "
                      "skips what is done; a new name tunes everything again)")
    dist.add_argument("--lease", type=float, default=60.0, metavar="SECONDS",
                      help="how long a claim lasts without a heartbeat (default 60)")
    dist.add_argument("--no-wait", action="store_true",
                      help="exit when nothing is left to claim instead of waiting for problems other workers hold")
    dist.add_argument("--retry-failed", action="store_true", help="claim problems whose tuning failed before")
    dist.add_argument("--reconnect", type=float, default=60.0, metavar="SECONDS",
                      help="how long the database may be away before the worker stops (default 60)")
    dist.add_argument("--no-leases", action="store_true",
                      help="tune every problem of the recipe here, without claiming it (no division of work)")
    p.add_argument("--backend", action="append", metavar="NAME", help="tune only this backend (repeatable)")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="skip candidates whose backend:config matches this glob (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and of TPE")
    p.add_argument("--no-screen", action="store_true",
                   help="give every candidate a full timing (default: a study of many candidates "
                   "times them briefly first, then fully only the finalists)")
    p.add_argument("--top", type=int, default=5, metavar="N", help="candidates shown per problem (default 5)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_main)


def _fail(message: str, code: int = 2) -> int:
    print(f"sparktune tune: {message}", file=sys.stderr)
    return code


def problems_from_args(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    """(problems, budget and filters from the recipe) for the parsed arguments; raises
    ValueError or RecipeError with a message for the user."""
    from ..problem import Problem
    from ..tune import DTYPE_ALIASES, load_recipe

    _check_budget(args)
    if args.recipe:
        recipe = load_recipe(args.recipe)
        problems = list(recipe.problems)
        if args.op in ("fwd", "bwd"):  # the recipe's problems of that op only
            problems = [p for p in problems if p.op == args.op]
            if not problems:
                raise ValueError(f"--op {args.op}: the recipe {recipe.name!r} has no {args.op} problem")
        return problems, {
            "trials": recipe.trials,
            "timeout": recipe.timeout,
            "backends": recipe.backends,
            "name": recipe.name,
        }
    if getattr(args, "decode", False):
        return [_decode_problem(args)], {}
    for flag in ("cache_len", "page_size"):
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --decode")
    for flag, off in (("paged", False), ("appends", 0), ("nq", 1)):
        if getattr(args, flag, off) != off:
            raise ValueError(f"--{flag} needs --decode")
    varlen = getattr(args, "varlen", None)
    varlen_k = getattr(args, "varlen_k", None)
    if varlen_k is not None and varlen is None:
        raise ValueError("--varlen-k needs --varlen")
    missing = [f"--{n}" for n in (("heads",) if varlen else ("seqlen", "heads")) if getattr(args, n) is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} required (or --recipe FILE)")
    dtype = DTYPE_ALIASES.get(args.dtype.lower())
    if dtype is None:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_ALIASES)}, got {args.dtype!r}")
    ops = ("fwd", "bwd") if args.op in (None, "both") else (args.op,)
    causal = bool(args.causal)
    deterministic = bool(getattr(args, "deterministic", False))
    if deterministic and ops == ("fwd",):
        raise ValueError("--deterministic is a property of the backward: use --op bwd or both")
    from ..tune import feature_fields

    def lengths(text: str | None, flag: str) -> list[int] | None:
        if text is None:
            return None
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None

    fields = feature_fields(
        window=tuple(args.window) if getattr(args, "window", None) else (-1, -1),
        causal=causal,
        seqlen_q=args.seqlen,
        seqlen_k=args.seqlen_k or args.seqlen,
        softcap=getattr(args, "softcap", False),
        alibi=getattr(args, "alibi", False),
        dropout=getattr(args, "dropout", False),
        varlen_q=lengths(varlen, "--varlen"),
        varlen_k=lengths(varlen_k, "--varlen-k"),
    )
    shape = {
        "batch": args.batch,
        "seqlen_q": args.seqlen,
        "seqlen_k": args.seqlen_k or args.seqlen,
    }
    shape.update(fields)
    problems = [
        Problem(
            op=op,
            dtype=dtype,
            heads_q=args.heads,
            heads_kv=args.heads_kv or args.heads,
            head_dim=args.head_dim,
            causal=causal,
            allow_fp16_accum=args.allow_fp16_accum,
            deterministic=deterministic and op == "bwd",
            **shape,
        )
        for op in ops
    ]
    return problems, {}


def _decode_problem(args: argparse.Namespace) -> Any:
    """The decode Problem of ``--decode`` (ValueError naming the flag when one is wrong)."""
    from .._kvcache import cache_bucket
    from ..problem import Problem
    from ..tune import DTYPE_ALIASES, feature_fields

    dense_only = [flag for flag, given in (
        ("--seqlen", args.seqlen is not None), ("--seqlen-k", args.seqlen_k is not None),
        ("--op", args.op is not None), ("--allow-fp16-accum", args.allow_fp16_accum),
        ("--dropout", getattr(args, "dropout", False)),
        ("--deterministic", getattr(args, "deterministic", False)),
        ("--varlen", getattr(args, "varlen", None) is not None),
    ) if given]  # fmt: skip
    if dense_only:
        raise ValueError(f"{', '.join(dense_only)}: not for --decode (a decode problem has --nq queries "
                         "against --cache-len keys, inference only)")
    if args.heads is None or args.cache_len is None:
        missing = [f for f, v in (("--heads", args.heads), ("--cache-len", args.cache_len)) if v is None]
        raise ValueError(f"--decode needs {' and '.join(missing)}")
    for flag, value, least in (("--cache-len", args.cache_len, 1), ("--nq", args.nq, 1),
                               ("--appends", args.appends, 0), ("--batch", args.batch, 1)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if args.page_size is not None and not args.paged:
        raise ValueError("--page-size needs --paged")
    page_size = (args.page_size if args.page_size is not None else 256) if args.paged else 0
    if args.paged and not 1 <= page_size <= args.cache_len:
        raise ValueError(f"--page-size must be between 1 and --cache-len ({args.cache_len}), got {page_size}")
    if args.appends > args.cache_len:
        raise ValueError(f"--appends ({args.appends}) must not exceed --cache-len ({args.cache_len})")
    dtype = DTYPE_ALIASES.get(args.dtype.lower())
    if dtype is None:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_ALIASES)}, got {args.dtype!r}")
    causal = True if args.causal is None else args.causal
    fields = feature_fields(
        window=tuple(args.window) if getattr(args, "window", None) else (-1, -1), causal=causal,
        softcap=getattr(args, "softcap", False), alibi=getattr(args, "alibi", False),
    )
    fields.pop("dropout")
    return Problem(
        op="decode", dtype=dtype, batch=args.batch, heads_q=args.heads, heads_kv=args.heads_kv or args.heads,
        seqlen_q=args.nq, seqlen_k=cache_bucket(args.cache_len), head_dim=args.head_dim, causal=causal,
        page_size=page_size, appends=args.appends, **fields,
    )


def _check_budget(args: argparse.Namespace) -> None:
    """The numbers of the budget and of distributed tuning make sense (ValueError if not)."""
    import math

    for name, minimum, strict in (("trials", 1, False), ("timeout", 0, True), ("lease", 0, True),
                                  ("reconnect", 0, False), ("top", 0, False)):
        value = getattr(args, name, None)
        if value is None:
            continue
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            bound = f"more than {minimum}" if strict else f"at least {minimum}"
            raise ValueError(f"--{name} must be {bound}, got {value:g}")


def _main(args: argparse.Namespace) -> int:
    from ..tune import RecipeError

    try:
        problems, extra = problems_from_args(args)
    except RecipeError as e:
        print(str(e), file=sys.stderr)
        return _fail(f"invalid recipe ({len(e.issues)} error(s))")
    except ValueError as e:
        return _fail(str(e))
    import torch

    if not torch.cuda.is_available():
        return _fail("no CUDA GPU is available (torch.cuda.is_available() is False); tuning measures kernels on the GPU they will run on")
    from ..problem import DeviceInfo

    return run(args, problems, extra, device=DeviceInfo.from_torch("cuda"), torch_device="cuda")


def run(
    args: argparse.Namespace,
    problems: list[Any],
    extra: dict[str, Any],
    *,
    device: Any,
    torch_device: Any,
    timer: Any = None,
) -> int:
    """Tune ``problems`` and report; the GPU path and the tests both come through here."""
    import optuna

    from ..db import Store, open_error_text, safe_url
    from ..tune import DatabaseUnavailable, TuneAborted, Tuner, Worker

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributed = bool(getattr(args, "recipe", None) or getattr(args, "run", None) is not None) and not getattr(
        args, "no_leases", False
    )
    try:
        store = Store(args.db)
    except Exception as exc:  # noqa: BLE001 - one line, no traceback, no password
        return _fail(f"cannot open the tuning database {safe_url(args.db)}: {open_error_text(exc, args.db)}")
    trials = args.trials if args.trials is not None else extra.get("trials")
    timeout = args.timeout if args.timeout is not None else extra.get("timeout")
    backends = args.backend or extra.get("backends")
    try:
        tuner = Tuner(
            device=device,
            torch_device=torch_device,
            timer=timer,
            store=None if distributed else store,
            trials=trials,
            timeout=timeout,
            storage=store.url if args.optuna_storage == "db" else None,
            backends=backends,
            exclude=args.exclude,
            seed=args.seed,
            screen_timer=not getattr(args, "no_screen", False),
        )
        worker = (
            Worker(
                tuner, store, run=args.run or "", lease_s=args.lease, wait=not args.no_wait,
                retry_failed=args.retry_failed, reconnect_s=args.reconnect,
                say=lambda text: print(f"sparktune tune: {text}", file=sys.stderr, flush=True),
            )
            if distributed
            else None
        )
    except ValueError as e:
        store.close()
        return _fail(str(e))
    except Exception as exc:  # noqa: BLE001 - e.g. the Optuna storage cannot be created
        store.close()
        return _fail(f"cannot use the tuning database {store.display_url}: {open_error_text(exc, args.db)}")
    plans = [tuner.plan(p) for p in problems]
    total = sum(n for _, _, n in plans)
    bar = _progress_bar(total, disable=args.no_progress or not sys.stderr.isatty() or distributed)
    results = []
    report = None
    start = time.monotonic()
    code = 0

    def on_trial(result: Any, m: Any, done: int, planned: int) -> None:
        if bar is None:
            return
        best = result.best
        bar.set_description(f"{result.problem.op} n{result.problem.seqlen_q} d{result.problem.head_dim}", refresh=False)
        bar.set_postfix_str(f"best {best.candidate.label} {best.timing.median_ms:.4g} ms" if best else "", refresh=False)
        bar.update(1)

    tuner.progress = on_trial
    try:
        if worker is not None:
            report = worker.run_problems(problems)
            results = report.results
            if report.stopped:
                code = _fail(report.stopped, 1)
        else:
            for problem in problems:
                results.append(tuner.tune(problem))
    except TuneAborted as e:
        code = _fail(str(e), 1)
    except DatabaseUnavailable as e:
        code = _fail(f"{open_error_text(e, args.db)}; stopping. Problems this worker held are released when "
                     "their leases expire; run the command again to go on.", 3)
    except Exception as e:
        if not _is_database_error(e):
            raise
        code = _fail(f"the tuning database {store.display_url} failed: {open_error_text(e, args.db)}; stopping. "
                     + ("Problems this worker held are released when their leases expire; run the command "
                        "again to go on." if worker is not None else "Run the command again to go on."), 3)
    except KeyboardInterrupt:
        code = _fail(
            "interrupted; "
            + ("the problems finished are committed, the one in progress is released"
               if worker is not None else "the finished measurements are saved"),
            130,
        )
    finally:
        if bar is not None:
            bar.close()
        where = store.display_url
        store.close()
    wall = time.monotonic() - start
    if args.json:
        out: dict[str, Any] = {"database": where, "wall_s": round(wall, 3), "results": [r.to_json() for r in results]}
        if report is not None:
            out["cluster"] = report.to_json()
        print(json.dumps(out, indent=2))
    else:
        for r in results:
            print(_report(r, args.top))
        if report is not None:
            for o in report.outcomes:
                if o.state != "tuned":
                    print(f"{_key(o.problem)}  {o.state}" + (f" ({o.owner})" if o.owner else "")
                          + (f": {o.message.splitlines()[0]}" if o.message and o.state != "done" else ""))
            print(f"\n{report.summary()}")
        print(f"\n{len(results)} problem(s) tuned in {wall:.1f} s; records in {where}")
    if code == 0 and any(r.best is None for r in results):
        code = 1
    if code == 0 and report is not None and (report.count("failed") or report.count("running")):
        code = 1
    return code


def _is_database_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the database (SQLAlchemy, its driver, Optuna's storage)."""
    import sqlalchemy as sa

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, sa.exc.SQLAlchemyError) or type(e).__name__ == "StorageInternalError":
            return True
        e = e.__cause__ or e.__context__
    return False


def _key(p: Any) -> str:
    from ..db import problem_key

    return problem_key(p)


def _progress_bar(total: int, *, disable: bool) -> Any:
    from ._progress import progress_bar

    return progress_bar(total, unit="trial", disable=disable)


def _report(r: Any, top: int) -> str:
    from ..db import problem_key

    head = f"\n{problem_key(r.problem)}  ({r.mode}, {r.trials} trials, {r.wall_s:.1f} s"
    sdpa = "PyTorch SDPA on the sliced cache" if r.problem.op == "decode" else "PyTorch SDPA default"
    head += f"; {sdpa} {r.baseline.median_ms:.4g} ms)" if r.baseline else ")"
    lines = [head]
    if r.stopped:
        lines.append(f"  stopped: {r.stopped}")
    ranked = r.ranked()
    if not ranked:
        lines.append("  no candidate passed the reference check and ran")
    else:
        rows = []
        decode = r.problem.op == "decode"  # K/V bandwidth: the measure of a decode kernel
        for i, m in enumerate(ranked[:top], 1):
            t = m.timing
            q1, q3 = t.quartiles_ms
            sp = r.speedup(m)
            rate = (f"{r.problem.bytes_read() / (t.median_ms * 1e-3) / 1e9:.0f}" if decode
                    else f"{m.tflops:.1f}")
            rows.append([
                str(i), m.candidate.label, f"{t.median_ms:.4g}", f"{q1:.4g}-{q3:.4g}", rate,
                f"{sp:.2f}x" if sp is not None else "-", f"{m.error:.2g}" if m.error is not None else "-",
            ])
        header = ["#", "candidate", "median ms", "q1-q3 ms", "GB/s" if decode else "TFLOP/s", "vs SDPA", "error"]
        widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(header)]
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip() for x in rows]
        if len(ranked) > top:
            lines.append(f"  ... {len(ranked) - top} more passed (sparktune db show {problem_key(r.problem)})")
    bad = [m for m in r.measurements if m.status != "ok"]
    for m in bad:
        lines.append(f"  {m.status}: {m.candidate.label}: {m.message}")
    for name, reasons in r.excluded.items():
        lines.append(f"  not a candidate: {name}: {'; '.join(reasons)[:200]}")
    return "\n".join(lines)

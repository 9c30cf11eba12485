"""``sparktune db``: list, show, export, import, merge and upgrade the tuning database, and
show the leases of distributed tuning."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "db",
        help="inspect and move tuning records",
        description="Inspect and move tuning records. The database is --db URL, else "
        "$SPARKTUNE_DB, else a SQLite file in the user's cache directory; the read-only files "
        "shipped in tuning_db/ are a layer under it.",
    )
    sub = p.add_subparsers(dest="db_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--db", metavar="URL", help="database URL or SQLite path")

    ls = sub.add_parser("list", help="the best record of every tuned problem")
    common(ls)
    ls.add_argument("--json", action="store_true", help="JSON output")
    ls.add_argument("--all", action="store_true", help="every measured candidate, not only the best")
    ls.add_argument("--no-shipped", action="store_true", help="leave out the shipped tuning_db/ files")
    ls.set_defaults(func=_list)

    show = sub.add_parser("show", help="every record of the given problems")
    common(show)
    show.add_argument(
        "keys",
        nargs="+",
        metavar="KEY",
        help="a problem key as `db list` prints it (fwd:float16:b1:h12/12:n8192/8192:d128:full:acc32) "
        "or FIELD=VALUE filters (seqlen_q=8192 backend=spark)",
    )
    show.add_argument("--json", action="store_true", help="JSON Lines output")
    show.add_argument("--no-shipped", action="store_true", help="leave out the shipped tuning_db/ files")
    show.set_defaults(func=_show)

    exp = sub.add_parser("export", help="write records as JSON Lines (schema: tuning_db/README.md)")
    common(exp)
    exp.add_argument("file", nargs="?", help="output file (default: standard output)")
    exp.add_argument("--include-shipped", action="store_true", help="also export the shipped records")
    exp.add_argument(
        "--per-device",
        metavar="DIR",
        help="write one file per GPU model into DIR (e.g. nvidia-h200.jsonl), lines in a stable order: "
        "the layout of tuning_db/",
    )
    exp.set_defaults(func=_export)

    imp = sub.add_parser("import", help="read JSON Lines records, validated")
    common(imp)
    imp.add_argument("file", help="a JSON Lines file as `db export` writes it")
    imp.add_argument(
        "--skip-invalid",
        action="store_true",
        help="import the valid lines and skip the others (default: refuse the whole file)",
    )
    imp.add_argument(
        "--no-kernel-check",
        action="store_true",
        help="accept backends and kernels unknown in this installation",
    )
    imp.set_defaults(func=_import)

    mg = sub.add_parser(
        "merge",
        help="merge records of other databases or files into this one",
        description="Merge the records of each SRC (a database URL, a SQLite file, or a JSON Lines file "
        "as `db export` writes it) into the database. Every record is validated as `db import` "
        "validates a line; with errors nothing is merged unless --skip-invalid. Records keep their "
        "provenance (host, GPU, time, library version); a record already here is left as it is. "
        "For the same problem, device and build, the faster verified record wins. Records of other "
        "GPU models or kernel builds are kept; dispatch never uses them where they do not match.",
    )
    common(mg)
    mg.add_argument("sources", nargs="+", metavar="SRC", help="database URL, SQLite file or JSON Lines file")
    mg.add_argument("--skip-invalid", action="store_true", help="merge the valid records and skip the others")
    mg.add_argument("--no-kernel-check", action="store_true", help="accept backends and kernels unknown here")
    mg.add_argument("--dry-run", action="store_true", help="report what would change, write nothing")
    mg.add_argument("--json", action="store_true", help="JSON output")
    mg.set_defaults(func=_merge)

    ls2 = sub.add_parser("leases", help="the leases of distributed tuning (who tunes or tuned what)")
    common(ls2)
    ls2.add_argument("--run", metavar="NAME", help="only this run")
    ls2.add_argument("--json", action="store_true", help="JSON output")
    ls2.set_defaults(func=_leases)

    up = sub.add_parser("upgrade", help="create the database or upgrade its schema")
    common(up)
    up.set_defaults(func=_upgrade)


# --------------------------------------------------------------------------- helpers


def _fail(message: str, code: int = 2) -> int:
    print(f"sparktune db: {message}", file=sys.stderr)
    return code


def _open(args: argparse.Namespace, *, create: bool = False) -> Any:
    """The store, or an int exit code after a one-line error."""
    from ..db import Store, StoreMissingError, open_error_text, safe_url

    try:
        return Store(args.db, create=create)
    except StoreMissingError:
        return None
    except Exception as exc:  # noqa: BLE001 - one line, no traceback, no password
        return _fail(f"cannot open {safe_url(args.db)}: {open_error_text(exc, args.db)}")


@dataclass
class _Layer:
    """One layer of records, as dispatch sees them: 1 is the most specific."""

    index: int
    kind: str  # "database" or "shipped"
    source: str
    records: int = 0
    #: shipped layer: file (record source) -> records
    files: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.index, "kind": self.kind, "source": self.source, "records": self.records}
        if self.kind == "shipped":
            out["files"] = [{"source": f, "records": n} for f, n in sorted(self.files.items())]
        return out


def _all_records(
    args: argparse.Namespace, *, shipped: bool, layers: list[_Layer] | None = None
) -> tuple[list[Any], str] | int:
    """Every record of the database, then of the shipped files; ``layers`` receives the
    layers, most specific first. Rows or lines that are not valid records are left out with
    a warning on standard error."""
    from ..dispatch import load_records

    loaded = load_records(db=args.db, shipped=shipped)
    if loaded.error and not loaded.missing:  # one line, no traceback, no password
        return _fail(f"cannot {'read' if loaded.opened else 'open'} {loaded.database}: {loaded.error}")
    records: list[Any] = list(loaded.stored)
    if loaded.missing:
        where = f"{loaded.database} (not created yet)"
    else:
        state = f"schema {loaded.schema}" if loaded.schema is not None else "no sparktune tables yet"
        where = f"{loaded.database} ({state})"
        if layers is not None:
            layers.append(_Layer(len(layers) + 1, "database", loaded.database, len(records)))
        for e in loaded.invalid_rows:
            print(f"sparktune db: warning: {loaded.database}: {e} (left out)", file=sys.stderr)
    if loaded.shipped_error:
        print(f"sparktune db: warning: cannot read the shipped tuning files: {loaded.shipped_error}", file=sys.stderr)
    for e in loaded.shipped_errors:
        print(f"sparktune db: warning: {e}", file=sys.stderr)
    records.extend(loaded.shipped)
    if layers is not None and loaded.shipped:
        d = loaded.shipped_dir
        layer = _Layer(len(layers) + 1, "shipped", str(d) if d is not None else "tuning_db", len(loaded.shipped))
        for r in loaded.shipped:
            layer.files[r.source] = layer.files.get(r.source, 0) + 1
        layers.append(layer)
    return records, where


def _remove(path: Any) -> None:
    """Remove a partial output file, if there is one."""
    import os

    try:
        os.unlink(path)
    except OSError:
        pass


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _device_text(r: Any) -> str:
    from ..db import device_label

    return device_label(r.device)


# --------------------------------------------------------------------------- actions


def _layer_of(r: Any, layers: list[_Layer]) -> int:
    for layer in layers:
        if (layer.kind == "database" and r.source == layer.source) or (layer.kind == "shipped" and r.source in layer.files):
            return layer.index
    return 0


def _list(args: argparse.Namespace) -> int:
    from ..db import problem_key, record_to_json
    from ..dispatch import rank

    layers: list[_Layer] = []
    got = _all_records(args, shipped=not args.no_shipped, layers=layers)
    if isinstance(got, int):
        return got
    records, where = got
    layer_of = {r.uid + "\0" + r.source: _layer_of(r, layers) for r in records}

    def lay(r: Any) -> int:
        return layer_of[r.uid + "\0" + r.source]

    #: (device model, build, problem) -> the layer whose records dispatch uses
    deciding: dict[tuple, int] = {}
    if args.all:
        chosen = sorted(records, key=lambda r: (problem_key(r.problem), _device_text(r), r.build_id, lay(r), r.measured_at))
        counts = None
    else:
        # ranked as dispatch ranks them: per GPU model, build and layer (the shipped files are one layer)
        groups: dict[tuple, list[Any]] = {}
        for r in records:
            groups.setdefault((r.device.name, r.device.capability, r.device.sm_count, r.build_id, lay(r)), []).append(r)
        chosen, counts = [], {}
        for g, recs in groups.items():
            for problem, ranked in rank(recs).items():
                best = ranked[0]
                chosen.append(best)
                counts[(best.uid, g[4])] = (len(ranked), sum(1 for r in recs if r.problem == problem))
                k = (*g[:4], problem)
                deciding[k] = min(deciding.get(k, g[4]), g[4])
        chosen.sort(key=lambda r: (problem_key(r.problem), _device_text(r), r.build_id, lay(r)))

    def hidden_by(r: Any) -> int | None:
        if args.all:
            return None
        first = deciding[(r.device.name, r.device.capability, r.device.sm_count, r.build_id, r.problem)]
        return first if first != lay(r) else None

    if args.json:
        out = []
        for r in chosen:
            obj = record_to_json(r)
            obj["key"] = problem_key(r.problem)
            obj["source"] = r.source
            obj["layer"] = lay(r)
            if counts is not None:
                obj["usable_candidates"], obj["measured"] = counts[(r.uid, lay(r))]
                obj["overridden_by_layer"] = hidden_by(r)
            out.append(obj)
        print(json.dumps({
            "database": where,
            "layers": [layer.to_json() for layer in layers],
            "records": out,
        }, indent=2))
        return 0
    print(f"database: {where}")
    if layers:
        print("layers, most specific first (for a problem, the first layer with a usable record decides):")
        for layer in layers:
            if layer.kind == "database":
                print(f"  {layer.index}. {layer.source}: {layer.records} record(s)")
            else:
                files = ", ".join(f"{f.removeprefix('shipped:')} ({n})" for f, n in sorted(layer.files.items()))
                print(f"  {layer.index}. shipped, read-only, {layer.source}: {layer.records} record(s): {files}")
    if not chosen:
        print("no tuning records" + (" (tune with `sparktune tune`)" if not records else " usable"))
        return 0
    header = ["key", "device", "build", "best" if counts is not None else "candidate", "status", "median ms", "TFLOP/s",
              "layer", "source"]
    if counts is not None:
        header.insert(6, "usable/measured")
    rows = []
    for r in chosen:
        hidden = hidden_by(r)
        layer_text = str(lay(r)) + (f" (layer {hidden} decides)" if hidden is not None else "")
        row = [problem_key(r.problem), _device_text(r), r.build_id, r.label, r.status, _fmt(r.median_ms), _fmt(r.tflops, ".1f"),
               layer_text, r.source]
        if counts is not None:
            row.insert(6, "{}/{}".format(*counts[(r.uid, lay(r))]))
        rows.append(row)
    print(_table(rows, header))
    return 0


def _matches(r: Any, keys: Iterable[str]) -> bool | str:
    """Whether ``r`` matches any KEY argument; a str is an error message."""
    from ..db import parse_problem_key, record_to_json

    flat: dict[str, Any] | None = None
    for key in keys:
        if "=" not in key:
            try:
                if r.problem == parse_problem_key(key):
                    return True
            except ValueError as e:
                return str(e)
            continue
        if flat is None:
            j = record_to_json(r)
            flat = {**j["problem"], **{f"device_{k}": v for k, v in j["device"].items()}, **j}
            flat["device"] = r.device.name
        ok = True
        for cond in key.split(","):
            name, _, want = cond.partition("=")
            if name not in flat or isinstance(flat[name], dict):
                return f"unknown field {name!r} in {key!r}"
            have = flat[name]
            text = ("true" if have else "false") if isinstance(have, bool) else str(have)
            if text.lower() != want.lower():
                ok = False
                break
        if ok:
            return True
    return False


def _show(args: argparse.Namespace) -> int:
    from ..db import problem_key, record_to_json

    got = _all_records(args, shipped=not args.no_shipped)
    if isinstance(got, int):
        return got
    records, where = got
    hits = []
    for r in records:
        m = _matches(r, args.keys)
        if isinstance(m, str):
            return _fail(m)
        if m:
            hits.append(r)
    if not hits:
        return _fail(f"no records match {' '.join(args.keys)} in {where}", 1)
    hits.sort(key=lambda r: (problem_key(r.problem), _device_text(r), r.build_id, r.status != "ok", r.median_ms or 0.0))
    if args.json:
        for r in hits:
            obj = record_to_json(r)
            obj["source"] = r.source
            print(json.dumps(obj))
        return 0
    print(f"database: {where}")
    group = None
    rows: list[list[str]] = []
    header = [
        "candidate", "status", "median ms", "q1-q3 ms", "floor ms", "runs", "TFLOP/s", "error/bound", "measured", "host",
        "message",
    ]

    def flush() -> None:
        if rows:
            print(_table(rows, header))
            rows.clear()

    for r in hits:
        g = (problem_key(r.problem), _device_text(r), r.build_id, r.source)
        if g != group:
            flush()
            group = g
            print(f"\n{g[0]}  on {g[1]} (driver {r.device.driver or '?'}, CUDA {r.device.cuda or '?'}), build {g[2]}, from {g[3]}")
        # only what was measured: "-" where the runs' quartiles or the burst floor are not known
        spread = f"{_fmt(r.q1_ms)}-{_fmt(r.q3_ms)}" if r.q1_ms is not None and r.q3_ms is not None else "-"
        err = f"{_fmt(r.error, '.2g')}/{_fmt(r.error_limit, '.2g')}" if r.error is not None else "-"
        rows.append([
            r.label, r.status, _fmt(r.median_ms), spread, _fmt(r.floor_ms), str(r.runs), _fmt(r.tflops, ".1f"), err,
            f"{r.measured_at:%Y-%m-%d %H:%M}", r.host, (r.message[:60] + "...") if len(r.message) > 63 else r.message,
        ])
    flush()
    return 0


def _device_file_names(records: list[Any]) -> dict[tuple, str]:
    """GPU model -> file name: the name in lower case with dashes (nvidia-h200.jsonl); models
    that share a name are told apart by compute capability and SM count."""
    import re

    models = sorted({(r.device.name, r.device.capability, r.device.sm_count) for r in records})
    slug = {m: re.sub(r"[^a-z0-9]+", "-", m[0].lower()).strip("-") or "gpu" for m in models}
    names = {}
    for m in models:
        clash = sum(1 for other in models if slug[other] == slug[m]) > 1
        names[m] = f"{slug[m]}-sm{m[1][0]}{m[1][1]}-{m[2]}sm.jsonl" if clash else f"{slug[m]}.jsonl"
    return names


def _export_per_device(records: list[Any], directory: str) -> int:
    import os
    from pathlib import Path

    from ..db import problem_key, write_jsonl

    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _fail(f"cannot create {directory}: {e.strerror or e}")
    names = _device_file_names(records)
    groups: dict[str, list[Any]] = {}
    for r in records:
        groups.setdefault(names[(r.device.name, r.device.capability, r.device.sm_count)], []).append(r)
    for name, recs in sorted(groups.items()):
        recs.sort(key=lambda r: (problem_key(r.problem), r.build_id, r.device.driver, r.device.cuda, r.backend,
                                 r.config, r.measured_at, r.uid))
        tmp = out / f"{name}.partial"
        try:
            with open(tmp, "w", encoding="utf-8") as fp:
                write_jsonl(recs, fp)
            os.replace(tmp, out / name)
        except OSError as e:
            _remove(tmp)
            return _fail(f"cannot write {out / name}: {e.strerror or e}")
        print(f"exported {len(recs)} record(s) to {out / name}", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    from ..db import write_jsonl

    got = _all_records(args, shipped=args.include_shipped)
    if isinstance(got, int):
        return got
    records, _ = got
    if args.per_device:
        if args.file not in (None, "-"):
            return _fail("give either FILE or --per-device DIR")
        return _export_per_device(records, args.per_device)
    if args.file in (None, "-"):
        write_jsonl(records, sys.stdout)
        return 0
    import os

    tmp = f"{args.file}.partial"
    try:
        with open(tmp, "w", encoding="utf-8") as fp:
            n = write_jsonl(records, fp)
        os.replace(tmp, args.file)
    except OSError as e:
        _remove(tmp)
        return _fail(f"cannot write {args.file}: {e.strerror or e}")
    print(f"exported {n} record(s) to {args.file}", file=sys.stderr)
    return 0


def _target(args: argparse.Namespace) -> tuple[Any, Any] | int:
    """The database to write into (created when missing) and the check of the records' kernels
    (None with --no-kernel-check), or an int exit code after a one-line error."""
    from ..dispatch import build_id
    from ..registry import kernel_check

    store = _open(args, create=True)
    if isinstance(store, int):
        return store
    return store, None if args.no_kernel_check else kernel_check(build_id())


def _write_failed(args: argparse.Namespace, store: Any, exc: BaseException, doing: str, done: str) -> int:
    """One line, no traceback, no password."""
    from ..db import open_error_text

    return _fail(f"cannot {doing} into {store.display_url}: {open_error_text(exc, args.db)}; nothing {done}")


def _import(args: argparse.Namespace) -> int:
    from ..db import import_jsonl

    target = _target(args)
    if isinstance(target, int):
        return target
    store, check = target
    with store:
        try:
            report = import_jsonl(store, args.file, skip_invalid=args.skip_invalid, check=check)
        except OSError as e:
            return _fail(f"cannot read {args.file}: {e.strerror or e}")
        except Exception as exc:  # noqa: BLE001
            return _write_failed(args, store, exc, "import", "imported")
        where = store.display_url
    for e in report.errors:
        print(f"{e}", file=sys.stderr)
    if report.refused:
        return _fail(
            f"{len(report.errors)} invalid line(s) in {args.file}; nothing imported "
            "(fix them, or pass --skip-invalid to import the valid lines)",
            1,
        )
    print(
        f"imported {report.added} record(s) into {where}; {report.duplicates} already there"
        + (f", {report.skipped} invalid line(s) skipped" if report.skipped else "")
    )
    return 0


def _record_text(r: Any) -> str:
    return f"{r.label} {r.median_ms:.4g} ms (host {r.host or '?'}, {r.measured_at:%Y-%m-%d %H:%M}, sparktune {r.version or '?'})"


def _merge(args: argparse.Namespace) -> int:
    from ..db import merge, record_to_json
    from ..dispatch import rank

    target = _target(args)
    if isinstance(target, int):
        return target
    store, check = target
    with store:
        try:
            report = merge(
                store, args.sources, skip_invalid=args.skip_invalid, check=check, dry_run=args.dry_run, rank=rank
            )
        except Exception as exc:  # noqa: BLE001
            return _write_failed(args, store, exc, "merge", "merged")
    for e in report.errors:
        print(f"{e}", file=sys.stderr)
    failed = [s for s in report.sources if s.failed]
    for s in failed:
        print(f"sparktune db: {s.source}: {s.failed}", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "database": report.into,
            "refused": report.refused,
            "dry_run": report.dry_run,
            "added": report.added,
            "sources": [
                {"source": s.source, "read": s.read, "added": s.added, "already_there": s.duplicates,
                 "invalid": len(s.errors), "failed": s.failed}
                for s in report.sources
            ],
            "winners_changed": [
                {"key": c.key, "device": c.device, "build_id": c.build_id,
                 "before": record_to_json(c.before) if c.before else None, "after": record_to_json(c.after),
                 "after_source": c.after.source}
                for c in report.changes
            ],
            "added_by_device": [{"device": d, "build_id": b, "records": n} for (d, b), n in sorted(report.added_by_device.items())],
        }, indent=2))
    if report.refused:
        why = (f"{len(failed)} source(s) could not be read" if failed else
               f"{len(report.errors)} invalid record(s)")
        return _fail(f"{why}; nothing merged" + ("" if failed else " (fix them, or pass --skip-invalid to merge the valid ones)"), 1)
    if args.json:
        return 0
    verb = "would merge" if report.dry_run else "merged"
    print(f"{verb} into {report.into}:")
    for s in report.sources:
        print(f"  {s.source}: {s.read} read, {s.added} new, {s.duplicates} already there"
              + (f", {len(s.errors)} invalid skipped" if s.errors else ""))
    if report.added_by_device:
        print("new records by GPU model and kernel build (dispatch uses only its own):")
        for (d, b), n in sorted(report.added_by_device.items()):
            print(f"  {d}, build {b}: {n}")
    if report.changes:
        print(f"best record changed for {len(report.changes)} problem(s):")
        for c in report.changes:
            before = _record_text(c.before) if c.before else "nothing tuned"
            print(f"  {c.key} on {c.device}, build {c.build_id}:\n    {before}\n -> {_record_text(c.after)} from {c.after.source}")
    else:
        print("no problem's best record changed")
    return 0


def _age(seconds: float) -> str:
    s = abs(seconds)
    text = f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"
    return text


def _leases(args: argparse.Namespace) -> int:
    from ..tune import LeaseBoard

    store = _open(args)
    if isinstance(store, int):
        return store
    if store is None:
        return _fail("no tuning database yet", 1)
    with store:
        board = LeaseBoard(store, owner="-")
        rows = board.rows(args.run)
        now = board.now()
        where = store.display_url
    if args.json:
        print(json.dumps({
            "database": where,
            "server_time": now,
            "leases": [
                {**{k: getattr(r, k) for k in ("run", "label", "owner", "state", "attempts", "claimed_at",
                                                "heartbeat_at", "expires_at", "finished_at", "records", "message")},
                 "expired": r.expired(now)}
                for r in rows
            ],
        }, indent=2))
        return 0
    print(f"database: {where}")
    if not rows:
        print("no leases (nothing was tuned with --recipe or --run)")
        return 0
    table = []
    for r in rows:
        if r.state == "running":
            when = f"expired {_age(now - r.expires_at)} ago" if r.expired(now) else f"heartbeat {_age(now - r.heartbeat_at)} ago"
        else:
            when = f"{_age(now - (r.finished_at or now))} ago"
        table.append([r.run or "-", r.label.split(" | ")[0], r.state, str(r.attempts), r.owner, when, str(r.records),
                      r.message.splitlines()[0][:60] if r.message else ""])
    print(_table(table, ["run", "problem", "state", "attempts", "owner", "when", "records", "message"]))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    from ..db import Store, open_error_text, safe_url

    try:
        before, after = Store.upgrade_database(args.db)
    except Exception as exc:  # noqa: BLE001
        return _fail(f"cannot upgrade {safe_url(args.db)}: {open_error_text(exc, args.db)}")
    where = safe_url(args.db)
    if before is None:
        print(f"created {where} at schema version {after}")
    elif before == after:
        print(f"{where} is already at schema version {after}")
    else:
        print(f"upgraded {where} from schema version {before} to {after}")
    return 0

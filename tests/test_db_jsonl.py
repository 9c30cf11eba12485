"""JSON Lines export and validated import."""

from __future__ import annotations

import io
import json

import pytest

from sparktune import db
from sparktune.db import Store
from tests._store_helpers import problem, record


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "t.sqlite3")
    yield s
    s.close()


def _export(records) -> str:
    buf = io.StringIO()
    db.write_jsonl(records, buf)
    return buf.getvalue()


def test_export_import_round_trip(tmp_path, store):
    recs = [record(problem(seqlen_q=n, seqlen_k=n), config=c) for n in (128, 256) for c in ("a", "b")]
    recs.append(record(config="crash", status="failed", message="RuntimeError: x"))
    path = tmp_path / "out.jsonl"
    path.write_text(_export(recs))
    assert len(path.read_text().splitlines()) == len(recs)
    rep = db.import_jsonl(store, path)
    assert (rep.added, rep.duplicates, rep.errors, rep.refused) == (len(recs), 0, [], False)
    back = sorted(store.records(), key=lambda r: r.uid)
    assert [db.record_to_json(r) for r in back] == [db.record_to_json(r) for r in sorted(recs, key=lambda r: r.uid)]
    # importing again changes nothing
    rep = db.import_jsonl(store, path)
    assert (rep.added, rep.duplicates) == (0, len(recs))


def test_burst_floor_and_unknown_spread_round_trip(tmp_path, store):
    """The burst floor is a field of its own; a spread that was not kept stays unknown (null)
    through export, import and the store; a line without ``floor`` (written before it
    existed) reads as no floor."""
    known = record(config="a", floor_ms=0.8)
    unknown = record(config="b", median=2.0, min_ms=None, q1_ms=None, q3_ms=None, max_ms=None, floor_ms=2.0)
    text = _export([known, unknown])
    first, second = (json.loads(line)["time_ms"] for line in text.splitlines())
    assert first["floor"] == 0.8 and first["q1"] == 0.99
    assert second == {"median": 2.0, "min": None, "max": None, "q1": None, "q3": None, "floor": 2.0}
    path = tmp_path / "f.jsonl"
    path.write_text(text)
    assert db.import_jsonl(store, path).added == 2
    back = {r.config: r for r in store.records()}
    assert back["a"].floor_ms == 0.8 and back["a"].q1_ms == 0.99
    assert (back["b"].floor_ms, back["b"].min_ms, back["b"].q1_ms, back["b"].q3_ms, back["b"].max_ms) == (
        2.0, None, None, None, None)
    old = json.loads(_line())
    del old["time_ms"]["floor"]
    assert db.record_from_json(old).floor_ms is None


def _line(**changes):
    obj = db.record_to_json(record())
    for dotted, value in changes.items():
        target = obj
        *parents, last = dotted.split("__")
        for p in parents:
            target = target[p]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ("{oops", "not valid JSON"),
        (_line(time_ms__floor=-1.0), "time_ms.floor: must be a finite number >= 0"),
        ("[1, 2]", "must be an object"),
        (_line(format=99), "format: unsupported record format 99"),
        (_line(problem__head_dim=0), "problem.head_dim: must be an integer >= 1"),
        (_line(problem__op="sideways"), "problem.op: must be one of"),
        (_line(problem__heads_kv=3), "problem: heads_q (4) must be a multiple of heads_kv (3)"),
        (_line(problem__causal="yes"), "problem.causal: must be true or false"),
        (_line(device__capability=[9]), "device.capability: must be [major, minor]"),
        (_line(time_ms__median=None), "time_ms.median: an ok record needs a median time"),
        (_line(time_ms__median=float("inf")).replace("Infinity", "1e999"), "time_ms.median: must be a finite number"),
        (_line(status="great"), "status: must be one of"),
        (_line(measured_at="yesterday"), "measured_at: must be an ISO 8601 time"),
        (_line(backend=KeyError), "backend: missing"),
        (_line(surprise=1), "surprise: unknown field"),
        (_line(uid="has space"), "uid: must be"),
    ],
)
def test_malformed_lines_are_named(line, expect):
    good, errors = db.parse_jsonl([line], source="f.jsonl")
    assert good == []
    assert len(errors) == 1
    assert str(errors[0]).startswith("f.jsonl:1: ")
    assert expect in errors[0].message


def _mixed_file(tmp_path):
    lines = [db.dumps_record(record(config="a")), "", "{broken", db.dumps_record(record(config="b")),
             _line(problem__batch=-1)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_import_refuses_whole_file_by_default(tmp_path, store):
    rep = db.import_jsonl(store, _mixed_file(tmp_path))
    assert rep.refused
    assert [e.line for e in rep.errors] == [3, 5]
    assert store.count() == 0  # nothing half-written


def test_import_can_skip_invalid_lines(tmp_path, store):
    rep = db.import_jsonl(store, _mixed_file(tmp_path), skip_invalid=True)
    assert not rep.refused
    assert (rep.added, rep.skipped, rep.read) == (2, 2, 4)
    assert {r.config for r in store.records()} == {"a", "b"}


def test_unknown_kernel_check(tmp_path, store):
    known = {("knowncost", "fast")}

    def check(r):
        return None if (r.backend, r.config) in known else f"config: unknown kernel {r.config!r}"

    path = tmp_path / "k.jsonl"
    path.write_text(_export([record(config="fast"), record(config="ghost")]))
    rep = db.import_jsonl(store, path, check=check)
    assert rep.refused and rep.errors[0].line == 2 and "ghost" in rep.errors[0].message


def test_readme_example_is_a_valid_record():
    import re
    from pathlib import Path

    readme = Path(__file__).resolve().parent.parent / "tuning_db" / "README.md"
    block = re.search(r"```json\n(.*?)```", readme.read_text(), re.S).group(1)
    r = db.record_from_json(json.loads(block))
    assert (r.backend, r.status, r.q3_ms, r.torch_version) == ("spark", "ok", 1.63, "2.11.0+cu130")

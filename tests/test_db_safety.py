"""Nothing the store, the tuner, dispatch or the recipes read is unpickled or evaluated; YAML
is loaded with a safe loader."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from sparktune import db, dispatch
from sparktune.db import Store
from sparktune.tune import CostTimer, Tuner, load_recipe
from tests._store_helpers import DEVICE, known_cost, problem, record, registered_plugin

PKG = Path(__file__).resolve().parent.parent / "sparktune"
OWN = ["db", "tune", "dispatch", "cli/db.py", "cli/tune.py"]
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def _files():
    for part in OWN:
        path = PKG / part
        yield from (sorted(path.rglob("*.py")) if path.is_dir() else [path])


def test_no_unsafe_deserialisation_in_the_source():
    for path in _files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            assert not names & UNSAFE_MODULES, f"{path}:{node.lineno} imports {names & UNSAFE_MODULES}"
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                assert name not in ("eval", "exec", "unsafe_load", "full_load"), f"{path}:{node.lineno}: {name}"
                if name == "load" and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", "") == "yaml":
                    loader = {k.arg: k.value for k in node.keywords}.get("Loader")
                    assert loader is not None, f"{path}:{node.lineno}: yaml.load without a Loader"


def test_recipe_yaml_refuses_python_objects(tmp_path):
    from sparktune.tune import RecipeError

    bad = tmp_path / "evil.yaml"
    bad.write_text("name: !!python/object/apply:os.system ['echo pwned']\nshapes: []\n")
    with pytest.raises(RecipeError):
        load_recipe(bad)


def test_tune_merge_and_dispatch_never_unpickle(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setenv(dispatch.ENV_SHIPPED, "")
    path = tmp_path / "s.sqlite3"
    with Store(path) as store, registered_plugin(path):
        p = problem(batch=1, heads_q=1, heads_kv=1, seqlen_q=16, seqlen_k=16, head_dim=16)
        tuner = Tuner(device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost), store=store,
                      backends=["knowncost"], storage=store.url, trials=3)
        tuner.tune(p)
        tuner.tune(p, resume=True)  # reads the study's trials back
        src = tmp_path / "in.jsonl"
        src.write_text(db.dumps_record(record(problem(), config="fast")) + "\n")
        db.merge(store, [str(src)], rank=dispatch.rank)
        assert dispatch.select(p, DEVICE).source == "tuned"

"""The backend registry: built-ins, lookups, registration, and plugins that fail to load."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from sparktune import registry
from sparktune.backends.base import Backend
from sparktune.backends.reference import ReferenceBackend
from sparktune.dispatch import select
from sparktune.problem import Problem
from sparktune.registry import (
    UnavailableBackend,
    backend_errors,
    backends,
    get_backend,
    register_backend,
    unregister_backend,
)

PROBLEM = Problem("fwd", "float16", 1, 2, 2, 17, 17, 16, False)


class PluginBackend(ReferenceBackend):
    """A well-behaved plugin (the reference math under another name)."""

    name = "plugin"


class MisnamedBackend(ReferenceBackend):
    name = "not-what-the-entry-point-says"


@pytest.fixture(autouse=True)
def fresh_registry():
    registry._reset()
    yield
    registry._reset()


def fake_entry_points(monkeypatch, *specs: tuple[str, str]) -> None:
    eps = [importlib.metadata.EntryPoint(n, v, registry.ENTRY_POINT_GROUP) for n, v in specs]

    def entry_points(**params):
        assert params == {"group": registry.ENTRY_POINT_GROUP}
        return eps

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_builtins_are_listed_in_order():
    found = backends()
    assert list(found)[:4] == ["spark", "triton", "torch", "reference"]
    assert isinstance(found["reference"], ReferenceBackend)
    assert found["reference"].unavailable_reasons() == []
    for b in found.values():
        assert isinstance(b, Backend)
        # a built-in whose module is missing is listed as unavailable with the import error
        if isinstance(b, UnavailableBackend):
            assert (
                b.unavailable_reasons()
                and "cannot load sparktune.backends" in b.unavailable_reasons()[0]
            )


def test_get_backend_loads_only_what_it_is_asked_for():
    assert get_backend("reference").name == "reference"
    assert get_backend("reference") is get_backend("reference")
    assert set(registry._loaded) == {"reference"}


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(
        ValueError, match=r"unknown backend 'nope'; known backends: .*reference.*torch"
    ):
        get_backend("nope")


def test_register_and_unregister():
    b = PluginBackend()
    register_backend(b)
    assert get_backend("plugin") is b and backends()["plugin"] is b
    with pytest.raises(ValueError, match="'plugin' is already registered"):
        register_backend(PluginBackend())
    with pytest.raises(ValueError, match="'reference' is already registered"):
        register_backend(type("R", (ReferenceBackend,), {})())
    other = PluginBackend()
    register_backend(other, replace=True)
    assert get_backend("plugin") is other
    assert unregister_backend("plugin") is other
    with pytest.raises(ValueError, match="unknown backend 'plugin'"):
        get_backend("plugin")
    assert unregister_backend("plugin") is None


def test_register_rejects_non_backends():
    with pytest.raises(TypeError, match=r"needs a Backend instance, got the class PluginBackend"):
        register_backend(PluginBackend)
    with pytest.raises(TypeError, match=r"needs a Backend instance, got str"):
        register_backend("plugin")
    nameless = PluginBackend()
    nameless.name = ""
    with pytest.raises(ValueError, match="non-empty string name"):
        register_backend(nameless)


def test_plugins_load_and_broken_ones_are_reported_not_raised(monkeypatch, caplog):
    fake_entry_points(
        monkeypatch,
        ("plugin", "tests.test_registry:PluginBackend"),
        ("broken", "sparktune_no_such_module:Backend"),
        ("misnamed", "tests.test_registry:MisnamedBackend"),
        ("notabackend", "tests.test_registry:PROBLEM"),
    )
    with caplog.at_level(logging.WARNING, logger="sparktune.registry"):
        found = backends()
        found_again = backends()
        errors = backend_errors()
    assert isinstance(found["plugin"], PluginBackend)
    assert list(found)[:4] == ["spark", "triton", "torch", "reference"]
    assert found_again["plugin"] is found["plugin"]
    assert (
        "ModuleNotFoundError" in errors["broken"] and "sparktune_no_such_module" in errors["broken"]
    )
    assert "registered as 'misnamed'" in errors["misnamed"]
    assert "is not a sparktune.backends.base.Backend" in errors["notabackend"]
    for name in ("broken", "misnamed", "notabackend"):
        assert isinstance(found[name], UnavailableBackend)
        assert found[name].unavailable_reasons() == [errors[name]]
        assert found[name].candidates(PROBLEM) == []
        # each failure is logged once, however often the registry is asked
        assert sum(name in r.getMessage() for r in caplog.records) == 1
    assert "plugin" not in errors


def test_plugin_cannot_take_a_builtin_name(monkeypatch):
    fake_entry_points(monkeypatch, ("reference", "tests.test_registry:PluginBackend"))
    assert isinstance(get_backend("reference"), ReferenceBackend)
    assert not isinstance(backends()["reference"], PluginBackend)
    (error,) = [e for n, e in backend_errors().items() if n.startswith("reference")]
    assert "uses the built-in name 'reference'" in error


def test_unreadable_entry_points_do_not_break_the_registry(monkeypatch):
    def entry_points(**params):
        raise RuntimeError("corrupt metadata")

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert "reference" in backends()


def test_broken_builtin_is_unavailable(monkeypatch):
    monkeypatch.setitem(
        registry.BUILTIN_BACKENDS, "spark", "sparktune.backends.no_such_module:Nope"
    )
    spark = get_backend("spark")
    assert isinstance(spark, UnavailableBackend)
    assert "No module named 'sparktune.backends.no_such_module'" in spark.unavailable_reasons()[0]
    with pytest.raises(RuntimeError, match="backend 'spark' is unavailable"):
        spark.forward(None, None, None, None, config="x", causal=False, scale=1.0)
    assert "spark" in backend_errors()


def test_dispatch_skips_unavailable_backends(monkeypatch):
    fake_entry_points(monkeypatch, ("broken", "sparktune_no_such_module:Backend"))
    chosen = select(PROBLEM, None)
    assert chosen.candidate.backend in ("torch", "reference")


def _in_thread(fn, timeout=10.0):
    """(finished, result) of ``fn()`` run in another thread, waiting at most ``timeout``."""
    import threading

    box = {}

    def run():
        box["result"] = fn()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), box.get("result")


def test_lookups_of_loaded_backends_take_no_lock():
    import threading

    plugin = PluginBackend()
    register_backend(plugin)
    backends()  # everything loaded
    held, release = threading.Event(), threading.Event()

    def holder():
        with registry._lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    assert held.wait(10)
    try:
        done, found = _in_thread(lambda: get_backend("plugin"))
        assert done and found is plugin, "get_backend waited for the registry lock"
        done, found = _in_thread(lambda: get_backend("reference"))
        assert done and isinstance(found, ReferenceBackend)
        done, found = _in_thread(backends)
        assert done and found["plugin"] is plugin and list(found)[:4] == ["spark", "triton", "torch", "reference"]
    finally:
        release.set()
        t.join(10)


def test_lock_free_readers_see_every_change_at_once():
    backends()
    first = PluginBackend()
    register_backend(first)
    assert get_backend("plugin") is first and backends()["plugin"] is first
    second = PluginBackend()
    register_backend(second, replace=True)
    assert get_backend("plugin") is second and backends()["plugin"] is second
    unregister_backend("plugin")
    assert "plugin" not in backends()
    with pytest.raises(ValueError, match="unknown backend 'plugin'"):
        get_backend("plugin")
    # a caller's dictionary is its own
    mine = backends()
    mine.pop("reference")
    mine["intruder"] = first
    assert "reference" in backends() and "intruder" not in backends()
    with pytest.raises(ValueError, match="unknown backend 'intruder'"):
        get_backend("intruder")


def test_change_listeners_hear_of_every_registration_and_removal():
    heard = []

    def listener():
        heard.append(sorted(backends()))

    registry.on_change(listener)
    try:
        register_backend(PluginBackend())
        unregister_backend("plugin")
    finally:
        registry._listeners.remove(listener)
    assert [("plugin" in names) for names in heard] == [True, False]

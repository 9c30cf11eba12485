"""The backend registry: built-in backends plus plugins from the ``sparktune.backends``
entry-point group.

Nothing is imported until it is needed. The built-ins are a table of lazy import paths; the
entry points are discovered on the first call that needs the whole registry and loaded then.
A backend that cannot be imported (a built-in whose module is missing or broken, a plugin that
raises on load) never breaks the caller: it is logged once, listed by :func:`backend_errors`,
and appears in :func:`backends` as an :class:`UnavailableBackend` whose
``unavailable_reasons()`` carries the error, so dispatch skips it and ``sparktune info`` says why.

Lookups of loaded backends take no lock: the loaded backends are published as a dictionary
that is replaced, never changed, whenever a backend is loaded, registered or removed (under the
lock), so :func:`get_backend` on a dispatch hit is one dictionary lookup.

A plugin's entry point name is its registry name, and the object it points to is a
:class:`~sparktune.backends.base.Backend` subclass (instantiated without arguments), an
instance, or a callable returning an instance. Its ``name`` attribute must equal the entry
point name. Built-in names cannot be taken by plugins.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .backends.base import Backend

if TYPE_CHECKING:
    import torch

    from .db import Record
    from .problem import DeviceInfo, Problem

__all__ = [
    "BUILD_BOUND_BACKENDS",
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "UnavailableBackend",
    "backend_errors",
    "backends",
    "get_backend",
    "kernel_check",
    "on_change",
    "register_backend",
    "unregister_backend",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "sparktune.backends"

#: name -> "module:attribute" of the backend class; imported on first use
BUILTIN_BACKENDS: dict[str, str] = {
    "spark": "sparktune.backends.spark:SparkBackend",
    "triton": "sparktune.backends.triton:TritonBackend",
    "torch": "sparktune.backends.torch_sdpa:TorchSDPABackend",
    "reference": "sparktune.backends.reference:ReferenceBackend",
}


class UnavailableBackend(Backend):
    """Stands in for a backend that could not be loaded; it runs nothing and says why."""

    tunable = False

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    def __repr__(self) -> str:
        return f"UnavailableBackend({self.name!r}, {self.reason!r})"

    def unavailable_reasons(self) -> list[str]:
        return [self.reason]

    def configs(self, op: str = "fwd") -> Sequence[str]:
        return ()

    def not_supported_reasons(
        self, problem: Problem, config: str | None = None, device: DeviceInfo | None = None
    ) -> list[str]:
        return [self.reason]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
        need_lse: bool = True,
    ) -> torch.Tensor | None:
        raise RuntimeError(f"backend {self.name!r} is unavailable: {self.reason}")


_lock = threading.RLock()
#: loaded backends (real or UnavailableBackend), by name; changed only under the lock
_loaded: dict[str, Backend] = {}
#: names known but not loaded yet -> how to load them: ("builtin", path) or ("plugin", ep)
_pending: dict[str, tuple[str, Any]] = {}
#: names whose loading failed -> the error text
_errors: dict[str, str] = {}
_discovered = False
#: what readers see without the lock: a copy of ``_loaded`` that is replaced, never changed
_published: dict[str, Backend] = {}
#: the whole registry in order (built-ins first) once everything is discovered and loaded;
#: None while something is pending. Replaced, never changed, like ``_published``.
_published_all: dict[str, Backend] | None = None
#: called (without arguments, outside the lock) after a backend is registered or removed
_listeners: list[Callable[[], None]] = []


def _publish() -> None:
    """Make the current state visible to the lock-free readers (call under the lock)."""
    global _published, _published_all
    _published = dict(_loaded)
    if _discovered and not _pending:
        ordered = {n: _loaded[n] for n in BUILTIN_BACKENDS if n in _loaded}
        ordered.update((n, b) for n, b in _loaded.items() if n not in ordered)
        _published_all = ordered
    else:
        _published_all = None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _discover() -> None:
    """Fill the pending table with the built-ins and the entry points, once."""
    global _discovered
    if _discovered:
        return
    for name, path in BUILTIN_BACKENDS.items():
        if name not in _loaded:
            _pending.setdefault(name, ("builtin", path))
    try:
        eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as exc:  # noqa: BLE001 - broken metadata must not break the caller
        log.warning(
            "sparktune: cannot read the %r entry points: %s", ENTRY_POINT_GROUP, _describe(exc)
        )
        eps = []
    for ep in eps:
        if ep.name in BUILTIN_BACKENDS:
            _fail(
                f"{ep.name} ({ep.value})", f"plugin {ep.value!r} uses the built-in name {ep.name!r}"
            )
            continue
        if ep.name in _loaded or ep.name in _pending:
            _fail(f"{ep.name} ({ep.value})", f"plugin {ep.value!r} repeats the name {ep.name!r}")
            continue
        _pending[ep.name] = ("plugin", ep)
    _discovered = True


def _fail(name: str, reason: str) -> Backend:
    log.warning("sparktune: backend %r could not be loaded: %s", name, reason)
    _errors[name] = reason
    return UnavailableBackend(name, reason)


def _instantiate(name: str, obj: Any) -> Backend:
    if isinstance(obj, type) and issubclass(obj, Backend):
        obj = obj()
    elif not isinstance(obj, Backend) and callable(obj):
        obj = obj()
    if not isinstance(obj, Backend):
        raise TypeError(f"{obj!r} is not a sparktune.backends.base.Backend")
    if obj.name != name:
        raise ValueError(f"the backend's name is {obj.name!r}, but it is registered as {name!r}")
    return obj


def _load(name: str) -> Backend:
    """Load one pending backend; never raises for the backend's own errors."""
    kind, what = _pending.pop(name)
    try:
        if kind == "builtin":
            module_name, _, attr = what.partition(":")
            obj = getattr(importlib.import_module(module_name), attr)
        else:
            obj = what.load()
        backend = _instantiate(name, obj)
    except Exception as exc:  # noqa: BLE001 - reported through backend_errors() and logging
        source = what if kind == "builtin" else f"entry point {what.value!r}"
        backend = _fail(name, f"cannot load {source}: {_describe(exc)}")
    _loaded[name] = backend
    _publish()
    return backend


def backends() -> dict[str, Backend]:
    """Every registered backend by name (built-ins first, then plugins), loading what is not
    loaded yet. Backends that failed to load appear as :class:`UnavailableBackend`. Once
    everything is loaded this takes no lock. The dictionary returned is the caller's."""
    ready = _published_all
    if ready is not None:
        return dict(ready)
    with _lock:
        _discover()
        for name in list(_pending):
            _load(name)
        _publish()
        return dict(_published_all if _published_all is not None else _published)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name`` (loading only that one when it is a built-in).
    A loaded backend is found without taking a lock."""
    backend = _published.get(name)
    if backend is not None:
        return backend
    return _get_backend_locked(name)


def _get_backend_locked(name: str) -> Backend:
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in BUILTIN_BACKENDS and name not in _pending and not _discovered:
            _pending[name] = ("builtin", BUILTIN_BACKENDS[name])
        if name not in _pending:
            _discover()
        if name in _pending:
            return _load(name)
        known = sorted(set(_loaded) | set(_pending))
    raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(known) or '(none)'}")


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add ``backend`` under ``backend.name``. An existing name (registered, built-in or
    discovered plugin) is an error unless ``replace`` is true."""
    if isinstance(backend, type):
        raise TypeError(
            f"register_backend() needs a Backend instance, got the class {backend.__name__} "
            "(instantiate it)"
        )
    if not isinstance(backend, Backend):
        raise TypeError(
            f"register_backend() needs a Backend instance, got {type(backend).__name__}"
        )
    name = backend.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"a backend needs a non-empty string name, got {name!r}")
    with _lock:
        _discover()
        if not replace and (name in _loaded or name in _pending):
            raise ValueError(f"a backend named {name!r} is already registered (pass replace=True)")
        _pending.pop(name, None)
        _errors.pop(name, None)
        _loaded[name] = backend
        _publish()
    _changed()


def unregister_backend(name: str) -> Backend | None:
    """Remove ``name`` from the registry (mainly for tests); returns what was registered, or
    None when it was not loaded yet or unknown."""
    with _lock:
        _discover()
        _pending.pop(name, None)
        _errors.pop(name, None)
        removed = _loaded.pop(name, None)
        _publish()
    _changed()
    return removed


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback()`` after every backend registered or removed from now on (dispatch
    forgets its memoised choices then: which kernels can run depends on the backends)."""
    with _lock:
        if callback not in _listeners:
            _listeners.append(callback)


def _changed() -> None:
    with _lock:
        listeners = list(_listeners)
    for callback in listeners:
        callback()


def backend_errors() -> dict[str, str]:
    """Backends (built-in or plugin) that failed to load, with the error, after loading
    everything that is registered."""
    backends()
    with _lock:
        return dict(_errors)


#: backends whose catalogue of kernels is the compiled family that ``build_id`` identifies
BUILD_BOUND_BACKENDS = ("spark",)


def kernel_check(build_id: str | None = None) -> Callable[[Record], str | None]:
    """A check of tuning records (for ``db import`` and ``db merge``): that the record's
    backend is registered here and, when that backend can list its configurations in this
    process, that the config is one of them; it returns the reason a record is refused, or
    None. With ``build_id``
    (this installation's kernel build), the configs of a :data:`BUILD_BOUND_BACKENDS` backend
    are checked only in records of that build: another build's catalogue is not known here,
    and its records are kept (dispatch never uses them on this build)."""
    registered = backends()
    known: dict[tuple[str, str], set[str] | None] = {}

    def check(r: Record) -> str | None:
        b = registered.get(r.backend)
        if b is None:
            names = ", ".join(sorted(registered)) or "none"
            return f"backend: unknown backend {r.backend!r} (registered: {names})"
        if build_id is not None and r.build_id != build_id and r.backend in BUILD_BOUND_BACKENDS:
            return None
        key = (r.backend, r.problem.op)
        if key not in known:
            try:
                configs = set(b.configs(r.problem.op)) if not b.unavailable_reasons() else set()
            except Exception:  # noqa: BLE001 - a broken backend cannot vouch for configs
                configs = set()
            known[key] = configs or None
        configs = known[key]
        if configs is not None and r.config not in configs:
            return f"config: unknown kernel {r.config!r} for backend {r.backend!r} op {r.problem.op!r}"
        return None

    return check



def _reset() -> None:
    """Forget everything; the next call discovers and loads again (for tests)."""
    global _discovered
    with _lock:
        _loaded.clear()
        _pending.clear()
        _errors.clear()
        _discovered = False
        _publish()

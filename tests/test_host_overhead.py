"""The host cost of ``sparktune.attention()`` on a dispatch hit, guarded without a clock: what
the hit path calls (Python functions, tensor operations, allocations) is counted, and the
fast checks are shown to accept exactly what the full checks accept. Timings are in
bench/host_overhead.py."""

from __future__ import annotations

import collections
import importlib
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import sparktune
import sparktune.backends.torch_sdpa as tsdpa
from sparktune import dispatch, registry
from sparktune.backends.base import Backend
from sparktune.problem import DeviceInfo, Problem

api = importlib.import_module("sparktune.attention")
plan_mod = importlib.import_module("sparktune._plan")
checks = importlib.import_module("sparktune._checks")
hits_mod = importlib.import_module("sparktune._hits")

#: a GPU fingerprint for CPU tensors, so that a tuned record can be hit without a GPU
STAND_IN = DeviceInfo("host-overhead stand-in GPU", (9, 0), 132, driver="1", cuda="13.0")
SHAPE = (1, 2, 16, 16)
PROBLEM = Problem("fwd", "float16", 1, 2, 2, 16, 16, 16, False)

# Budgets for one call on a hit (measured: 11 Python calls and 15 tensor operations). They
# leave room for small changes; a check or a lookup done twice, a context manager, a warning,
# a Problem validated again or a copy of the output goes over them or is named below.
MAX_PYTHON_CALLS = 14
MAX_TENSOR_OPS = 18
#: never on the hit path (Python functions, by qualified or plain name): validation done
#: again, a Problem or plan made, warnings and logging, context managers, dispatch that
#: resolves instead of finding its memo
FORBIDDEN = {
    "_check_inputs",
    "_check_scale",
    "Problem.__post_init__",
    "DeviceInfo.__post_init__",
    "DeviceInfo.from_torch",
    "_warn_once",
    "warn",
    "Logger.info",
    "Logger.warning",
    "Logger.debug",
    "__enter__",
    "_resolve",
    "_forced",
    "heuristic_default",
    "_table",
}


class NoopBackend(Backend):
    """Runs nothing: the cost of a call through it is sparktune's own."""

    name = "host-noop"
    tunable = False

    def __init__(self):
        self.calls = 0

    def configs(self, op="fwd"):
        return ("default",)

    def not_supported_reasons(self, problem, config=None, device=None):
        return [] if config in (None, "default") else [f"unknown config {config!r}"]

    def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True):
        self.calls += 1
        return None


@pytest.fixture
def noop():
    backend = NoopBackend()
    registry.register_backend(backend, replace=True)
    yield backend
    registry.unregister_backend(backend.name)


@pytest.fixture
def tuned_hit(noop, tmp_path, monkeypatch):
    """A tuning store whose record for PROBLEM on STAND_IN is the noop backend, and CPU
    tensors that attention() sees on STAND_IN."""
    from sparktune.db import Record, Store

    monkeypatch.setenv("SPARKTUNE_SHIPPED_DB", "")
    monkeypatch.setattr(plan_mod, "device_info", lambda device: STAND_IN)
    path = tmp_path / "hit.sqlite3"
    with Store(path) as s:
        s.add(
            [
                Record(
                    PROBLEM,
                    STAND_IN,
                    dispatch.build_id(),
                    noop.name,
                    "default",
                    median_ms=1.0,
                    min_ms=1.0,
                    max_ms=1.0,
                    runs=1,
                )  # fmt: skip
            ]
        )
    dispatch.configure(path)
    assert dispatch.select(PROBLEM, STAND_IN).source == "tuned"
    yield noop
    dispatch.configure(None)


def qkv(shape=SHAPE, dtype=torch.float16):
    return tuple(torch.randn(*shape, dtype=dtype) for _ in range(3))


class _Calls:
    """Functions entered while active, outside this file (a profile hook: every call, not a
    sample): Python ones by qualified name, built-in ones (C) as ``c:name``."""

    def __init__(self):
        self.names: collections.Counter[str] = collections.Counter()

    def _hook(self, frame, event, arg):
        if frame.f_code.co_filename == __file__:
            return
        if event == "call":
            self.names[frame.f_code.co_qualname] += 1
        elif event == "c_call":
            self.names[f"c:{getattr(arg, '__name__', '?')}"] += 1

    @property
    def python(self) -> collections.Counter[str]:
        return collections.Counter({n: c for n, c in self.names.items() if not n.startswith("c:")})

    def __enter__(self):
        self._saved = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._saved)


class _TensorOps(TorchFunctionMode):
    """Tensor operations and attribute reads that reach torch's Python API while active."""

    def __init__(self):
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # an attribute such as .shape, .dtype or .device
            name = f"get:{getattr(func.__self__, '__name__', '?')}"
        self.names[name] += 1
        return func(*args, **(kwargs or {}))


ALLOCATIONS = {"empty", "empty_like", "zeros", "zeros_like", "new_empty", "clone", "contiguous"}


def _hit_calls(fn):
    """(Python functions, built-in functions, tensor operations) of one call of ``fn`` after a
    first one (which may build and validate the shape's Problem)."""
    fn()
    with _Calls() as calls:
        fn()
    with _TensorOps() as ops:
        fn()
    builtins = {n[2:] for n in calls.names if n.startswith("c:")}
    return calls.python, builtins, ops.names


def _forbidden(calls) -> set[str]:
    names = set(calls) | {n.rpartition(".")[2] for n in calls}
    return names & FORBIDDEN


@pytest.mark.parametrize("grad_mode", [False, True], ids=["no_grad", "grad_mode_on"])
@pytest.mark.parametrize("forced", [False, True], ids=["tuned", "forced"])
def test_hit_path_calls_little(tuned_hit, grad_mode, forced):
    q, k, v = qkv()
    kwargs = {"backend": tuned_hit.name} if forced else {}
    with torch.set_grad_enabled(grad_mode):
        calls, builtins, ops = _hit_calls(lambda: sparktune.attention(q, k, v, **kwargs))
    assert tuned_hit.calls == 3
    assert not _forbidden(calls) and "warn" not in builtins, calls
    assert sum(calls.values()) <= MAX_PYTHON_CALLS, calls
    assert sum(ops.values()) <= MAX_TENSOR_OPS, ops
    # one allocation: the output the backend writes to
    assert sum(n for name, n in ops.items() if name in ALLOCATIONS) == 1, ops


@pytest.mark.parametrize("backward", ["reference:float32", "torch:math"])
def test_a_repeated_training_call_asks_dispatch_nothing(tuned_hit, monkeypatch, backward):
    """A training call on a hit (the forward's record on the noop backend, the backward's on
    another: sparktune's autograd function, or SDPA's native pair) decides what to run once:
    a repeated call, forward and backward, makes no selection, no Problem and no plan."""
    from sparktune.backends.base import Candidate

    real_select = dispatch.select
    b_name, b_config = backward.split(":")

    class Lse(NoopBackend):
        name = "host-noop"

        def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True):
            self.calls += 1
            out.zero_()
            return torch.zeros(q.shape[:3], dtype=torch.float32)

    registry.register_backend(Lse(), replace=True)

    def select(problem, device=None, **kw):
        if kw.get("backend") is None and problem.op == "bwd":
            return dispatch.Selection(Candidate(b_name, b_config), "tuned")
        return real_select(problem, device, **kw)

    monkeypatch.setattr(dispatch, "select", select)
    dispatch.invalidate_selections()
    q, k, v = (t.requires_grad_() for t in qkv())

    def step():
        out = sparktune.attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    step()
    with _Calls() as calls:
        step()
        step()
    asked = {"select", "_resolve", "native_choice", "_backward_choice", "plan_for",
             "backward_problem", "_forward_ms", "__post_init__"} & {
        n.rpartition(".")[2] for n in calls.python
    }  # fmt: skip
    assert not asked, calls.python


def test_a_repeated_shape_makes_no_problem(tuned_hit, monkeypatch):
    """The first call of a shape validates its Problem once; later calls make none."""
    made = collections.Counter()
    post_init = Problem.__post_init__

    def counting(self):
        made[(self.op, self.seqlen_q)] += 1
        post_init(self)

    monkeypatch.setattr(plan_mod, "_problems", {})
    monkeypatch.setattr(Problem, "__post_init__", counting)
    inputs = [qkv(), qkv((1, 2, 24, 16))]
    for q, k, v in inputs:
        sparktune.attention(q, k, v)
    assert made[("fwd", 16)] == 1 and made[("fwd", 24)] >= 1
    made.clear()
    for _ in range(3):
        for q, k, v in inputs:
            sparktune.attention(q, k, v)
    assert not made


def test_problem_table_is_bounded(monkeypatch):
    monkeypatch.setattr(plan_mod, "_problems", {})
    monkeypatch.setattr(plan_mod, "_PROBLEMS_MAX", 4)
    keys = [(torch.float16, 1, 1, 1, n, n, 8, False, False) for n in range(1, 10)]
    for key in keys:
        p = plan_mod.forward_problem(key)
        assert (p.seqlen_q, p.dtype, p.op) == (key[4], "float16", "fwd")
        assert plan_mod.forward_problem(key) is p
    assert len(plan_mod._problems) <= 4


def test_cuda_device_info_is_read_once_per_device(monkeypatch):
    reads = []

    def from_torch(device):
        reads.append(device)
        return DeviceInfo(f"GPU {device.index}", (9, 0), 132, extra={"index": device.index})

    monkeypatch.setattr(plan_mod, "_cuda_infos", {})
    monkeypatch.setattr(DeviceInfo, "from_torch", staticmethod(from_torch))
    infos = [plan_mod.device_info(torch.device("cuda", i % 2)) for i in range(6)]
    assert [d.name for d in infos] == ["GPU 0", "GPU 1"] * 3
    assert len(reads) == 2
    assert plan_mod.device_info(torch.device("cpu")) is None


def test_torch_backend_returns_sdpa_output_without_a_copy(monkeypatch):
    """On a contiguous output in the caller's layout, attention() returns the tensor SDPA made:
    no second buffer, no copy; in another layout it copies once into a contiguous one."""
    made = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        made.append(out)
        return out

    monkeypatch.setattr(tsdpa.F, "scaled_dot_product_attention", recording)
    q, k, v = qkv((2, 3, 17, 16))
    with torch.no_grad():
        calls, _, ops = _hit_calls(
            lambda: sparktune.attention(q, k, v, backend="torch", config="math")
        )
        out = sparktune.attention(q, k, v, backend="torch", config="math")
    assert out is made[-1] and out.is_contiguous()
    assert not ALLOCATIONS & set(ops) and "copy_" not in ops, ops
    assert not _forbidden(calls), calls  # sdpa_kernel's context manager included
    qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out_n = sparktune.attention(qn, kn, vn, backend="torch", config="math", layout="bnhd")
    assert out_n.is_contiguous() and out_n.shape == qn.shape
    torch.testing.assert_close(out_n.transpose(1, 2), out)


def _flags():
    from torch.nn.attention import _backend_names

    return {n: getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in _backend_names}


def test_torch_backend_auto_forces_nothing(monkeypatch):
    """"auto" is the call a user makes: SDPA runs with the caller's own flags."""
    seen = []

    def fake(*args, **kwargs):
        seen.append((_flags(), kwargs))
        return torch.zeros_like(args[0])

    monkeypatch.setattr(tsdpa.F, "scaled_dot_product_attention", fake)
    q, k, v = qkv()
    torch._C._set_sdp_use_math(False)  # a caller's own setting, kept during the call
    try:
        before = _flags()
        tsdpa.TorchSDPABackend._sdpa(tsdpa.AUTO, q, k, v, False, 0.25)
        k2, v2 = k[:, :1], v[:, :1]
        tsdpa.TorchSDPABackend._sdpa(tsdpa.AUTO, q, k2, v2, True, 0.25)
        assert [flags for flags, _ in seen] == [before, before]
        assert seen[0][1] == {"scale": 0.25}
        assert seen[1][1] == {"scale": 0.25, "is_causal": True, "enable_gqa": True}
        assert _flags() == before
    finally:
        torch._C._set_sdp_use_math(True)


@pytest.mark.parametrize("config", [c for c in tsdpa.CONFIGS if c != tsdpa.AUTO])
def test_torch_backend_forces_sdpa_like_sdpa_kernel(config, monkeypatch):
    """The torch backend sets the same SDPA flags as ``sdpa_kernel(<backend>)`` for the call
    and restores the caller's, also when SDPA raises."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(tsdpa._sdp_backend(config)):
        expected = _flags()
    seen = []

    def fake(*args, **kwargs):
        seen.append(_flags())
        raise RuntimeError("no kernel")

    monkeypatch.setattr(tsdpa.F, "scaled_dot_product_attention", fake)
    q, k, v = qkv()
    torch._C._set_sdp_use_math(False)  # a caller's own setting, to be restored
    try:
        before = _flags()
        with pytest.raises(RuntimeError, match="no kernel"):
            tsdpa.TorchSDPABackend._sdpa(config, q, k, v, False, 0.25)
        assert seen == [expected]
        assert _flags() == before
    finally:
        torch._C._set_sdp_use_math(True)


# -- the fast checks accept exactly what the full checks accept ------------------------------


def _t(*shape, dtype=torch.float16, device="cpu"):
    return (
        torch.randn(*shape, dtype=dtype)
        if device == "cpu"
        else torch.empty(*shape, dtype=dtype, device=device)
    )


_Q, _K = _t(2, 4, 8, 16), _t(2, 2, 8, 16)
INPUTS = [  # (q, k, v, layout)
    (_Q, _K, _K.clone(), "bhnd"),
    (_Q.transpose(1, 2), _K.transpose(1, 2), _K.transpose(1, 2), "bnhd"),
    (_Q, _K, _K, "nbhd"),
    ([[1.0]], _K, _K, "bhnd"),
    (_Q, _K, None, "bhnd"),
    (_t(4, 8, 16), _K, _K, "bhnd"),
    (_Q, _t(2, 2, 8, 16, dtype=torch.bfloat16), _K, "bhnd"),
    (_Q.float(), _K.float(), _K.float(), "bhnd"),
    (_t(3, 4, 8, 16), _K, _K, "bhnd"),
    (_t(2, 4, 8, 32), _K, _K, "bhnd"),
    (_Q, _K, _t(2, 2, 9, 16), "bhnd"),
    (_t(2, 3, 8, 16), _K, _K, "bhnd"),
    (_t(0, 4, 8, 16), _t(0, 2, 8, 16), _t(0, 2, 8, 16), "bhnd"),
    (_Q, _t(2, 2, 0, 16), _t(2, 2, 0, 16), "bhnd"),
    (_t(2, 4, 8, 32)[..., ::2], _K, _K, "bhnd"),
    (_t(2, 4, 8, 2)[..., ::2], _t(2, 2, 8, 2)[..., ::2], _t(2, 2, 8, 1), "bhnd"),  # size-1 dim
    (_Q, _t(2, 2, 8, 16, device="meta"), _K, "bhnd"),
    (_t(2, 8, 4, 16), _t(2, 8, 2, 16), _t(2, 8, 2, 16), "bnhd"),
    (_t(2, 8, 3, 16), _t(2, 8, 2, 16), _t(2, 8, 2, 16), "bnhd"),
    (torch.nn.Parameter(_Q), _K, _K, "bhnd"),
]


@pytest.mark.parametrize("q,k,v,layout", INPUTS, ids=range(len(INPUTS)))
def test_fast_checks_agree_with_full_checks(q, k, v, layout):
    """What the fast checks accept, the full checks accept too, with the same sizes; what
    they leave undecided goes to the full checks, which raise and say why (or accept)."""
    sizes = checks.quick_sizes(q, k, v, layout)
    try:
        qb, kb, _ = checks.check_inputs(q, k, v, layout)
    except (TypeError, ValueError):
        assert sizes is None  # the full checks raise, and say why
        return
    if sizes is not None:
        b, hq, nq, d = qb.shape
        assert sizes == (b, hq, kb.shape[1], nq, kb.shape[2], d, q.dtype, q.device)


def test_common_inputs_take_the_fast_checks():
    for q, k, v, layout in INPUTS[:2] + INPUTS[17:18] + INPUTS[19:]:
        assert checks.quick_sizes(q, k, v, layout) is not None


def test_cached_hashes_are_the_dataclass_hashes_and_are_not_pickled():
    p = Problem("fwd", "bfloat16", 2, 8, 2, 17, 33, 64, True, True)
    off = (-1, -1, False, False, False, False, False, 0, 0, 0, 0)  # the features (docs/FEATURES.md) and decode fields
    assert hash(p) == hash(("fwd", "bfloat16", 2, 8, 2, 17, 33, 64, True, True, *off))
    assert hash(p.replace(op="bwd")) == hash(("bwd", "bfloat16", 2, 8, 2, 17, 33, 64, True, True, *off))
    w = p.replace(window_left=5, softcap=True)
    assert hash(w) == hash(("fwd", "bfloat16", 2, 8, 2, 17, 33, 64, True, True, 5, -1, True, *off[3:]))
    d = DeviceInfo("GPU", (9, 0), 132, "580", "13.0", extra={"index": 3})
    assert hash(d) == hash(("GPU", (9, 0), 132, "580", "13.0"))
    for obj in (p, d):
        state = obj.__reduce_ex__(2)[2]
        assert "_hash" not in state
        again = pickle.loads(pickle.dumps(obj))
        assert again == obj and hash(again) == hash(obj)
    assert pickle.loads(pickle.dumps(d)).extra == {"index": 3}


# -- the hit table: a repeated call reuses its first call's work, and only while valid ------


class RunnerBackend(NoopBackend):
    """Writes a known output; its forward_runner makes the same output, or (``wrong``) another."""

    name = "host-runner"

    def __init__(self, wrong=False):
        super().__init__()
        self.wrong = wrong
        self.runs = 0

    def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True):
        self.calls += 1
        out.fill_(1.0)
        return torch.zeros(q.shape[:3]) if need_lse else None

    def forward_runner(self, q, k, v, out, *, config, causal, scale, need_lse=True):
        shape, stride = out.shape, out.stride()

        def run(q, k, v):
            self.runs += 1
            o = torch.empty_strided(shape, stride, dtype=q.dtype)
            return o.fill_(2.0 if self.wrong else 1.0), torch.zeros(q.shape[:3]) if need_lse else None

        return run


@pytest.fixture
def runner_backend():
    made = []

    def make(wrong=False):
        b = RunnerBackend(wrong)
        registry.register_backend(b, replace=True)
        made.append(b)
        return b

    yield make
    for b in made:
        registry.unregister_backend(b.name)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_a_hit_runs_the_backends_runner_when_it_reproduces_forward(runner_backend, layout):
    b = runner_backend()
    q, k, v = qkv((2, 3, 17, 16))
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    first = sparktune.attention(q, k, v, backend=b.name, layout=layout)
    assert (b.calls, b.runs) == (1, 1)  # the runner ran once, to be compared
    for _ in range(3):
        out = sparktune.attention(q, k, v, backend=b.name, layout=layout)
    assert (b.calls, b.runs) == (1, 4)
    assert out.shape == q.shape and out.is_contiguous() and torch.equal(out, first)


def test_a_runner_that_differs_from_forward_is_not_used(runner_backend):
    b = runner_backend(wrong=True)
    q, k, v = qkv()
    for _ in range(3):
        out = sparktune.attention(q, k, v, backend=b.name)
        assert torch.equal(out, torch.ones_like(out))
    assert (b.calls, b.runs) == (3, 1)


def test_a_hit_counts_and_skips_dispatch(tuned_hit, monkeypatch):
    q, k, v = qkv()
    sparktune.attention(q, k, v)
    dispatch.reset_counters()
    selects = []
    real = dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda *a, **kw: selects.append(a) or real(*a, **kw))
    for _ in range(4):
        sparktune.attention(q, k, v)
    assert not selects
    assert dispatch.counters()["tuned"] == 4
    assert tuned_hit.calls == 5


def test_hits_are_forgotten_when_dispatch_forgets(tuned_hit, monkeypatch):
    q, k, v = qkv()
    sparktune.attention(q, k, v)
    assert tuned_hit.calls == 1
    dispatch.configure(None)  # no tuned record now: the heuristic default (torch math)
    out = sparktune.attention(q, k, v)
    assert tuned_hit.calls == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=2e-3, rtol=2e-2)
    assert dispatch.counters()["default"] >= 1


def test_registering_a_backend_forgets_hits(tuned_hit, runner_backend):
    q, k, v = qkv()
    sparktune.attention(q, k, v)
    generation = dispatch.generation
    runner_backend()
    assert dispatch.generation != generation
    calls = tuned_hit.calls
    sparktune.attention(q, k, v)
    assert tuned_hit.calls == calls + 1


def test_a_hit_never_accepts_what_the_checks_refuse():
    q, k, v = qkv()
    sparktune.attention(q, k, v, scale=1.0)
    with pytest.raises(TypeError, match="scale must be a real number"):
        sparktune.attention(q, k, v, scale=True)  # equal to 1.0 as a key, but refused
    with pytest.raises(TypeError, match="same dtype"):
        sparktune.attention(q, k.bfloat16(), v, scale=1.0)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        sparktune.attention(q, k, v, scale=float("nan"))


def test_hit_table_is_bounded(monkeypatch):
    saved = dict(hits_mod.table)
    hits_mod.table.clear()  # the one table, which attention() reads directly
    monkeypatch.setattr(hits_mod, "_HITS_MAX", 3)
    for n in range(1, 8):
        sparktune.attention(*qkv((1, 1, n, 8)))
        assert len(hits_mod.table) <= 3
    hits_mod.table.clear()
    hits_mod.table.update(saved)


# -- on a GPU: hits through the backends' runners give what the first call gave ---------------


def _gpu_configs():
    configs = [("torch", c) for c in tsdpa.CONFIGS]
    try:
        from sparktune.backends.spark import load_extension

        mod, _ = load_extension()
    except Exception:  # noqa: BLE001
        mod = None
    if mod is not None:
        names = sorted(
            k["name"] for k in mod.kernels() if k["name"].startswith("fwd_sm80_f16_d64_")
        )
        configs += [("spark", n) for n in names[:2]]
    return configs


@pytest.mark.gpu
@pytest.mark.parametrize("backend,config", _gpu_configs(), ids=lambda x: str(x))
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize(
    "shape,causal", [((2, 4, 4, 33, 33), True), ((1, 8, 2, 40, 70), False)], ids=["causal", "gqa"]
)
def test_gpu_hits_match_the_first_call(backend, config, layout, shape, causal):
    from sparktune.dispatch import NoKernelError
    from tests._oracle import assert_close_to_reference

    b, hq, hk, nq, nk = shape
    d = 64

    def make(h, n):
        t = torch.randn(b, h, n, d, dtype=torch.float16, device="cuda")
        return t if layout == "bhnd" else t.transpose(1, 2).contiguous()

    def views(*ts):
        return [t if layout == "bhnd" else t.transpose(1, 2) for t in ts]

    kw = {"backend": backend, "config": config, "causal": causal, "layout": layout}
    q, k, v = make(hq, nq), make(hk, nk), make(hk, nk)
    try:
        first = sparktune.attention(q, k, v, **kw)
    except NoKernelError as exc:
        pytest.skip(str(exc).splitlines()[0])
    key_hits = len(hits_mod.table)
    again = sparktune.attention(q, k, v, **kw)
    assert torch.equal(again, first)
    for _ in range(2):  # new inputs, same shapes and strides: hits
        q, k, v = make(hq, nq), make(hk, nk), make(hk, nk)
        out, lse = sparktune.attention(q, k, v, return_lse=True, **kw)
        out2 = sparktune.attention(q, k, v, **kw)
        assert torch.equal(out, out2)
        assert out2.shape == q.shape
        if layout == "bnhd":
            assert out2.is_contiguous()
        assert_close_to_reference(
            *views(out2, q, k, v), causal=causal, lse=lse, what=f"{backend}:{config} hit"
        )
    assert len(hits_mod.table) >= key_hits
    # a view whose data pointer is not 16-byte aligned, with the same strides: the general path
    big = [torch.randn(t.numel() + 8, dtype=t.dtype, device="cuda") for t in (q, k, v)]
    shifted = [
        x[1 : 1 + t.numel()].view(t.shape) if t.is_contiguous() else None
        for x, t in zip(big, (q, k, v), strict=True)
    ]
    if all(s is not None for s in shifted):
        try:
            out3 = sparktune.attention(*shifted, **kw)
        except ValueError as exc:  # spark kernels refuse misaligned rows, and say so
            assert backend == "spark" and "16-byte aligned" in str(exc)
        else:
            assert_close_to_reference(
                *views(out3, *shifted), causal=causal, what=f"{backend}:{config} misaligned"
            )


def test_unhashable_arguments_take_the_full_path():
    q, k, v = qkv()
    out = sparktune.attention(q, k, v, causal=[])  # falsy, as bool() reads it; not a key
    torch.testing.assert_close(out, sparktune.attention(q, k, v), atol=0, rtol=0)


def test_a_training_call_then_inference_calls_get_the_runner(runner_backend):
    b = runner_backend()
    q, k, v = qkv((1, 2, 9, 16))
    qg = q.clone().requires_grad_()
    dispatch.reset_counters()
    out = sparktune.attention(qg, k, v, backend=b.name)
    with pytest.warns(RuntimeWarning, match="reference math"):  # it has no backward
        out.sum().backward()
    assert qg.grad is not None
    with torch.no_grad():
        for _ in range(3):
            sparktune.attention(q, k, v, backend=b.name)
    assert (b.calls, b.runs) == (2, 3)  # training forward, first inference; then the runner
    assert dispatch.counters()["forced"] >= 4


def test_bnhd_hits_are_contiguous_in_bnhd_for_backends_with_their_own_layout():
    q, k, v = (t.transpose(1, 2).contiguous() for t in qkv((2, 3, 17, 16)))
    for _ in range(3):  # first call, then hits through the torch backend's runner
        out = sparktune.attention(q, k, v, layout="bnhd", backend="torch", config="math")
        assert out.shape == q.shape and out.is_contiguous()

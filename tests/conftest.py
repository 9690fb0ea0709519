import dataclasses
import os
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# every test run compiles into its own cache folder, so results never depend on an earlier run's cache; pytest-xdist
# workers inherit the controller's environment, so all of a run's workers share one folder (and its compiled kernels)
os.environ.setdefault("NVFLY_CACHE_DIR", tempfile.mkdtemp(prefix="nvfly-test-cache-"))

# hypothesis: the same examples on every run (CI must not flake on a new draw), no example database in the tree.
# ``--hypothesis-profile=thorough`` (docs/testing.md): 1000 random examples where a test does not set its own count.
try:
    from hypothesis import settings as _hsettings

    _hsettings.register_profile("default", derandomize=True, database=None, deadline=None)
    _hsettings.register_profile("thorough", max_examples=1000, deadline=None)
    _hsettings.load_profile("default")
except ImportError:  # the test extra is not installed: pytest fails on the test modules' imports anyway
    pass


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow: every instance of a sweep, the long tests (NVFLY_SLOW=1 "
                          "does the same); see docs/testing.md")


def _run_slow(config) -> bool:
    return config.getoption("--run-slow") or os.environ.get("NVFLY_SLOW", "") not in ("", "0")


def _value(v):
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


def _greedy_cover(covers: list) -> set:
    """Indices of a subset of ``covers`` (sets) whose union is theirs: the one covering most that is still
    uncovered first, ties to the earliest; deterministic."""
    todo = set().union(*covers) if covers else set()
    chosen: set = set()
    while todo:
        best = max(range(len(covers)), key=lambda i: (len(covers[i] & todo), -i))
        chosen.add(best)
        todo -= covers[best]
    return chosen


def _axes_tuples(axes, pairs: bool) -> set:
    axes = sorted(axes, key=repr)
    got = {(ax,) for ax in axes}
    if pairs:
        got |= {(a, b) for i, a in enumerate(axes) for b in axes[i + 1:]}
    return got


def _covering_sample(items, pairs: bool) -> set:
    """Indices of a deterministic subset of one test's parametrized instances such that every value of every
    parameter occurs (and, with ``pairs``, every pair of values of two parameters that occurs in the sweep)."""
    value = _value

    def tuples(item):
        params = item.callspec.params
        groups = []  # the arguments of one parametrize call form one axis ("m,n,k": a shape)
        for mark in item.iter_markers("parametrize"):
            names = mark.args[0] if mark.args else mark.kwargs["argnames"]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
            if all(n in params for n in names):
                groups.append(tuple(names))
        grouped = {n for g in groups for n in g}
        groups += [(n,) for n in params if n not in grouped]  # parametrized fixtures
        return _axes_tuples([(g, tuple(value(params[n]) for n in g)) for g in groups], pairs)
    return _greedy_cover([tuples(item) for item in items])


@pytest.fixture
def config_sample(request):
    """For a test that loops over a config space itself (every config of a benchmark sweep, every tile shape):
    ``config_sample(configs)`` is all of them under --run-slow, else a covering sample in their order, in which
    every value of every field (of dataclass configs; of a tuple's items; or the value itself) occurs;
    ``pairs=True``: every pair of values of two fields."""
    full = _run_slow(request.config)

    def sample(configs, pairs: bool = False) -> list:
        configs = list(configs)
        if full:
            return configs

        def fields(cfg):
            if dataclasses.is_dataclass(cfg):
                return [(f.name, _value(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)]
            if isinstance(cfg, tuple):
                return [(i, _value(v)) for i, v in enumerate(cfg)]
            return [(0, _value(cfg))]
        keep = _greedy_cover([_axes_tuples(fields(cfg), pairs) for cfg in configs])
        return [cfg for i, cfg in enumerate(configs) if i in keep]
    return sample


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # sweeps: the instances outside the covering sample become slow (tryfirst: before ``-m`` selects on marks)
    groups: dict = {}
    for item in items:
        mark = item.get_closest_marker("sweep")
        if mark is not None and hasattr(item, "callspec"):
            groups.setdefault(item.nodeid.split("[")[0], (mark, []))[1].append(item)
    for mark, group in groups.values():
        keep = _covering_sample(group, pairs=mark.kwargs.get("pairs", True))
        for i, item in enumerate(group):
            if i not in keep:
                item.add_marker(pytest.mark.slow)
    if not _run_slow(config):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    if _run_slow(config):
        return "nvfly: slow tests included (--run-slow / NVFLY_SLOW=1)"
    return "nvfly: slow tests (whole sweeps, long tests) deselected; --run-slow runs them (docs/testing.md)"


def _gpu_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    import nvfly
    if not nvfly.gpu_available():
        return "CUDA driver unusable by nvfly"
    return None


@pytest.fixture
def recorded_launches(monkeypatch):
    """Kernels 'launch' on CPU tensors: the real binder and generated launch code (``nvfly.Kernel._prepare``
    replaced), and a cuLaunchKernel (and cuLaunchKernelEx) that records (kernel name, grid, packed parameters) in
    the list yielded."""
    import ctypes
    import gc
    import struct
    import types
    from nvfly.runtime.launcher import _layout, make_launch, make_prepared_launch, normalize_dim3

    def prepare(self, bound, block, cluster):
        specs, device = self.specs(bound, need_cuda=False)
        compiled = self.compiled_for(specs, normalize_dim3(block, "block"), None, "sm_90a")
        fmt, _, size = _layout(compiled.abi)
        raw = ctypes.create_string_buffer(size)
        local = types.SimpleNamespace()

        def buffers():
            local.bufs = (raw, 0)
            return local.bufs

        def cu(*args):
            launches.append((compiled.name, args[1:4], struct.unpack(fmt, raw.raw)))
            return 0

        def launch_ex(grid, stream, params):  # cluster and cooperative launches (cuLaunchKernelEx)
            launches.append((compiled.name, tuple(grid), struct.unpack(fmt, raw.raw)))
        obj = types.SimpleNamespace(device=device, compiled=compiled)
        obj.launch = make_launch(compiled, fmt, 1, cu, local, buffers, device, None, launch_ex)
        obj.prepared = lambda grid, raw_args, so, cs, bp, fb: make_prepared_launch(
            compiled, fmt, 1, cu, local, buffers, device, None, launch_ex, grid, raw_args, so, cs, bp, fb)
        return obj
    import nvfly
    from nvfly.runtime import torch_args
    launches: list = []
    # launchers cached on kernels by earlier tests would record into those tests' lists
    for kernel in (obj for obj in gc.get_objects() if type(obj) is nvfly.Kernel):
        monkeypatch.setattr(kernel, "_fast", {})
    monkeypatch.setattr(nvfly.Kernel, "_prepare", prepare)
    monkeypatch.setattr(torch_args, "current_stream", lambda device: 0)
    return launches


@pytest.fixture
def aten_max_autotune():
    """Inductor's max-autotune on CPU with only ATen (and nvfly, once installed) to choose from: nothing reused from
    caches, no decisions left from before; nvfly uninstalled afterwards."""
    import torch
    from torch._inductor import config as inductor_config

    import nvfly.torch
    from nvfly.torch.gemm_ops import clear_decisions
    torch._dynamo.reset()
    clear_decisions()
    patches = {"max_autotune_gemm_backends": "ATEN", "fx_graph_cache": False, "autotune_local_cache": False}
    with inductor_config.patch(patches):
        yield
    nvfly.torch.uninstall()
    torch._dynamo.reset()


@pytest.fixture
def hopper():
    import torch
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        pytest.skip("needs an sm_90 (Hopper) GPU")


def pytest_sessionfinish(session, exitstatus):
    """With NVFLY_TEST_REPORT=path, write what ran and how it ended (kept in benchmarks/results for GPU runs)."""
    path = os.environ.get("NVFLY_TEST_REPORT")
    if not path or hasattr(session.config, "workerinput"):
        return  # under pytest-xdist only the controller writes: its terminal reporter holds every worker's results
    import datetime
    import json
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    outcomes, failures = {}, {}
    for key in ("passed", "failed", "skipped", "error"):
        for rep in reporter.stats.get(key, []) if reporter else []:
            if getattr(rep, "when", "call") in ("call", "setup"):
                outcomes[rep.nodeid] = key
                if key in ("failed", "error"):
                    failures[rep.nodeid] = str(rep.longrepr)[-3000:]  # the tail: the assertion or the exception
    try:
        import torch
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        torch_version = torch.__version__
    except ImportError:
        gpu, torch_version = None, None
    doc = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "gpu": gpu, "torch": torch_version,
                    "command": " ".join(["python -m pytest", *session.config.invocation_params.args]),
                    "commit": os.environ.get("NVFLY_COMMIT")},
           "summary": {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped",
                                                                                "error")},
           "tests": outcomes, "failures": failures}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)

import os
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# every test run compiles into its own cache folder, so results never depend on an earlier run's cache
os.environ.setdefault("NVFLY_CACHE_DIR", tempfile.mkdtemp(prefix="nvfly-test-cache-"))


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


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
def hopper():
    import torch
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        pytest.skip("needs an sm_90 (Hopper) GPU")


def pytest_sessionfinish(session, exitstatus):
    """With NVFLY_TEST_REPORT=path, write what ran and how it ended (kept in benchmarks/results for GPU runs)."""
    path = os.environ.get("NVFLY_TEST_REPORT")
    if not path:
        return
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
                    "gpu": gpu, "torch": torch_version, "command": " ".join(sys.argv),
                    "commit": os.environ.get("NVFLY_COMMIT")},
           "summary": {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped",
                                                                                "error")},
           "tests": outcomes, "failures": failures}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)

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

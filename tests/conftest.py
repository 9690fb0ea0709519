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

"""The compile cache: hits skip tracing and lowering, keys change with what changes the code, corrupt entries are
rebuilt, and several processes can fill one cache at once."""
import json
import os
import subprocess
import sys

import pytest
import torch

import nvfly
from nvfly.compiler.cache import DiskCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X = torch.randn(4096)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NVFLY_CACHE_DIR", str(tmp_path))
    return tmp_path


def fresh_add_kernel():
    """A new kernel object for the same function: what a new process sees."""
    from examples import vector_add
    return nvfly.Kernel(vector_add.add_kernel.fn)


def test_memory_hit_does_not_retrace(cache_dir):
    k = fresh_add_kernel()
    a = k.compile(X, X, X, 4096, BLOCK=128)
    b = k.compile(X, X, X, 4096, BLOCK=128)
    assert a is b
    assert (k.stats.traced, k.stats.lowered) == (1, 1)


def test_dynamic_shapes_share_one_binary(cache_dir):
    k = fresh_add_kernel()
    a = k.compile(X, X, X, 4096, BLOCK=128)
    y = torch.randn(8192)
    b = k.compile(y, y, y, 8192, BLOCK=128)
    assert a is b and k.stats.traced == 1
    # a length that is not a multiple of 16 is a different fact: a new specialisation
    z = torch.randn(1001)
    c = k.compile(z, z, z, 1001, BLOCK=128)
    assert c is not a and k.stats.traced == 2


def test_disk_hit_in_a_new_kernel_object_skips_trace_and_lowering(cache_dir):
    first = fresh_add_kernel().compile(X, X, X, 4096, BLOCK=128)
    k = fresh_add_kernel()
    again = k.compile(X, X, X, 4096, BLOCK=128)
    assert (k.stats.traced, k.stats.lowered, k.stats.disk_hits) == (0, 0, 1)
    assert again.cubin == first.cubin and again.key == first.key and again.abi == first.abi


def test_key_changes_with_constexpr_and_target(cache_dir):
    k = fresh_add_kernel()
    a = k.compile(X, X, X, 4096, BLOCK=128)
    b = k.compile(X, X, X, 4096, BLOCK=256)
    c = k.compile(X, X, X, 4096, BLOCK=128, target="sm_80")
    assert len({a.key, b.key, c.key}) == 3


def test_corrupt_entry_is_detected_and_rebuilt(cache_dir):
    first = fresh_add_kernel().compile(X, X, X, 4096, BLOCK=128)
    entry = cache_dir / "v1" / "bin" / first.key[:2] / first.key
    cubin = entry / "kernel.cubin"
    data = bytearray(cubin.read_bytes())
    data[100] ^= 0xFF
    cubin.write_bytes(bytes(data))
    k = fresh_add_kernel()
    again = k.compile(X, X, X, 4096, BLOCK=128)
    assert k.stats.lowered == 1 and k.stats.disk_hits == 0
    assert again.cubin == first.cubin
    # the rebuilt entry is whole again
    assert DiskCache(str(cache_dir)).get(first.key)["kernel.cubin"] == first.cubin


def test_truncated_checksums_are_a_miss(cache_dir):
    first = fresh_add_kernel().compile(X, X, X, 4096, BLOCK=128)
    (cache_dir / "v1" / "bin" / first.key[:2] / first.key / "checksums.json").write_text("{")
    assert DiskCache(str(cache_dir)).get(first.key) is None


def test_disabled_disk_cache_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("NVFLY_DISK_CACHE", "0")
    fresh_add_kernel().compile(X, X, X, 4096, BLOCK=128)
    assert not (cache_dir / "v1").exists()


def test_spec_index_points_at_an_existing_binary(cache_dir):
    first = fresh_add_kernel().compile(X, X, X, 4096, BLOCK=128)
    specs = list((cache_dir / "v1" / "spec").rglob("*.json"))
    assert len(specs) == 1
    assert json.loads(specs[0].read_text())["ir_key"] == first.key


_WORKER = """
import sys, torch, nvfly
sys.path.insert(0, {root!r})
from examples import vector_add
x = torch.randn(4096)
k = nvfly.Kernel(vector_add.add_kernel.fn)
c = k.compile(x, x, x, 4096, BLOCK={block})
print(c.key, len(c.cubin))
"""


def test_concurrent_processes_fill_one_cache(cache_dir):
    env = dict(os.environ, NVFLY_CACHE_DIR=str(cache_dir))
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER.format(root=ROOT, block=64 * (1 + i % 2))],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(6)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    keys = {out.split()[0] for out, _ in outs}
    assert len(keys) == 2  # two block sizes, two kernels
    entries = list((cache_dir / "v1" / "bin").glob("*/*"))
    assert sorted(e.name for e in entries) == sorted(keys)
    assert not any((cache_dir / "v1" / "tmp").iterdir())
    for key in keys:
        assert DiskCache(str(cache_dir)).get(key) is not None


def test_fingerprint_follows_helper_sources(tmp_path, monkeypatch):
    from nvfly.frontend.fingerprint import fingerprint
    mod = tmp_path / "user_kernels.py"
    src = ("import nvfly\n\nSCALE = {scale}\n\n@nvfly.func\ndef helper(v):\n    return v * {factor}\n\n"
           "def kern(x: nvfly.Tensor):\n    x[0] = helper(x[0]) * SCALE\n")
    prints = []
    for scale, factor in ((2, 3), (2, 4), (5, 4)):
        mod.write_text(src.format(scale=scale, factor=factor))
        monkeypatch.syspath_prepend(str(tmp_path))
        sys.modules.pop("user_kernels", None)
        import user_kernels
        prints.append(fingerprint(user_kernels.kern))
    assert None not in prints and len(set(prints)) == 3


def test_a_cooperative_kernel_has_its_own_key_and_keeps_the_flag_on_disk(cache_dir):
    """``nvfly.cooperative()`` changes how the kernel is launched, not its IR: the flag is part of the key (the same
    body without it is another binary) and of the cached metadata, also when served from disk without a trace."""

    def body(x: nvfly.Tensor, n: nvfly.i32, COOPERATIVE: nvfly.Constexpr):
        if COOPERATIVE:
            nvfly.cooperative()
        i = nvfly.block_idx.x * 128 + nvfly.thread_idx.x
        if i < n:
            x[i] = x[i] * 2.0

    plain = nvfly.Kernel(body).compile(X, 4096, COOPERATIVE=False)
    together = nvfly.Kernel(body).compile(X, 4096, COOPERATIVE=True)
    assert together.cooperative and not plain.cooperative
    assert together.ptx.replace(together.name, "") == plain.ptx.replace(plain.name, "") and together.key != plain.key
    k = nvfly.Kernel(body)
    again = k.compile(X, 4096, COOPERATIVE=True)
    assert k.stats.disk_hits == 1 and k.stats.traced == 0 and again.cooperative and again.key == together.key

"""The compile cache: hits skip tracing and lowering, keys change with what changes the code, corrupt entries are
rebuilt, and several processes can fill one cache at once."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

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
    from nvfly.examples import vector_add
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
from nvfly.examples import vector_add
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


def test_a_dependent_kernel_keeps_its_launch_flag_on_disk(cache_dir):
    """``nvfly.wait_prior_grid()`` emits ``griddepcontrol.wait`` and marks the kernel for a programmatic dependent
    launch; the flag survives the disk cache (served without a trace). ``launch_dependents`` only emits its
    instruction."""

    def body(x: nvfly.Tensor, n: nvfly.i32, DEPENDENT: nvfly.Constexpr):
        nvfly.launch_dependents()
        if DEPENDENT:
            nvfly.wait_prior_grid()
        i = nvfly.block_idx.x * 128 + nvfly.thread_idx.x
        if i < n:
            x[i] = x[i] * 2.0

    plain = nvfly.Kernel(body).compile(X, 4096, DEPENDENT=False)
    dependent = nvfly.Kernel(body).compile(X, 4096, DEPENDENT=True)
    assert dependent.dependent and not plain.dependent and dependent.key != plain.key
    assert "griddepcontrol.wait;" in dependent.ptx and "griddepcontrol.wait;" not in plain.ptx
    assert "griddepcontrol.launch_dependents;" in plain.ptx
    k = nvfly.Kernel(body)
    again = k.compile(X, 4096, DEPENDENT=True)
    assert k.stats.disk_hits == 1 and k.stats.traced == 0 and again.dependent and again.key == dependent.key


# ---------------------------------------------------------------------------------------------- names
# A CompiledKernel's name is the cubin entry point a launch looks up, so kernels of one source under different names
# must never be served each other's binary, from memory, from disk, or across processes.
_TWIN_SOURCE = """import nvfly


def twin(x: nvfly.Tensor, n: nvfly.i32):
    i = nvfly.block_idx.x * 128 + nvfly.thread_idx.x
    if i < n:
        x[i] = x[i] * 2.0
"""


def write_twins(folder: os.PathLike) -> str:
    """Two modules of one text, so two distinct functions of identical source (and ``__qualname__``)."""
    os.makedirs(folder, exist_ok=True)
    for module in ("twin_a", "twin_b"):
        with open(os.path.join(folder, module + ".py"), "w") as f:
            f.write(_TWIN_SOURCE)
    return str(folder)


def twin_kernels(folder: str) -> list[nvfly.Kernel]:
    """New kernel objects: one function under two names, the other function of the same text under a third name
    and under its own."""
    a, b = (_load(os.path.join(folder, module + ".py"), module).twin for module in ("twin_a", "twin_b"))
    return [nvfly.Kernel(a, name="alpha"), nvfly.Kernel(a, name="beta"), nvfly.Kernel(b, name="gamma"),
            nvfly.Kernel(b)]


def _load(path: str, module: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(module, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def compiled_names(kernels: list[nvfly.Kernel]) -> dict[str, dict]:
    """For each kernel's name: its compiled kernel's name, its PTX's entry points and its key."""
    out = {}
    for k in kernels:
        c = k.compile(X, 4096, block=128)
        out[k.name] = {"name": c.name, "entries": re.findall(r"\.entry\s+(\w+)", c.ptx), "key": c.key}
    return out


def assert_own_names(compiled: dict[str, dict]) -> None:
    assert sorted(compiled) == ["alpha", "beta", "gamma", "twin"]
    for name, c in compiled.items():
        assert (c["name"], c["entries"]) == (name, [name])
    assert len({c["key"] for c in compiled.values()}) == len(compiled)


def test_same_source_under_different_names_keeps_each_name(cache_dir, tmp_path):
    from nvfly.frontend.fingerprint import fingerprint
    folder = write_twins(tmp_path / "src")
    kernels = twin_kernels(folder)
    assert len({fingerprint(k.fn) for k in kernels}) == 1  # the premise: one source text for all four
    first = compiled_names(kernels)
    assert_own_names(first)
    # new objects in the other order: each is a spec-hash disk hit (no trace), still under its own name
    fresh = twin_kernels(folder)[::-1]
    assert compiled_names(fresh) == first
    assert all((k.stats.traced, k.stats.disk_hits) == (0, 1) for k in fresh)


_NAMES_WORKER = """
import json, sys
sys.path.insert(0, {root!r})
from tests.test_cache import compiled_names, twin_kernels
kernels = twin_kernels({folder!r})
print(json.dumps(compiled_names(kernels[{shift}:] + kernels[:{shift}])))
"""


def test_concurrent_processes_keep_each_names_binary(cache_dir, tmp_path):
    folder = write_twins(tmp_path / "src")
    env = dict(os.environ, NVFLY_CACHE_DIR=str(cache_dir))
    procs = [subprocess.Popen([sys.executable, "-c", _NAMES_WORKER.format(root=ROOT, folder=folder, shift=i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]  # each compiles the four in another order
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [json.loads(out) for out, _ in outs]
    for compiled in results:
        assert_own_names(compiled)
    assert all(compiled == results[0] for compiled in results)
    # what the processes left on disk serves new objects here by spec hash, each under its own name
    fresh = twin_kernels(folder)
    assert compiled_names(fresh) == results[0]
    assert all((k.stats.traced, k.stats.disk_hits) == (0, 1) for k in fresh)

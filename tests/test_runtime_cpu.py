"""Host-side runtime pieces that need no GPU: argument binding, parameter layout, conversions, TMA checks."""
import struct

import pytest
import torch

import nvfly
from nvfly.frontend.function import AbiParam
from nvfly.runtime.launcher import _layout, bf16_bits, make_binder, normalize_dim3
from nvfly.runtime.tma import check_tma_layout
from nvfly.runtime.torch_args import auto_key


def test_binder_keys_follow_specs_not_values():
    bind = make_binder(["tensor", "scalar", "constexpr", "auto"], auto_key)
    x = torch.randn(64)
    k1, raw = bind((x, 32, "fast", 7))
    assert raw[0] == (x.data_ptr(), x.shape, x.stride()) and raw[1] == 32 and raw[3] == 7
    k2, _ = bind((x, 48, "fast", 23))   # 32 and 48 are both multiples of 16; 7 and 23 share their low 4 bits
    assert k1 == k2
    assert bind((x, 33, "fast", 7))[0] != k1            # 33 is odd
    assert bind((x, 32, "slow", 7))[0] != k1            # a constexpr changes the key
    assert bind((x, 32 + (1 << 32), "fast", 7))[0] != k1  # no longer fits in i32
    assert bind((x[1:], 32, "fast", 7))[0] != k1        # the base address loses its 16-byte alignment
    assert bind((torch.randn(128), 32, "fast", 7))[0] != k1  # another shape: another fast key


def test_binder_rejects_wrong_kinds_by_raising():
    bind = make_binder(["tensor"], auto_key)
    with pytest.raises(AttributeError):
        bind((3,))


def test_parameter_layout_aligns_each_parameter():
    abi = [AbiParam("int", "i32", (0, "value")), AbiParam("ptr", None, (1, "ptr")),
           AbiParam("float", "f16", (2, "value")), AbiParam("tma", None, (3, "tma")),
           AbiParam("int", "i64", (4, "value"))]
    fmt, offsets, size = _layout(abi)
    assert offsets == [0, 8, 16, 64, 192]
    assert size == 200 and struct.calcsize(fmt) == 200


def test_bf16_bits_round_to_nearest_even():
    for v in [0.0, 1.0, -2.5, 3.14159, 1e-20, 65504.0, float("inf")]:
        expected = torch.tensor(v, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
        assert bf16_bits(v) == expected


def test_normalize_dim3():
    assert normalize_dim3(5, "grid") == (5, 1, 1)
    assert normalize_dim3((2, 3), "grid") == (2, 3, 1)
    with pytest.raises(ValueError, match="grid must be"):
        normalize_dim3((1, 2, 3, 4), "grid")
    with pytest.raises(ValueError, match="must not be negative"):
        normalize_dim3(-1, "block")


@pytest.mark.parametrize("shape,stride,address,box,swizzle,message", [
    ((64, 64), (64, 1), 8, (64, 64), 128, "16-byte aligned base address"),
    ((64, 64), (1, 64), 0, (64, 64), 128, "last dimension contiguous"),
    ((64, 63), (63, 1), 0, (64, 64), 128, "multiple of 16 bytes"),
    ((64, 64), (64, 1), 0, (64, 128), 128, "at most 128 bytes"),
    ((64, 64), (64, 1), 0, (300, 64), 128, "box extents must be 1..256"),
    ((64, 64), (64, 1), 0, (64, 4), 0, "span a multiple of 16 bytes"),
])
def test_tma_rules_are_explained(shape, stride, address, box, swizzle, message):
    with pytest.raises(nvfly.LaunchError, match=message):
        check_tma_layout("a", nvfly.bf16, shape, stride, address, box, swizzle)


def test_tma_descriptor_for_compiling_only():
    desc = nvfly.TmaDescriptor(nvfly.TensorDesc(nvfly.bf16, (256, 128)), (64, 64))
    assert desc.raw is None and desc.info.box_bytes == 64 * 64 * 2


class _Buffers:
    """Parameter buffers like Launcher._buffers, without a GPU."""

    def __init__(self, size):
        import ctypes
        self.raw = ctypes.create_string_buffer(size)
        self.local = type("Local", (), {})()

    def __call__(self):
        self.local.bufs = (self.raw, 1234)
        return self.local.bufs


def test_generated_launch_packs_parameters_and_adopts_a_context_once():
    from nvfly.compiler.artifact import CompiledKernel
    from nvfly.runtime.launcher import make_launch
    abi = [AbiParam("ptr", None, (0, "ptr")), AbiParam("int", "i32", (0, ("shape", 0))),
           AbiParam("float", "bf16", (1, "value"))]
    k = CompiledKernel("k", "sm_90a", "key", abi, (128, 1, 1), None, 0, "", "", "", None)
    fmt, _, size = _layout(abi)
    calls, adopted = [], []
    statuses = iter([201, 0])  # first call: no context on this thread

    def cu_launch(*args):
        calls.append(args)
        return next(statuses)

    buffers = _Buffers(size)
    launch = make_launch(k, fmt, 77, cu_launch, buffers.local, buffers, 3, adopted.append, None)
    launch((5, 1, 1), 99, ((0xABC0, (1000,), (1,)), 1.5))
    assert adopted == [3] and len(calls) == 2
    assert calls[0] == (77, 5, 1, 1, 128, 1, 1, 0, 99, 1234, None)
    assert struct.unpack(fmt, buffers.raw.raw) == (0xABC0, 1000, bf16_bits(1.5))


def test_cluster_cooperative_and_dependent_kernels_launch_through_launch_ex():
    """A kernel with a cluster shape, launched cooperatively or as a programmatic dependent goes through
    cuLaunchKernelEx (``launch_ex``), the plain one through cuLaunchKernel."""
    from dataclasses import replace

    from nvfly.runtime.launcher import make_launch, make_prepared_launch
    k = _fake_compiled()
    fmt, _, size = _layout(k.abi)
    buffers = _Buffers(size)
    x = torch.randn(8)
    raw = ((x.data_ptr(), x.shape, x.stride()), 1.0, 3, None)
    off = type("Off", (), {"get": lambda self: None})()
    for variant, expect_ex in ((k, False), (replace(k, cooperative=True), True), (replace(k, cluster=(2, 1, 1)), True),
                              (replace(k, dependent=True), True)):
        plain, ex = [], []
        launch = make_launch(variant, fmt, 77, lambda *a: plain.append(a) or 0, buffers.local, buffers, 0, None,
                             lambda grid, stream, params: ex.append((grid, stream, params)))
        launch((6, 1, 1), 5, raw)
        prepared = make_prepared_launch(variant, fmt, 77, lambda *a: plain.append(a) or 0, buffers.local, buffers, 0,
                                        None, lambda grid, stream, params: ex.append((grid, stream, params)),
                                        (6, 1, 1), raw, int, lambda d: 0, off, None)
        prepared(x, 1.0, 3, None, stream=5)
        assert (len(ex), len(plain)) == ((2, 0) if expect_ex else (0, 2))
        if expect_ex:
            assert ex == [((6, 1, 1), 5, 1234)] * 2


def test_launch_ex_configs_are_built_once_a_grid_and_stream(monkeypatch):
    """A launcher's cuLaunchKernelEx launches (here a programmatic dependent's) build the launch config once per
    (grid, stream) and reuse it (building one costs the host more than the launch), with the kernel's block,
    shared memory and launch attributes."""
    from dataclasses import replace

    from nvfly.runtime import driver
    from nvfly.runtime.launcher import Launcher
    built, launched = [], []
    monkeypatch.setattr(driver, "launch_config", lambda *args: built.append(args) or len(built))
    monkeypatch.setattr(driver, "launch_with", lambda fn, config, params: launched.append((fn, config, params)))
    monkeypatch.setattr(driver, "stream_handle", lambda stream: ("stream", stream))
    launcher = Launcher.__new__(Launcher)
    launcher.compiled, launcher.function, launcher._configs = replace(_fake_compiled(), dependent=True), "fn", {}
    for grid, stream in (((6, 1, 1), 5), ((6, 1, 1), 5), ((7, 1, 1), 5), ((6, 1, 1), 9), ((6, 1, 1), 5)):
        launcher._launch_ex(grid, stream, 1234)
    c = launcher.compiled
    assert built == [(grid, c.block, None, False, True, c.dynamic_smem_bytes, ("stream", stream))
                     for grid, stream in (((6, 1, 1), 5), ((7, 1, 1), 5), ((6, 1, 1), 9))]
    assert [config for _, config, _ in launched] == [1, 1, 2, 3, 1]
    assert all(fn == "fn" and params == 1234 for fn, _, params in launched)


def _fake_compiled():
    from nvfly.compiler.artifact import CompiledKernel
    abi = [AbiParam("ptr", None, (0, "ptr")), AbiParam("int", "i32", (0, ("shape", 0))),
           AbiParam("int", "i64", (0, ("stride", 0))), AbiParam("float", "bf16", (1, "value")),
           AbiParam("int", "i32", (2, "value"))]
    return CompiledKernel("k", "sm_90a", "key", abi, (128, 1, 1), None, 0, "", "", "", None)


def test_prepared_launch_reads_addresses_and_scalars_only():
    from nvfly.runtime.launcher import make_prepared_launch
    k = _fake_compiled()
    fmt, _, size = _layout(k.abi)
    calls, fallbacks = [], []
    buffers = _Buffers(size)
    x = torch.randn(10, 4)[:, 0]  # shape (10,), stride 4
    raw = ((x.data_ptr(), x.shape, x.stride()), 1.5, 7, "constexpr")

    class Off:
        value = None

        def get(self):
            return self.value
    bypass = Off()
    launch = make_prepared_launch(k, fmt, 77, lambda *a: calls.append(a) or 0, buffers.local, buffers, 3,
                                  None, None, (6, 2, 1), raw, lambda s: s + 1000, lambda device: device * 100,
                                  bypass, lambda args, stream: fallbacks.append((args, stream)))
    y = torch.randn(40)  # another tensor: only its address is read, shape and strides are the first call's
    launch(y, 2.5, 9, "constexpr")
    assert calls[-1] == (77, 6, 2, 1, 128, 1, 1, 0, 300, 1234, None)  # current stream of device 3
    assert struct.unpack(fmt, buffers.raw.raw) == (y.data_ptr(), 10, 4, bf16_bits(2.5), 9)
    launch(y, 2.5, 9, "constexpr", stream=5)
    assert calls[-1][8] == 1005 and not fallbacks
    bypass.value = "compile-only"
    launch(y, 2.5, 9, "constexpr", stream=5)
    assert fallbacks == [((y, 2.5, 9, "constexpr"), 5)] and len(calls) == 2


def test_prepared_launch_generated_code_matches_the_generic_launch():
    from nvfly.runtime.launcher import make_launch, make_prepared_launch
    k = _fake_compiled()
    fmt, _, size = _layout(k.abi)
    packed = []
    x = torch.randn(16, 3)[:, 1]

    def cu(*args):
        packed.append((args[1:4], bytes(buffers.raw.raw)))
        return 0
    buffers = _Buffers(size)
    generic = make_launch(k, fmt, 77, cu, buffers.local, buffers, 0, None, None)
    raw = ((x.data_ptr(), x.shape, x.stride()), -3.25, -(1 << 31), None)
    generic((4, 1, 1), 0, raw)
    prepared = make_prepared_launch(k, fmt, 77, cu, buffers.local, buffers, 0, None, None, (4, 1, 1), raw,
                                    int, lambda d: 0, type("Off", (), {"get": lambda self: None})(), None)
    prepared(x, -3.25, -(1 << 31), None)
    assert packed[0] == packed[1]


def test_prepared_launch_object_first_call_then_fast_path(recorded_launches):
    """Kernel.prepared: the first call takes the full path (here a fake loaded launcher), later calls the
    generated code; compile-only mode records; check=True refuses arguments unlike the first call's."""

    @nvfly.kernel
    def scale(x: nvfly.Tensor, y: nvfly.Tensor, n: nvfly.i32, a: nvfly.f32, BLOCK: nvfly.Constexpr):
        i = nvfly.block_idx.x * BLOCK + nvfly.thread_idx.x
        if i < n:
            y[i] = x[i] * a

    def calls():
        return [(grid, params) for _, grid, params in recorded_launches]
    x, y = torch.randn(256), torch.empty(256)
    p = scale.prepared(2, 128, check=True)
    assert "not launched yet" in repr(p)
    p.launch(x, y, 256, 2.0, 128)
    assert p.launch != p._first and "ready" in repr(p)
    x2, y2 = torch.randn(256), torch.empty(256)
    p.launch(x2, y2, 256, 3.0, 128)
    (g0, p0), (g1, p1) = calls()
    assert g0 == g1 == (2, 1, 1)
    moved = {x.data_ptr(): x2.data_ptr(), y.data_ptr(): y2.data_ptr(), 2.0: 3.0}
    assert p1 == tuple(moved.get(v, v) for v in p0) and x2.data_ptr() in p1
    with pytest.raises(nvfly.LaunchError, match="unlike its first call"):
        p.launch(torch.randn(512), y2, 256, 3.0, 128)  # another shape
    with nvfly.compile_only() as kernels:
        p.launch(x2, y2, 256, 3.0, 128)
        scale[2, 128](x2, y2, 256, 3.0, 128)  # a signature launched before: still recorded, not launched
    assert len(kernels) == 2 and len(calls()) == 2

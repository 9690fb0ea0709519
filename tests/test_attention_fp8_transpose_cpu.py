"""fp8 prefill's V transpose kernel without a GPU: it compiles for every fp8 head dim to 4-byte predicated loads,
``prmt`` byte permutes and 16-byte stores without spills or local memory; the kernel's index mapping, evaluated on
the CPU (``transposed_model``), is bit-equal to the torch strided copy for (B, S, H, D) and (B, H, S, D) layouts
and Skv not a multiple of 16; the host plan caches a launch per V layout and leaves the CPU and misaligned V to
the torch copy."""
import pytest
import torch

import nvfly
from nvfly.ops.attention import prefill_api, transpose_kernel
from nvfly.ops.attention.prefill_plan import FP8_HEAD_DIMS

DVS = sorted({dv for _, dv in FP8_HEAD_DIMS})
from nvfly.ops.attention.transpose_kernel import (GROUP, GROUPS, THREADS, transpose_plan, transpose_values_kernel,
                                                  transposed_model)
from nvfly.ops.common.opcall import Declined, KernelScalars


@pytest.mark.parametrize("dv", DVS)
def test_transpose_kernel_compiles_without_spills(dv):
    v = torch.zeros(1, 1000, 4, dv, dtype=torch.uint8)
    out = torch.zeros(1, dv, 4, 1008, dtype=torch.uint8)
    kernel = nvfly.compile(transpose_values_kernel, v, out, 1000, 1008, PLAN=transpose_plan(dv))
    r = kernel.resources
    assert r.spill_stores == r.spill_loads == r.stack_bytes == 0
    assert kernel.count("LDG.E") == GROUPS * GROUP and kernel.count("STG.E.128") == 4 * GROUPS
    assert kernel.count("PRMT") >= 24 * GROUPS
    assert "ld.global.nc.L1::no_allocate.L2::cache_hint.b32" in kernel.ptx
    assert "ld.local" not in kernel.ptx and "st.local" not in kernel.ptx


def test_transpose_plan_covers_the_keys_once():
    for dv in DVS:
        plan = transpose_plan(dv)
        assert plan.keys_per_block * dv == THREADS * GROUPS * GROUP * 4
        assert plan.grid(2, 3, 1008) == (-(-1008 // plan.keys_per_block), 3, 2)
    with pytest.raises(ValueError, match="head dim 96"):
        transpose_plan(96)


def test_byte_permutes_gather_each_dv_value_in_fragment_order():
    """group_columns on words of distinct bytes: Dv value e's word q holds byte e of keys ORDER[4q..4q+3]."""
    words = [sum((16 * k + e) << (8 * e) for e in range(4)) for k in range(GROUP)]
    out = transpose_kernel.group_columns(words, transpose_kernel._permute_model)
    for e in range(4):
        for q in range(4):
            assert out[e][q] == sum((16 * transpose_kernel.ORDER[4 * q + b] + e) << (8 * b) for b in range(4))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("skv,heads,dv", [(300, 3, 64), (77, 2, 128), (130, 1, 256), (16, 2, 64)])
def test_kernel_mapping_matches_the_torch_copy(layout, skv, heads, dv):
    torch.manual_seed(skv + dv)
    raw = torch.randint(0, 256, (2, skv, heads, dv), dtype=torch.uint8)
    if layout == "bhsd":
        raw = raw.transpose(1, 2).contiguous().transpose(1, 2)
    v = raw.view(torch.float8_e4m3fn)
    expected = prefill_api.transposed_values_torch(v).view(torch.uint8)
    assert torch.equal(transposed_model(raw), expected)


def test_host_plan_declines_cpu_and_launches_on_cuda(monkeypatch):
    v = torch.zeros(1, 40, 2, 128, dtype=torch.float8_e4m3fn)
    call = prefill_api._transpose_call(v)
    assert isinstance(call, Declined) and "cpu" in call.reason
    # the CPU path is the torch copy
    assert prefill_api.transposed_values(v).shape == (1, 128, 2, 48)

    class Cuda:  # what _transpose_call reads of a CUDA tensor
        def __init__(self, t, ptr=0):
            self.t, self.ptr, self.shape, self.device = t, ptr, t.shape, torch.device("cuda", 0)

        def stride(self, *d):
            return self.t.stride(*d)

        def data_ptr(self):
            return self.ptr

    prepared = []
    monkeypatch.setattr(transpose_values_kernel, "prepared", lambda grid, block: prepared.append((grid, block)) or 0)
    call = prefill_api._transpose_call(Cuda(v))
    assert call.keys == 48 and call.scalars.values == (40, 48, transpose_plan(128))
    assert prepared == [(transpose_plan(128).grid(1, 2, 48), THREADS)]
    assert isinstance(prefill_api._transpose_call(Cuda(v, ptr=2)), Declined)
    assert isinstance(prefill_api._transpose_call(Cuda(v[:, :, :, :96])), Declined)


def test_transposed_values_hands_the_launch_what_the_kernel_binds(monkeypatch):
    """``transposed_values``' own launch line, with a planned call (as for a CUDA V) whose prepared launch binds the
    arguments it is handed to the kernel's parameters and their specs on the CPU: one too many or too few raises
    here, not only on a GPU."""
    v = torch.zeros(2, 40, 2, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    bound = []

    class Binding:
        def launch(self, *args):
            arguments = transpose_values_kernel._bind(args, {})
            transpose_values_kernel.specs(arguments, need_cuda=False)
            bound.append(arguments)

    plan = transpose_plan(128)
    call = prefill_api._TransposeCall(48, Binding(), KernelScalars.of(transpose_values_kernel, skv=40, keys=48,
                                                                      PLAN=plan))
    monkeypatch.setattr(prefill_api._TRANSPOSES, "get", lambda key: call)
    out = prefill_api.transposed_values(v)
    assert out.shape == (2, 128, 2, 48) and out.dtype == torch.float8_e4m3fn
    (arguments,) = bound
    assert arguments[0].data_ptr() == v.data_ptr() and arguments[1].data_ptr() == out.data_ptr()
    assert arguments[2:] == [40, 48, plan]

"""Small M in one launch: split K whose splits add up in the kernel (``ScaledConfig.split_fix_up``: each split adds
its f32 sums into its tile's workspace slot and counts itself in, the last one scales, biases and stores) and stream
K over the same swapped tiles (the benchmark's small-M "streamk"), against the float32 GEMM of the dequantised
operands and against the two-launch path (partials + the reduce kernel): M in {1, 16, 33, 64} with tails in N (the
swapped kernel's rows), K and the token tile, tensor-wise, row-wise and block scales, bias, every output dtype,
twice per signature (the workspace and counts are zero again after each launch), and a CUDA graph replayed with
fresh inputs. Fresh random inputs, NaN-poisoned outputs."""
from dataclasses import replace

import pytest
import torch

from nvfly.ops import scaled
from nvfly.ops.scaled import ScaledEpilogue
from nvfly.ops.scaled.plan import make_plan
from tests.gpu.test_scaled_gpu import TOL, operands, poisoned, rel_error

pytestmark = pytest.mark.gpu

N, K = 1040, 2064  # 16 64-row tiles + 16 rows of the swapped kernel; 16 k-blocks + a 16-wide tail: split 4 ways


def small_m_configs(m, n, k, scaling, fast=False):
    """{name: (config, swap)}: the heuristic's small-M plan with its splits added up in the kernel ("fixup") and
    in the reduce kernel ("reduce"), and stream K over its tiles ("streamk")."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    epilogue = ScaledEpilogue(scaling, promote=not fast or scaling == "block")
    plan = make_plan(m, n, k, epilogue, None, None, sms)
    assert plan.config.split_k > 1, "the test's shape must split K"
    configs = {"fixup": (replace(plan.config, split_fix_up=True), plan.swap),
               "reduce": (replace(plan.config, split_fix_up=False), plan.swap)}
    streamed = replace(plan.config, split_k=1, split_fix_up=False, stream_k=True)
    if make_plan(m, n, k, epilogue, streamed, plan.swap, sms).sk_tiles:
        configs["streamk"] = (streamed, plan.swap)
    return configs


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
@pytest.mark.parametrize("m", [1, 16, 33, 64])
def test_single_launch_matches_the_reference_and_two_launches(hopper, scaling, m):
    a, b, sa, sb = operands(m, N, K, scaling)
    bias = torch.randn(N, device="cuda").to(torch.bfloat16)
    configs = small_m_configs(m, N, K, scaling)
    assert "-fixup" in scaled.path(a, b, sa, sb, bias=bias, config=configs["fixup"][0], swap=configs["fixup"][1])
    assert set(configs) == {"fixup", "reduce", "streamk"} and configs["fixup"][0].split_k == 4
    for out_dtype, with_bias in ((torch.bfloat16, True), (torch.float16, False), (torch.float32, True)):
        ref = scaled.reference(a, b, sa, sb, bias if with_bias else None)
        outs = {}
        for name, (config, swap) in configs.items():
            for launch in range(2):  # the second finds the workspace and counts the first left zeroed
                out = poisoned(m, N, out_dtype)
                scaled.scaled_mm(a, b, sa, sb, bias=bias if with_bias else None, out_dtype=out_dtype, out=out,
                                 config=config, swap=swap)
                assert rel_error(out, ref) < TOL[out_dtype], (name, launch, out_dtype)
            outs[name] = out.float()
        # the same fp32 sums in another order (atomic adds against the reduce kernel's), one rounding to the output
        rtol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[out_dtype]
        for name in outs:
            torch.testing.assert_close(outs[name], outs["reduce"], rtol=rtol, atol=1e-5 * ref.abs().max().item(),
                                       msg=lambda text: f"{name} vs two launches ({out_dtype}): {text}")


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_single_launch_fast_accumulation(hopper, scaling):
    """use_fast_accum: the accumulating mainloop's sums through the fix-up (M = 16, the swapped 64 x 16 tile)."""
    m = 16
    a, b, sa, sb = operands(m, N, K, scaling)
    ref = scaled.reference(a, b, sa, sb)
    for name, (config, swap) in small_m_configs(m, N, K, scaling, fast=True).items():
        out = poisoned(m, N, torch.bfloat16)
        scaled.scaled_mm(a, b, sa, sb, out=out, config=config, swap=swap, use_fast_accum=True)
        assert rel_error(out, ref) < 2 * TOL[torch.bfloat16], name


@pytest.mark.parametrize("name", ["fixup", "streamk"])
def test_single_launch_in_cuda_graph(hopper, name):
    """A captured single-launch call owns its zeroed workspace (the graph's pool): replayed twice with fresh inputs
    after an eager call on the capture stream that grows the stream's cached workspace, it still gives the product
    (the last split of each replay leaves slots and counts zeroed for the next)."""
    m, scaling = 16, "row"
    a, b, sa, sb = operands(m, N, K, scaling)
    bias = torch.randn(N, device="cuda").to(torch.bfloat16)
    config, swap = small_m_configs(m, N, K, scaling)[name]
    out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        scaled.scaled_mm(a, b, sa, sb, bias=bias, out=out, config=config, swap=swap)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        scaled.scaled_mm(a, b, sa, sb, bias=bias, out=out, config=config, swap=swap)
    with torch.cuda.stream(stream):  # an eager call on the capture stream with more tiles: the workspace grows
        big_n = 8 * N
        big = operands(m, big_n, K, scaling)
        big_out = poisoned(m, big_n, torch.bfloat16)
        scaled.scaled_mm(*big, out=big_out, config=config, swap=swap)
        assert rel_error(big_out, scaled.reference(*big)) < TOL[torch.bfloat16]
    torch.cuda.synchronize()
    for _ in range(2):
        fresh = operands(m, N, K, scaling)
        a.copy_(fresh[0])
        sa.copy_(fresh[2])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(out, scaled.reference(a, b, sa, sb, bias)) < TOL[torch.bfloat16]

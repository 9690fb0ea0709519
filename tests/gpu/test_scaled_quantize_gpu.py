"""nvfly's quantisation kernels (quantize_fp8, quantize_mxfp4) against the torch reference ``quantize``, bit for bit
(torch.equal on scales and values): every granularity, bf16 / fp16 / fp32 inputs, e4m3 and e5m2, shapes with
tails (rows past a 128-row block, K past a 128 group, a single row and group, rows long enough to be read in
sweeps). Under 90 s on the H200 (most of it compiling the plans)."""
import pytest
import torch

from nvfly.ops.scaled.quantize import quantize, quantize_fp8, quantize_mxfp4, quantize_plan

pytestmark = pytest.mark.gpu

# (rows, K): tails of rows and of K's 128-groups, one row and group, a partial unroll step, rows in sweeps
SHAPES = [(300, 1056), (129, 4112), (16, 7168), (1, 16), (3, 70016), (4097, 512)]
SOURCES = [torch.bfloat16, torch.float16, torch.float32]


def spread(rows: int, k: int, source: torch.dtype) -> torch.Tensor:
    """Rows and 32-column groups of magnitudes 2^-8 .. 2^8 (a scale applied to the wrong group shows), an all-zero
    group (the floor / byte 0) and, fp16 aside, values far outside fp8's range."""
    x = torch.randn(rows, k, device="cuda") * torch.exp2(torch.randint(-8, 9, (rows, 1), device="cuda").float())
    x = x * torch.exp2(torch.randint(-4, 5, (1, -(-k // 32)), device="cuda").float()).repeat_interleave(32, 1)[:, :k]
    if source != torch.float16:
        x[-1, -16:] *= 1e6
    x[0, :16] = 0
    return x.to(source)


def check(got, want) -> None:
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and q.stride() == q_ref.stride()
    assert s.dtype == s_ref.dtype and s.shape == s_ref.shape
    assert torch.equal(s, s_ref), (s.float() - s_ref.float()).abs().max()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), \
        (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()[:8]


@pytest.mark.parametrize("source", SOURCES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("granularity", ["row", "1x128", "128x128", "mx", "mxfp4"])
def test_quantize_kernels_equal_the_reference(hopper, granularity, source):
    for rows, k in SHAPES:
        if granularity in ("mx", "mxfp4") and k % 32:
            continue
        x = spread(rows, k, source)
        if granularity == "mxfp4":
            check(quantize_mxfp4(x, operand="a"), quantize(x, "mxfp4"))
            continue
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            check(quantize_fp8(x, granularity, dtype), quantize(x, granularity, dtype))
        if rows == 300:  # the weight's layouts
            check(quantize_fp8(x, granularity, operand="b"), quantize(x, granularity, operand="b"))


def test_the_long_row_shape_is_read_in_sweeps():
    """(3, 70016) above exercises the two-read path of long rows (and the single-read one elsewhere)."""
    assert quantize_plan(3, 70016, 2, "row", torch.float8_e4m3fn, 132)[0].sweeps > 1
    assert quantize_plan(3, 70016, 4, "row", torch.float8_e4m3fn, 132)[0].sweeps > 1
    assert quantize_plan(16, 7168, 2, "row", torch.float8_e4m3fn, 132)[0].sweeps == 1

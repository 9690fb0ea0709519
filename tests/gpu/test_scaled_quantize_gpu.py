"""nvfly's quantisation kernels (quantize_fp8, quantize_mxfp4) against the torch reference ``quantize``, bit for bit
(torch.equal on scales and values): every granularity, bf16 / fp16 / fp32 inputs, e4m3 and e5m2, shapes with
tails (rows past a 128-row block, K past a 128 group, a single row and group, rows long enough to be read in
sweeps), every QUANTIZE_VARIANTS plan beside the defaults, and MXFP4 on every finite bf16. Under 90 s on the
H200 (most of it compiling the plans)."""
import pytest
import torch

import nvfly
from nvfly.arch.floats import divide, division_reciprocal
from nvfly.ops.scaled.quantize import QUANTIZE_VARIANTS, quantize, quantize_fp8, quantize_mxfp4, quantize_plan

pytestmark = pytest.mark.gpu

# (rows, K): tails of rows and of K's 128-groups, one row and group, a partial unroll step, rows in sweeps
SHAPES = [(300, 1056), (129, 4112), (16, 7168), (1, 16), (3, 70016), (4097, 512)]
SOURCES = [torch.bfloat16, torch.float16, torch.float32]
# (granularity, variant): the default plans and every QUANTIZE_VARIANTS entry on the granularities it applies to
PLANS = [(g, "default") for g in ("row", "1x128", "128x128", "mx", "mxfp4")] + \
    [(g, name) for name, (granularities, _) in QUANTIZE_VARIANTS.items() for g in granularities]


def run(x: torch.Tensor, granularity: str, variant: str, dtype: torch.dtype = torch.float8_e4m3fn,
        operand: str = "a"):
    if granularity == "mxfp4":
        return quantize_mxfp4(x, operand=operand, variant=variant)
    return quantize_fp8(x, granularity, dtype, operand, variant)


def spread(rows: int, k: int, source: torch.dtype) -> torch.Tensor:
    """Rows and 32-column groups of magnitudes 2^-12 .. 2^12 (a scale applied to the wrong group shows), an all-zero
    group (the floor / byte 0) and, fp16 aside, a group a million times larger than its row."""
    x = torch.randn(rows, k, device="cuda") * torch.exp2(torch.randint(-8, 9, (rows, 1), device="cuda").float())
    x = x * torch.exp2(torch.randint(-4, 5, (1, -(-k // 32)), device="cuda").float()).repeat_interleave(32, 1)[:, :k]
    if source != torch.float16:
        x[-1, -16:] *= 1e6
    x[0, :16] = 0
    return x.to(source)


def strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(stride for stride, size in zip(t.stride(), t.shape) if size > 1)


def check(got, want) -> None:
    (q, s), (q_ref, s_ref) = got, want
    # strides of size-1 dimensions are free (the reference's one padded row keeps its padded stride)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and strides(q) == strides(q_ref)
    assert s.dtype == s_ref.dtype and s.shape == s_ref.shape
    assert torch.equal(s, s_ref), (s.float() - s_ref.float()).abs().max()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), \
        (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()[:8]


@pytest.mark.parametrize("source", SOURCES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("granularity, variant", PLANS, ids=[f"{g}-{v}" for g, v in PLANS])
def test_quantize_kernels_equal_the_reference(hopper, granularity, variant, source):
    for rows, k in SHAPES:
        if granularity in ("mx", "mxfp4") and k % 32:
            continue
        x = spread(rows, k, source)
        if granularity == "mxfp4":
            check(run(x, granularity, variant), quantize(x, "mxfp4"))
            continue
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2) if source == torch.bfloat16 else (torch.float8_e4m3fn,):
            check(run(x, granularity, variant, dtype), quantize(x, granularity, dtype))
        if rows == 300:  # the weight's layouts
            check(run(x, granularity, variant, operand="b"), quantize(x, granularity, operand="b"))


def every_bf16_in_its_binades() -> torch.Tensor:
    """Every finite bf16 (subnormals, zeros and both signs included) in MX groups whose amax is at most 5 binades
    above it (31 values and the largest of their top binade a group), so that every value meets every scale byte
    whose quotient rounds to a nonzero e2m1 code, ties included: (rows, 256)."""
    groups = []
    for top in range(255):
        fields = torch.arange(max(0, top - 5), top + 1)
        magnitude = (fields[:, None] << 7 | torch.arange(128)[None]).flatten()
        bits = torch.cat([magnitude, magnitude | 0x8000])
        bits = torch.cat([bits, bits[: -bits.numel() % 31]])  # a multiple of 31, repeating the first
        groups.append(torch.cat([bits.view(-1, 31), torch.full((bits.numel() // 31, 1), top << 7 | 0x7F)], 1))
    words = torch.cat(groups)
    words = torch.cat([words, words[: -words.shape[0] % 8]]).view(-1, 256)
    return words.to(torch.int16).view(torch.bfloat16).cuda()


@pytest.mark.parametrize("variant", [v for g, v in PLANS if g == "mxfp4"])
def test_mxfp4_kernels_equal_the_reference_on_every_bf16(hopper, variant):
    x = every_bf16_in_its_binades()
    assert x.isfinite().all() and x.shape[0] > 1000
    check(run(x, "mxfp4", variant), quantize(x, "mxfp4"))


def test_the_long_row_shape_is_read_in_sweeps():
    """(3, 70016) above exercises the two-read path of long rows (and the single-read one elsewhere)."""
    assert quantize_plan(3, 70016, 2, "row", torch.float8_e4m3fn, 132)[0].sweeps > 1
    assert quantize_plan(3, 70016, 4, "row", torch.float8_e4m3fn, 132)[0].sweeps > 1
    assert quantize_plan(16, 7168, 2, "row", torch.float8_e4m3fn, 132)[0].sweeps == 1


@pytest.mark.parametrize("source", SOURCES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("granularity, variant", PLANS, ids=[f"{g}-{v}" for g, v in PLANS])
def test_groups_with_inf_and_nan_take_the_exact_slow_path(hopper, granularity, variant, source):
    """A group holding an inf (fp8 scales: inf, divided by div.rn.f32) or a NaN (MXFP4: the e2m1 NaN check) gives
    the reference's bytes; the other groups stay exact (NaN scales compared as NaN)."""
    x = spread(256, 1024, source)
    x[3, 5] = float("inf")
    x[130, 700] = -float("inf")
    x[200, 40] = float("nan")
    (q, s), (q_ref, s_ref) = run(x, granularity, variant), quantize(x, granularity)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), \
        (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()[:8]


@nvfly.kernel
def divide_kernel(x: nvfly.Tensor, d: nvfly.Tensor, out: nvfly.Tensor, n: nvfly.i32):
    i = nvfly.block_idx.x * 256 + nvfly.thread_idx.x
    if i < n:
        out[i] = divide(x[i], d[i], division_reciprocal(d[i]))


def test_divide_equals_ieee_division(hopper):
    """The quantisers' division (one shared reciprocal, div.rn.f32's fast path) against torch's x / d bit for bit
    over random mantissas and exponents (quotients from 2^-100 up), exact quotients, fp8 and e2m1 ties, zeros."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 1 << 22

    def floats(low: int, high: int) -> torch.Tensor:
        mantissa = torch.randint(0, 1 << 23, (n,), device="cuda", generator=gen, dtype=torch.int32)
        exponent = torch.randint(low + 127, high + 128, (n,), device="cuda", generator=gen, dtype=torch.int32)
        sign = torch.randint(0, 2, (n,), device="cuda", generator=gen, dtype=torch.int32) << 31
        return (sign | (exponent << 23) | mantissa).view(torch.float32)

    x, d = floats(-60, 60), floats(-49, 119).abs()
    ties = torch.tensor([0.5, 1.5, 2.5, 3.0, 5.0, 448.0, 464.0, 0.0009765625, 1.0 + 2 ** -4, 57344.0],
                        device="cuda")
    x[: n // 4] = (d[: n // 4] * ties.repeat(n // 40 + 1)[: n // 4]) * torch.where(x[: n // 4] < 0, -1.0, 1.0)
    x[:64] = torch.tensor([0.0, -0.0], device="cuda").repeat(32)
    out = torch.empty_like(x)
    divide_kernel[(n + 255) // 256, 256](x, d, out, n)
    want = x / d
    # divide's contract: x finite (d * a tie can overflow to inf above) and quotients not far below f32's normals
    keep = ((want.abs() >= 2.0 ** -100) | (x == 0)) & x.isfinite()
    assert keep.float().mean() > 0.7
    assert torch.equal(out[keep].view(torch.int32), want[keep].view(torch.int32)), \
        (x[keep][out[keep] != want[keep]][:4], d[keep][out[keep] != want[keep]][:4])

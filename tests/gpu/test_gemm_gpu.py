"""nvfly's Hopper GEMM against a float32 reference: majors, tails, epilogues, batches, small M, split K."""
import pytest
import torch

from nvfly.ops import gemm
from nvfly.ops.common import operands
from nvfly.ops.gemm import GemmConfig
from nvfly.ops.common.opcall import OpCalls
from nvfly.ops.gemm.skinny_config import SkinnyConfig

pytestmark = pytest.mark.gpu


def operand(rows, cols, dtype, major):
    """A [rows, cols] matrix whose last dimension ('K' for A-like, 'MN' ...) is contiguous or not."""
    if major == "row":
        return torch.randn(rows, cols, device="cuda").to(dtype)
    return torch.randn(cols, rows, device="cuda").to(dtype).t()


def check(out, ref, tol=2e-2):
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert err < tol, err
    return err


@pytest.mark.parametrize("a_major", ["row", "col"])
@pytest.mark.parametrize("b_major", ["row", "col"])
@pytest.mark.parametrize("mnk", [(128, 256, 64), (256, 512, 1024), (336, 520, 1000), (1000, 136, 4096),
                                 (4096, 4096, 512)])
def test_all_majors_and_tails(hopper, a_major, b_major, mnk):
    m, n, k = mnk
    a = operand(m, k, torch.bfloat16, a_major)
    b = operand(k, n, torch.bfloat16, b_major)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.matmul(a, b, out=out)
    check(out, gemm.reference(a, b), tol=1e-2)


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float32)])
def test_dtypes(hopper, dtype, out_dtype):
    a = torch.randn(300, 704, device="cuda").to(dtype)
    b = torch.randn(704, 264, device="cuda").to(dtype)
    out = gemm.matmul(a, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    check(out, gemm.reference(a, b), tol=1e-2 if out_dtype != torch.float32 else 2e-3)


@pytest.mark.parametrize("activation", ["none", "relu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", ["row", "col", "full", None])
def test_epilogue(hopper, activation, bias):
    m, n, k = 200, 384, 512
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    c = {"row": torch.randn(n, device="cuda"), "col": torch.randn(m, 1, device="cuda"),
         "full": torch.randn(m, n, device="cuda"), None: None}[bias]
    c = c.to(torch.bfloat16) if c is not None else None
    out = gemm.matmul(a, b, c=c, alpha=0.5, beta=2.0, activation=activation)
    check(out, gemm.reference(a, b, c, 0.5, 2.0, activation), tol=1.5e-2)


@pytest.mark.parametrize("batch,m,n,k", [(3, 128, 256, 256), (8, 100, 72, 520), (2, 512, 1024, 2048)])
def test_bmm(hopper, batch, m, n, k):
    a = torch.randn(batch, m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(batch, k, n, device="cuda").to(torch.bfloat16)
    check(gemm.matmul(a, b), gemm.reference(a, b), tol=1e-2)
    bt = torch.randn(batch, n, k, device="cuda").to(torch.bfloat16).transpose(1, 2)
    check(gemm.matmul(a, bt), gemm.reference(a, bt), tol=1e-2)


@pytest.mark.parametrize("m", [1, 7, 16, 64])
@pytest.mark.parametrize("nk", [(4096, 4096), (2112, 7168), (1024, 16384)])
def test_small_m_swaps_and_splits(hopper, m, nk):
    n, k = nk
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    check(gemm.matmul(a, b), gemm.reference(a, b), tol=1e-2)
    check(gemm.matmul(a, b.t().contiguous().t()), gemm.reference(a, b), tol=1e-2)


@pytest.mark.parametrize("config", [GemmConfig(128, 128, 6, 2), GemmConfig(256, 128, 4, 2),
                                    GemmConfig(64, 256, 4, 1), GemmConfig(128, 64, 7, 2, split_k=3),
                                    GemmConfig(128, 256, 3, 2, group_m=16), GemmConfig(128, 256, 4, 2, cluster_m=2),
                                    GemmConfig(128, 128, 6, 2, cluster_m=2, group_m=4),
                                    GemmConfig(128, 128, 6, 2, pingpong=True), GemmConfig(64, 256, 5, 2, pingpong=True)])
def test_configs(hopper, config):
    # 777 rows: an odd number of 128-row tiles, so a cluster's second block sometimes has no rows
    a = torch.randn(777, 1536, device="cuda").to(torch.bfloat16)
    b = torch.randn(1536, 520, device="cuda").to(torch.bfloat16)
    check(gemm.matmul(a, b, config=config), gemm.reference(a, b), tol=1e-2)
    bt = torch.randn(520, 1536, device="cuda").to(torch.bfloat16).t()
    check(gemm.matmul(a, bt, config=config), gemm.reference(a, bt), tol=1e-2)


@pytest.mark.parametrize("a_major", ["row", "col"])
@pytest.mark.parametrize("config", [GemmConfig(128, 64, 9, 2, cluster_m=2), GemmConfig(128, 32, 9, 2, cluster_m=2),
                                    GemmConfig(256, 64, 5, 2, cluster_m=2)], ids=str)
def test_narrow_two_block_clusters_on_swapped_tokens(hopper, a_major, config):
    """Each block of a 2-block cluster loads half of a narrow B tile and multicasts it: the swapped small-M
    problem, whose B is the tokens (K-major from row-major A, MN-major from column-major A), with ragged N
    (an odd count of weight tiles, so a cluster's second block sometimes has none) and ragged tokens."""
    for m, n in ((64, 4104), (40, 1000)):
        a = operand(m, 1000, torch.bfloat16, a_major)
        b = operand(1000, n, torch.bfloat16, "col")
        check(gemm.matmul(a, b, config=config, swap=True), gemm.reference(a, b), tol=1e-2)


def test_narrow_two_block_cluster_unswapped(hopper):
    """A 64x112 tile pair sharing a K-major B tile (halves of 56 rows); a row-major (MN-major) B is declined."""
    a = torch.randn(200, 2048, device="cuda").to(torch.bfloat16)
    bt = torch.randn(7000, 2048, device="cuda").to(torch.bfloat16).t()
    config = GemmConfig(64, 112, 10, 1, cluster_m=2)
    check(gemm.matmul(a, bt, config=config), gemm.reference(a, bt), tol=1e-2)
    with pytest.raises(ValueError, match="MN-major here"):
        gemm.matmul(a, bt.contiguous(), config=config)


def test_zero_sizes_and_declined_inputs(hopper):
    a = torch.randn(0, 64, device="cuda").to(torch.bfloat16)
    b = torch.randn(64, 32, device="cuda").to(torch.bfloat16)
    assert gemm.matmul(a, b).shape == (0, 32)
    a = torch.randn(16, 0, device="cuda").to(torch.bfloat16)
    b = torch.randn(0, 32, device="cuda").to(torch.bfloat16)
    c = torch.randn(32, device="cuda").to(torch.bfloat16)
    assert torch.equal(gemm.matmul(a, b, c=c).float(), c.float().expand(16, 32))
    odd = torch.randn(64, 1023, device="cuda").to(torch.bfloat16)
    assert "16 bytes" in gemm.eligibility(odd, torch.randn(1023, 64, device="cuda").to(torch.bfloat16))
    assert "bf16 or fp16" in gemm.eligibility(odd.float(), odd.float().t())


# ---------------------------------------------------------------------------------------------- TMA-store epilogue
TMA_STORE_CONFIGS = [GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True),
                     GemmConfig(128, 128, 6, 2, pingpong=True, tma_store=True, store_buffers=1),
                     GemmConfig(128, 256, 4, 2, tma_store=True), GemmConfig(256, 128, 4, 2, tma_store=True, store_buffers=1),
                     GemmConfig(64, 256, 5, 1, tma_store=True), GemmConfig(128, 256, 4, 2, cluster_m=2, tma_store=True),
                     GemmConfig(128, 96, 6, 2, tma_store=True), GemmConfig(64, 48, 7, 1, tma_store=True),
                     # the wave-fit widths (gemm.plan.wave_fit)
                     GemmConfig(128, 160, 6, 2, tma_store=True, store_buffers=1),
                     GemmConfig(128, 192, 5, 2, tma_store=True, store_buffers=1)]


def padded(rows, cols, dtype, major, pad=8):
    """A [rows, cols] view of a larger random matrix whose strides are 16-byte aligned (odd extents stay
    TMA-describable): row-major, or column-major ('col')."""
    if major == "row":
        return torch.randn(rows, cols + (-cols) % pad, device="cuda").to(dtype)[:, :cols]
    return torch.randn(cols, rows + (-rows) % pad, device="cuda").to(dtype)[:, :rows].t()


def nan_output(shape, dtype, pad=8):
    """A NaN-filled output view with 16-byte aligned rows, and the storage behind it (for checking padding)."""
    base = torch.full((*shape[:-1], shape[-1] + (-shape[-1]) % pad), float("nan"), device="cuda", dtype=dtype)
    return base[..., :shape[-1]], base


@pytest.mark.parametrize("config", TMA_STORE_CONFIGS, ids=str)
@pytest.mark.parametrize("mnk", [(333, 4097, 1023), (4096, 4096, 4096), (129, 257, 64), (777, 520, 1536)])
@pytest.mark.parametrize("majors", [("row", "row"), ("col", "row"), ("row", "col"), ("col", "col")])
def test_tma_store_epilogue_tails_and_majors(hopper, config, mnk, majors):
    m, n, k = mnk
    if mnk == (4096, 4096, 4096) and majors not in (("row", "row"), ("col", "row")):
        pytest.skip("big shape: two layouts suffice")
    a = padded(m, k, torch.bfloat16, majors[0])
    b = padded(k, n, torch.bfloat16, majors[1])
    out, base = nan_output((m, n), torch.bfloat16)
    reason = operands.store_reason(out.unsqueeze(0))
    assert reason is None if n % 8 == 0 else "multiple of 16 bytes" in reason  # odd N: register epilogue
    gemm.matmul(a, b, out=out, config=config)
    check(out, gemm.reference(a, b), tol=1e-2)
    assert torch.isnan(base[:, n:]).all()  # the padding past the last column is untouched


@pytest.mark.parametrize("config", [GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True),
                                    GemmConfig(128, 256, 4, 2, tma_store=True)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", ["row", "col", "full", None])
def test_tma_store_epilogue_c_and_activations(hopper, config, dtype, activation, bias):
    m, n, k = 200, 392, 512
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(k, n, device="cuda").to(dtype)
    c = {"row": torch.randn(n, device="cuda"), "col": torch.randn(m, 1, device="cuda"),
         "full": torch.randn(m, n, device="cuda"), None: None}[bias]
    c = c.to(dtype) if c is not None else None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    gemm.matmul(a, b, c=c, alpha=0.5, beta=2.0, activation=activation, out=out, config=config)
    check(out, gemm.reference(a, b, c, 0.5, 2.0, activation), tol=1.5e-2)


@pytest.mark.parametrize("config", [GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True),
                                    GemmConfig(128, 256, 4, 2, tma_store=True),
                                    GemmConfig(128, 256, 4, 2, cluster_m=2, tma_store=True)], ids=str)
@pytest.mark.parametrize("batch,m,n,k", [(3, 128, 256, 256), (8, 100, 72, 520), (2, 512, 1024, 2048)])
def test_tma_store_epilogue_batched(hopper, config, batch, m, n, k):
    a = torch.randn(batch, m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(batch, k, n, device="cuda").to(torch.bfloat16)
    out = torch.full((batch, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    check(gemm.matmul(a, b, out=out, config=config), gemm.reference(a, b), tol=1e-2)
    bt = torch.randn(batch, n, k, device="cuda").to(torch.bfloat16).transpose(1, 2)
    c = torch.randn(batch, m, n, device="cuda").to(torch.bfloat16)
    out.fill_(float("nan"))
    check(gemm.matmul(a, bt, c=c, activation="relu", out=out, config=config),
          gemm.reference(a, bt, c, activation="relu"), tol=1.5e-2)


def test_tma_store_epilogue_falls_back(hopper):
    cfg = GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True)
    a = torch.randn(333, 512, device="cuda").to(torch.bfloat16)
    b = torch.randn(512, 520, device="cuda").to(torch.bfloat16)
    ref = gemm.reference(a, b)
    # rows 521 elements apart: TMA cannot describe the output, the register epilogue writes it
    base = torch.full((333, 521), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = base[:, :520]
    assert "16 bytes" in operands.store_reason(out.unsqueeze(0))
    gemm.matmul(a, b, out=out, config=cfg)
    check(out, ref, tol=1e-2)
    assert torch.isnan(base[:, 520]).all()
    # f32 output: the register epilogue too
    check(gemm.matmul(a, b, out_dtype=torch.float32, config=cfg), ref, tol=2e-3)
    # a transposed output view (last dim not contiguous)
    outt = torch.full((520, 333), float("nan"), device="cuda", dtype=torch.bfloat16).t()
    check(gemm.matmul(a, b, out=outt, config=cfg), ref, tol=1e-2)
    # split K and the swapped small-M problem keep the register epilogue
    check(gemm.matmul(a, b, config=GemmConfig(128, 128, 5, 2, split_k=2, tma_store=True)), ref, tol=1e-2)
    small = torch.randn(16, 512, device="cuda").to(torch.bfloat16)
    check(gemm.matmul(small, b), gemm.reference(small, b), tol=1e-2)



STREAM_K_CONFIGS = [GemmConfig(128, 128, 6, 2, pingpong=True, tma_store=True, store_buffers=1),
                    GemmConfig(128, 256, 4, 2, tma_store=True, store_buffers=1), GemmConfig(128, 128, 5, 2)]


@pytest.fixture(params=["short-tail", "tail", "tail+wave"])
def stream_k_region(request, monkeypatch):
    """gemm.plan.STREAM_K_REGION for the test (plans are cached per call signature: the cache starts empty)."""
    monkeypatch.setattr(gemm.plan, "STREAM_K_REGION", request.param)
    monkeypatch.setattr(gemm.api, "_CALLS", OpCalls())
    return request.param


@pytest.mark.parametrize("config", STREAM_K_CONFIGS, ids=str)
@pytest.mark.parametrize("mnk", [(2048, 2112, 7168), (2000, 2104, 2560), (1000, 4296, 2600), (1000, 1400, 3000)])
@pytest.mark.parametrize("majors", [("row", "row"), ("col", "row"), ("row", "col"), ("col", "col")])
def test_stream_k(hopper, stream_k_region, config, mnk, majors):
    """Tiles of a short last wave (or of a single partial wave, or of the last two waves: the region) dealt out
    as contiguous k ranges over the blocks and fixed up in the kernel; each call leaves the workspace zeroed for
    the next (a repeated call, after another shape, computes the same)."""
    m, n, k = mnk
    a = operand(m, k, torch.bfloat16, majors[0])
    b = operand(k, n, torch.bfloat16, majors[1])
    streamed = "-streamK" in gemm.path(a, b, config=config)
    assert streamed or stream_k_region == "short-tail" and m * n < 1 << 21  # 88 or 48 tiles: not a short tail
    ref = gemm.reference(a, b)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    check(gemm.matmul(a, b, out=out, config=config), ref, tol=1e-2)
    x = operand(2000, 1096, torch.bfloat16, "row")
    w = operand(1096, 2104, torch.bfloat16, "col")
    check(gemm.matmul(x, w, config=config), gemm.reference(x, w), tol=1e-2)
    out.fill_(float("nan"))
    check(gemm.matmul(a, b, out=out, config=config), ref, tol=1e-2)


def test_stream_k_small_m_swap(hopper, stream_k_region):
    """The swapped small-M problem (64 x 6144 x 4096: 96 tiles of 64 x 64, one partial wave) streamed whole
    under the 'tail' regions, with C and an activation."""
    a = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    b = torch.randn(4096, 6144, device="cuda").to(torch.bfloat16)
    c = torch.randn(6144, device="cuda").to(torch.bfloat16)
    assert ("-streamK" in gemm.path(a, b)) == (stream_k_region != "short-tail")
    out = torch.full((64, 6144), float("nan"), device="cuda", dtype=torch.bfloat16)
    check(gemm.matmul(a, b, c=c, beta=0.5, activation="silu", out=out), gemm.reference(a, b, c, 1.0, 0.5, "silu"),
          tol=1.5e-2)
    check(gemm.matmul(a, b), gemm.reference(a, b), tol=1e-2)


@pytest.mark.parametrize("config", STREAM_K_CONFIGS[:2], ids=str)
@pytest.mark.parametrize("activation", ["none", "gelu_tanh"])
@pytest.mark.parametrize("bias", ["row", "full"])
def test_stream_k_epilogue_and_batches(hopper, stream_k_region, config, activation, bias):
    m, n, k = 2000, 2104, 2560
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    c = (torch.randn(n, device="cuda") if bias == "row" else torch.randn(m, n, device="cuda")).to(torch.bfloat16)
    assert "-streamK" in gemm.path(a, b, c=c, activation=activation, config=config)
    out = gemm.matmul(a, b, c=c, alpha=0.5, beta=2.0, activation=activation, config=config)
    check(out, gemm.reference(a, b, c, 0.5, 2.0, activation), tol=1.5e-2)
    check(gemm.matmul(a, b, out_dtype=torch.float32, config=config), gemm.reference(a, b), tol=2e-3)
    ab = torch.randn(3, 512, 520, device="cuda").to(torch.bfloat16)  # 3 x 4 x 12 = 144 tiles of 128x128
    bb = torch.randn(3, 520, 1536, device="cuda").to(torch.bfloat16)
    check(gemm.matmul(ab, bb, config=config), gemm.reference(ab, bb), tol=1e-2)


@pytest.mark.parametrize("m", [40, 64])
@pytest.mark.parametrize("bias", ["none", "row", "column", "full"])
@pytest.mark.parametrize("batch", [None, 3])
def test_split_k_partials_and_repeat_calls(hopper, m, bias, batch):
    """Split K on the swapped small-M problem, whose f32 partials are laid out like the output (the reduce reads
    and writes in memory order), with C broadcast every way, alpha/beta and an activation; a second call on other
    tensors takes the cached launches (addresses only) and the per-stream partials buffer."""
    n, k = 1536 if batch is None else 512, 4096
    batch_dims = () if batch is None else (batch,)
    shapes = {"row": (n,), "column": (m, 1), "full": (*batch_dims, m, n)}
    for _ in range(2):
        a = torch.randn(*batch_dims, m, k, device="cuda").to(torch.bfloat16)
        b = torch.randn(*batch_dims, k, n, device="cuda").to(torch.bfloat16)
        c = None if bias == "none" else torch.randn(shapes[bias], device="cuda").to(torch.bfloat16)
        assert "-swapAB-splitK" in gemm.path(a, b, c=c, activation="gelu_tanh")
        out = torch.full((*batch_dims, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm.matmul(a, b, c=c, alpha=0.5, beta=2.0, activation="gelu_tanh", out=out)
        check(out, gemm.reference(a, b, c, 0.5, 2.0, "gelu_tanh"), tol=1.5e-2)


@pytest.mark.parametrize("n", [1536, 1540, 1538, 1537])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_split_k_reduce_vector_widths(hopper, n, out_dtype):
    """The reduce moves 8, 4, 2 or 1 elements of a row per thread (runtime.torch_args.vector_width: what divides N
    and the output's row stride); every width and output type reduces every element (the output is poisoned
    first), also into a given output whose rows are 8 elements longer than N."""
    m, k = 64, 4096
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda").to(torch.bfloat16).t()  # column-major: any N is TMA-describable
    assert "-swapAB-splitK" in gemm.path(a, b, out_dtype=out_dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
    gemm.matmul(a, b, out_dtype=out_dtype, out=out)
    check(out, gemm.reference(a, b), tol=1e-2)
    wide = torch.full((m, n + 8), float("nan"), device="cuda", dtype=out_dtype)
    gemm.matmul(a, b, out_dtype=out_dtype, out=wide[:, :n])
    check(wide[:, :n], gemm.reference(a, b), tol=1e-2)
    assert wide[:, n:].isnan().all()


@pytest.mark.parametrize("a_major", ["row", "col"])
@pytest.mark.parametrize("b_major", ["row", "col"])
def test_token_tile_layouts_and_epilogues(hopper, a_major, b_major):
    """48 < M <= 64 over N = 4096 runs unswapped 64x32 tiles (gemm.plan.token_tile_config): every operand major, C
    and an activation through the TMA-store epilogue, and an f32 output through the register epilogue."""
    m, n, k = 56, 4096, 4096  # 112-byte columns: TMA-describable column-major tokens
    a = operand(m, k, torch.bfloat16, a_major)
    b = operand(k, n, torch.bfloat16, b_major)
    c = torch.randn(n, device="cuda").to(torch.bfloat16)
    assert gemm.path(a, b) == "wgmma"
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.matmul(a, b, c=c, alpha=0.5, beta=2.0, activation="silu", out=out)
    check(out, gemm.reference(a, b, c, 0.5, 2.0, "silu"), tol=1.5e-2)
    check(gemm.matmul(a, b, out_dtype=torch.float32), gemm.reference(a, b), tol=2e-3)


TOKEN_WIDTHS = [  # (M, N, K): widths 80 / 96 (K- / MN-major B), 256, 192, 224, 64, and an N tail on 48 (K-major B)
    (64, 10240, 512), (56, 32768, 512), (64, 24576, 1024), (64, 28672, 512), (56, 7168, 2048), (64, 6152, 4096)]


@pytest.mark.parametrize("mnk", TOKEN_WIDTHS, ids=["x".join(map(str, s)) for s in TOKEN_WIDTHS])
@pytest.mark.parametrize("a_major", ["row", "col"])
@pytest.mark.parametrize("b_major", ["row", "col"])
def test_token_tiles_of_every_width(hopper, mnk, a_major, b_major):
    """The wave-filling token tiles (gemm.plan.token_tile_config) of each width, on every operand major, into a poisoned
    output; one call adds a bias and an activation, and one writes a strided output view."""
    m, n, k = mnk
    a = operand(m, k, torch.bfloat16, a_major)
    b = operand(k, n, torch.bfloat16, b_major)
    plan = gemm.api._new_plan(gemm.api.MATMUL, a, b, None, "none", None, None, None, None, False)
    if plan.swap:  # an MN-major B of this N takes the swapped plan (too few 32-multiple tiles)
        assert (b_major, n) == ("row", 6152)
    else:
        assert plan.config.bm == 64 and plan.config.split_k == 1 and plan.grid >= 0.8 * 132
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.matmul(a, b, out=out)
    check(out, gemm.reference(a, b), tol=1e-2)
    c = torch.randn(n, device="cuda").to(torch.bfloat16)
    wide = torch.full((m, n + 16), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.matmul(a, b, c=c, activation="gelu_tanh", out=wide[:, :n])
    check(wide[:, :n], gemm.reference(a, b, c, 1.0, 1.0, "gelu_tanh"), tol=1.5e-2)
    assert wide[:, n:].isnan().all()


@pytest.mark.parametrize("b_major", ["row", "col"])
def test_token_tiles_batched(hopper, b_major):
    """bmm with 48 < M <= 64 rows a batch: token tiles whose width fills one wave over all batches (3 x 43 tiles
    of 64x96 for N = 4096), rank-3 descriptors and the TMA-store epilogue, into a poisoned output."""
    batch, m, n, k = 3, 64, 4096, 2048
    a = torch.randn(batch, m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(batch, k, n, device="cuda").to(torch.bfloat16)
    b = b if b_major == "row" else b.transpose(1, 2).contiguous().transpose(1, 2)
    plan = gemm.api._new_plan(gemm.api.MATMUL, a, b, None, "none", None, None, None, None, False)
    assert not plan.swap and (plan.config.bm, plan.config.bn) == (64, 96) and plan.grid == 129
    out = torch.full((batch, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.matmul(a, b, out=out)
    check(out, gemm.reference(a, b), tol=1e-2)


HINTED = [(64, 10240, 8192, "stream_b"), (16, 4096, 14336, "stream_a"), (128, 24576, 1536, "stream_b")]


@pytest.mark.parametrize("m,n,k,hint", HINTED, ids=[f"{m}x{n}x{k}" for m, n, k, _ in HINTED])
@pytest.mark.parametrize("b_major", ["row", "col"])
def test_l2_hinted_weights(hopper, m, n, k, hint, b_major):
    """Calls whose weights (read once, 1-8 L2s) load with L2 eviction hints compute the same product: the token
    tile (B hinted), the swapped split-K plan (A hinted) and a 128-row tile covering M."""
    a = operand(m, k, torch.bfloat16, "row")
    b = operand(k, n, torch.bfloat16, b_major)
    plan = gemm.api._new_plan(gemm.api.MATMUL, a, b, None, "none", None, None, None, None, False)
    if not isinstance(plan, gemm.plan.GemmPlan):
        pytest.skip("the skinny kernel takes this call")
    assert getattr(plan.config, hint), plan.config
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.matmul(a, b, out=out)
    check(out, gemm.reference(a, b), tol=1e-2)


REDUCTIONS_IN_GRAPHS = [  # (captured call's M, N, K; its path; an eager call needing more of the same scratch)
    ((64, 2048, 4096), "-splitK", (256, 2048, 8192), GemmConfig(128, 128, 4, 2, split_k=8)),  # partials
    ((2000, 2104, 2560), "-streamK", (2560, 3584, 2560),  # the stream-K tail's zeroed workspace
     GemmConfig(128, 256, 4, 2, tma_store=True, store_buffers=1)),
    ((16, 2048, 4096), "skinny-splitK", (16, 32768, 8192), SkinnyConfig(splits=8))]  # the skinny kernel's


@pytest.mark.parametrize("mnk,path,big,big_config", REDUCTIONS_IN_GRAPHS, ids=[p for _, p, _, _ in REDUCTIONS_IN_GRAPHS])
def test_reductions_in_cuda_graph(hopper, mnk, path, big, big_config):
    """A call captured in a CUDA graph owns its scratch (nvfly.ops.common.scratch: the graph's pool, zero-filled by a
    captured fill where the kernel expects zeros): replays after a bigger eager call on the capture stream, which
    grows (reallocates) that stream's cached scratch, still give the right product."""
    m, n, k = mnk
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda").to(torch.bfloat16).t()
    assert path in gemm.path(a, b)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm.matmul(a, b, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemm.matmul(a, b, out=out)
    with torch.cuda.stream(stream):  # an eager call on the capture stream, growing its scratch
        big_a = torch.randn(big[0], big[2], device="cuda").to(torch.bfloat16)
        big_b = torch.randn(big[1], big[2], device="cuda").to(torch.bfloat16).t()
        assert path in gemm.path(big_a, big_b, config=big_config)
        check(gemm.matmul(big_a, big_b, config=big_config), gemm.reference(big_a, big_b), tol=1e-2)
    torch.cuda.synchronize()
    for _ in range(2):
        a.copy_(torch.randn_like(a))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, gemm.reference(a, b), tol=1e-2)

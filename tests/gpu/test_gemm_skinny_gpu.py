"""The skinny (decode) GEMM against a float32 reference, for column-major and row-major B (with and without
SkinnyConfig.token_vectors): token counts 1-16, odd N, K tails, epilogues, batches, split K through the shared
workspace (which must be left zeroed: every case runs twice), poisoned outputs and token padding; column-major
tokens with NaN padding, for row-major B staged in shared memory by cp.async where their k stride allows, for
column-major B through each SkinnyConfig.column_tokens path."""
import dataclasses

import pytest
import torch

from nvfly.ops import gemm
from nvfly.ops.gemm import skinny_config, skinny_plan
from nvfly.ops.gemm.skinny_config import SkinnyConfig
from nvfly.runtime.driver import plan_sm_count

pytestmark = pytest.mark.gpu


def tokens(m, k, dtype, batch=None, major="row", padding=None):
    """A [(batch,) m, k] operand; rows padded to a multiple of 8 elements (16-byte strides, as TMA needs for
    the wgmma path's eligibility) so K itself may have any tail; ``padding``: the padding's value (random
    without; run_twice refills only the view)."""
    pad = -(-k // 8) * 8
    lead = (batch,) if batch else ()
    if major == "col":
        return torch.randn(*lead, pad, m, device="cuda").to(dtype)[..., :k, :].transpose(-1, -2)
    if padding is not None:
        return torch.full((*lead, m, pad), padding, device="cuda", dtype=dtype)[..., :k]
    return torch.randn(*lead, m, pad, device="cuda").to(dtype)[..., :k]


def column_tokens(m, k, dtype, batch=None, padding=float("nan")):
    """Column-major tokens A [(batch,) m, k]: the transpose of [(batch,) k, m] storage whose rows are padded to a
    multiple of 8 tokens (16-byte k strides, as matmul needs for M > 1; M = 1 too, unlike ``tokens``' column-major
    M = 1, which is K-contiguous) and which runs 8 rows past K, all padding ``padding``: the staged tokens copy
    whole 8-token rows and must zero-fill k past K (run_twice refills only the view)."""
    lead = (batch,) if batch else ()
    storage = torch.full((*lead, k + 8, -(-m // 8) * 8), padding, device="cuda", dtype=dtype)
    return storage[..., :k, :m].transpose(-1, -2)


def weight(n, k, dtype, batch=None):
    """B [(batch,) k, n] column-major: the transpose of a row-major [n, k] weight with 16-byte rows."""
    pad = -(-k // 8) * 8
    lead = (batch,) if batch else ()
    return torch.randn(*lead, n, pad, device="cuda").to(dtype)[..., :k].transpose(-1, -2)


def check(out, ref, tol):
    assert not out.isnan().any()
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert err < tol, err
    return err


def run_twice(a, b, tol, **kwargs):
    """matmul into a NaN-poisoned output, then again on fresh data of the same shapes (a split K launch
    must have reset its workspace and counters)."""
    for _ in range(2):
        a.copy_(torch.randn_like(a, dtype=torch.float32))
        b.copy_(torch.randn_like(b, dtype=torch.float32))
        shape = (*a.shape[:-1], b.shape[-1])
        out = torch.full(shape, float("nan"), device="cuda", dtype=kwargs.get("out_dtype") or a.dtype)
        gemm.matmul(a, b, out=out, **kwargs)
        keys = ("c", "alpha", "beta", "activation")
        check(out, gemm.reference(a, b, **{k: v for k, v in kwargs.items() if k in keys}), tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("nk", [(4096, 4096), (4097, 1023), (33, 4104), (1, 8), (4096, 14336), (100, 40)])
def test_shapes(hopper, dtype, m, nk):
    """Token counts 1-16, odd N, K tails: the kernel the heuristic picks (skinny or wgmma: a re-tuning may move
    the line between them) and the skinny kernel forced both compute the product."""
    n, k = nk
    a, b = tokens(m, k, dtype), weight(n, k, dtype)
    assert gemm.path(a, b).startswith(("skinny", "wgmma"))
    run_twice(a, b, 1e-2)
    assert gemm.path(a, b, skinny=True).startswith("skinny")
    run_twice(a, b, 1e-2, skinny=True)


@pytest.mark.parametrize("m", [1, 9, 16])
@pytest.mark.parametrize("config", [SkinnyConfig(8, 4, 1), SkinnyConfig(8, 4, 3), SkinnyConfig(4, 2, 7),
                                    SkinnyConfig(2, 1, 16), SkinnyConfig(16, 8, 2)])
def test_configs_and_splits(hopper, m, config):
    a, b = tokens(m, 3000, torch.bfloat16), weight(1000, 3000, torch.bfloat16)
    assert gemm.path(a, b, config=config) == "skinny" + (f"-splitK{config.splits}" if config.splits > 1 else "")
    run_twice(a, b, 1e-2, config=config)


# B's major-ness and, for row-major B, SkinnyConfig.token_vectors
VARIANTS = {"colB": (False, False), "rowB": (True, False), "rowB-token-vectors": (True, True)}


def variant_config(variant, splits):
    row_b, token_vectors = VARIANTS[variant]
    return SkinnyConfig(4, 4, splits, token_vectors) if row_b else SkinnyConfig(splits=splits)


@pytest.mark.parametrize("activation", ["none", "relu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias", ["row", "col", "full", None])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_epilogue(hopper, activation, bias, splits, variant):
    m, n, k = 9, 520, 2048
    a, b = tokens(m, k, torch.bfloat16), (row_weight if VARIANTS[variant][0] else weight)(n, k, torch.bfloat16)
    c = {"row": torch.randn(n, device="cuda"), "col": torch.randn(m, 1, device="cuda"),
         "full": torch.randn(m, n, device="cuda"), None: None}[bias]
    c = c.to(torch.bfloat16) if c is not None else None
    run_twice(a, b, 1.5e-2, c=c, alpha=0.5, beta=2.0, activation=activation, config=variant_config(variant, splits))


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                             (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_output_dtypes(hopper, dtype, out_dtype, splits, variant):
    a = tokens(16, 1504, dtype)
    b = row_weight(776, 1504, dtype) if VARIANTS[variant][0] else weight(777, 1504, dtype)  # row-major B: N % 8 == 0
    run_twice(a, b, 1e-3 if out_dtype == torch.float32 else 1e-2, out_dtype=out_dtype,
              config=variant_config(variant, splits))


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("splits", [1, 2])
def test_bmm_and_column_major_tokens(hopper, m, splits):
    batch, n, k = 3, 300, 1000
    a, b = tokens(m, k, torch.bfloat16, batch), weight(n, k, torch.bfloat16, batch)
    run_twice(a, b, 1e-2, config=SkinnyConfig(splits=splits))
    run_twice(column_tokens(m, k, torch.bfloat16, batch), b, 1e-2, config=SkinnyConfig(splits=splits))
    at = tokens(m, k, torch.bfloat16, batch, major="col")
    if m * at.element_size() % 16 and m > 1:  # a column stride TMA cannot describe: matmul declines it
        assert "not a multiple of 16 bytes" in gemm.eligibility(at, b)
        return
    run_twice(at, b, 1e-2, config=SkinnyConfig(splits=splits))


def test_matches_the_wgmma_path_and_strided_output(hopper):
    a, b = tokens(16, 4096, torch.bfloat16), weight(4096, 4096, torch.bfloat16)
    assert gemm.path(a, b, skinny=False).startswith("wgmma")
    wide = torch.full((16, 5000), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = gemm.matmul(a, b, out=wide[:, :4096], skinny=True)
    ref = gemm.matmul(a, b, skinny=False)
    check(out, ref.float(), 1e-2)
    assert wide[:, 4096:].isnan().all()  # nothing written outside the output view


def test_streams_keep_separate_workspaces(hopper):
    a, b = tokens(4, 8192, torch.bfloat16), weight(2048, 8192, torch.bfloat16)
    config = SkinnyConfig(splits=8)
    ref = gemm.reference(a, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(4):
        outs.append(gemm.matmul(a, b, config=config))
        with torch.cuda.stream(side):
            outs.append(gemm.matmul(a, b, config=config))
    torch.cuda.synchronize()
    for out in outs:
        check(out, ref, 1e-2)


# ---------------------------------------------------------------------------------------------- row-major B
def row_weight(n, k, dtype, batch=None):
    """B [(batch,) k, n] row-major (N contiguous), rows padded past N to a multiple of 8 elements (16-byte
    strides, as the wgmma path's TMA needs too)."""
    pad = -(-n // 8) * 8 + 8
    lead = (batch,) if batch else ()
    return torch.randn(*lead, k, pad, device="cuda").to(dtype)[..., :n]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("nk", [(4096, 4096), (4104, 1023), (40, 4104), (8, 8), (4096, 14336), (104, 40), (33, 4104)])
def test_row_major_shapes(hopper, dtype, m, nk):
    n, k = nk
    a, b = tokens(m, k, dtype), row_weight(n, k, dtype)
    if n % 8:  # N not in whole 16-byte vectors: declined, the wgmma kernel runs it
        assert gemm.path(a, b).startswith("wgmma")
        with pytest.raises(ValueError, match="skinny"):
            gemm.matmul(a, b, skinny=True)
        run_twice(a, b, 1e-2)
        return
    # the automatic path (the wgmma kernel above SKINNY_MAX_M_ROW_B tokens), then the skinny kernel at any M
    assert gemm.path(a, b).startswith("skinny-rowB" if m <= gemm.plan.SKINNY_MAX_M_ROW_B else "wgmma")
    run_twice(a, b, 1e-2)
    if m > gemm.plan.SKINNY_MAX_M_ROW_B:
        assert gemm.path(a, b, skinny=True).startswith("skinny-rowB")
        run_twice(a, b, 1e-2, skinny=True)


@pytest.mark.parametrize("m", [1, 9, 16])
@pytest.mark.parametrize("config", [SkinnyConfig(4, 4, 1), SkinnyConfig(4, 4, 3), SkinnyConfig(8, 2, 7),
                                    SkinnyConfig(2, 3, 16), SkinnyConfig(16, 3, 2), SkinnyConfig(4, 8, 1)])
@pytest.mark.parametrize("token_vectors", [False, True], ids=["pairs", "token_vectors"])
def test_row_major_configs_and_splits(hopper, m, config, token_vectors):
    config = dataclasses.replace(config, token_vectors=token_vectors)
    a, b = tokens(m, 3000, torch.bfloat16), row_weight(1000, 3000, torch.bfloat16)
    splits = gemm.path(a, b, config=config)
    assert splits == "skinny-rowB" + (f"-splitK{config.splits}" if config.splits > 1 else "")
    run_twice(a, b, 1e-2, config=config)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("token_vectors", [False, True], ids=["pairs", "token_vectors"])
def test_row_major_bmm_and_column_major_tokens(hopper, m, splits, token_vectors):
    """Batched column-major tokens: staged, in either k order (with M = 1 and no padding: K-contiguous)."""
    batch, n, k = 3, 296, 1000
    a, b = tokens(m, k, torch.bfloat16, batch), row_weight(n, k, torch.bfloat16, batch)
    config = SkinnyConfig(4, 4, splits, token_vectors)
    assert gemm.path(a, b, config=config).startswith("skinny-rowB")
    run_twice(a, b, 1e-2, config=config)
    run_twice(column_tokens(m, k, torch.bfloat16, batch), b, 1e-2, config=config)
    at = tokens(m, k, torch.bfloat16, batch, major="col")
    if m * at.element_size() % 16 and m > 1:
        return
    run_twice(at, b, 1e-2, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("nk", [(4096, 4096), (4104, 1023), (40, 4104), (8, 8), (4096, 14336), (104, 40),
                                (64, 4100), (200, 1001)])
@pytest.mark.parametrize("token_vectors", [False, True], ids=["pairs", "token_vectors"])
def test_row_major_nan_token_padding(hopper, dtype, m, nk, token_vectors):
    """Tokens whose rows are padded with NaN past K, with the default config (split K as planned): the chunk
    holding K's end reads the padding's 16-byte block with token_vectors, and must zero it (the weight's rows
    past K are zero: NaN would still poison the sums)."""
    n, k = nk
    a, b = tokens(m, k, dtype, padding=float("nan")), row_weight(n, k, dtype)
    config = dataclasses.replace(skinny_plan.default_config(m, n, k, 1, plan_sm_count(0), row_b=True),
                                 token_vectors=token_vectors)
    assert gemm.path(a, b, config=config).startswith("skinny-rowB")
    run_twice(a, b, 1e-2, config=config)


def test_row_major_matches_the_wgmma_path_and_the_column_major_kernel(hopper):
    a, b = tokens(16, 4096, torch.bfloat16), row_weight(4096, 4096, torch.bfloat16)
    assert gemm.path(a, b, skinny=False).startswith("wgmma")
    wide = torch.full((16, 5000), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = gemm.matmul(a, b, out=wide[:, :4096], skinny=True)
    check(out, gemm.matmul(a, b, skinny=False).float(), 1e-2)
    check(out, gemm.matmul(a, b.t().contiguous().t()).float(), 1e-2)  # the column-major skinny kernel
    assert wide[:, 4096:].isnan().all()


# ---------------------------------------------------------------------------------------------- column-major tokens
def planned_config(variant, m, n, k):
    """The config matmul plans for this shape (split K included), with the variant's token_vectors."""
    row_b, token_vectors = VARIANTS[variant]
    plan = skinny_plan.make_plan(m, n, k, 1, False, "none", False, None, plan_sm_count(0), row_b=row_b)
    return dataclasses.replace(plan.config, token_vectors=token_vectors)


@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("nk", [(4096, 4096), (520, 4104), (1000, 1023), (64, 8), (4096, 14336), (104, 40)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_column_major_tokens(hopper, m, nk, variant):
    """Column-major tokens padded with NaN past K and past M, with the planned config: staged (whole 8-token
    rows; the chunk holding K's end zero-filled past K), odd K included; fp16 at K = 1023."""
    n, k = nk
    dtype = torch.float16 if k == 1023 else torch.bfloat16
    a = column_tokens(m, k, dtype)
    b = row_weight(n, k, dtype) if VARIANTS[variant][0] else weight(n, k, dtype)
    config = planned_config(variant, m, n, k)
    assert gemm.path(a, b, config=config).startswith("skinny-rowB" if VARIANTS[variant][0] else "skinny")
    run_twice(a, b, 1e-2, config=config)


@pytest.mark.parametrize("m", [1, 9, 16])
@pytest.mark.parametrize("config", [SkinnyConfig(8, 4, 1), SkinnyConfig(8, 4, 3), SkinnyConfig(4, 2, 7),
                                    SkinnyConfig(2, 1, 16), SkinnyConfig(16, 8, 2)])
@pytest.mark.parametrize("path", skinny_config.COLUMN_TOKENS)
def test_column_major_tokens_configs_and_splits(hopper, m, config, path):
    """Column-major B: load groups of 1 to 8 chunks, split K, each SkinnyConfig.column_tokens path; staged, 16
    warps x 8 chunks x 16 tokens stage 128 KB (the launch opts in past 48 KB)."""
    a, b = column_tokens(m, 3000, torch.bfloat16), weight(1000, 3000, torch.bfloat16)
    run_twice(a, b, 1e-2, config=dataclasses.replace(config, column_tokens=path))


@pytest.mark.parametrize("m", [1, 3, 8, 12, 16])
@pytest.mark.parametrize("k", [4096, 4100, 1000, 40])
@pytest.mark.parametrize("config", [SkinnyConfig(8, 4, 1), SkinnyConfig(8, 2, 3), SkinnyConfig(4, 1, 5)],
                         ids=["8x4", "8x2-splitK3", "4x1-splitK5"])
@pytest.mark.parametrize("path", skinny_config.COLUMN_TOKENS)
def test_column_token_paths(hopper, path, config, m, k):
    """Every column_tokens path against the float32 reference, K with tails (K % 32 = 4, 8, and K = 40: one full
    chunk and the tail), into NaN-poisoned outputs: column-major tokens in 8-token columns whose padding (past M
    and past K) is NaN, where the path runs; K-contiguous tokens, which every path reads as loads' 16-byte
    vectors."""
    config = dataclasses.replace(config, column_tokens=path)
    b = weight(520, k, torch.bfloat16)
    run_twice(column_tokens(m, k, torch.bfloat16), b, 1e-2, config=config)
    run_twice(tokens(m, k, torch.bfloat16, padding=float("nan")), b, 1e-2, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 12, 16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("path", skinny_config.COLUMN_TOKENS)
def test_column_token_paths_batched(hopper, path, splits, m, dtype):
    """Every column_tokens path on batches (each batch's tokens 16-byte aligned), with and without split K:
    NaN-padded column-major tokens, the benchmark's 2-D column-major tokens (batch of one) and K-contiguous
    tokens, K = 1000 (a tail of 8)."""
    batch, n, k = 3, 300, 1000
    config = SkinnyConfig(8, 2, splits, column_tokens=path)
    b = weight(n, k, dtype, batch)
    run_twice(column_tokens(m, k, dtype, batch), b, 1e-2, config=config)
    run_twice(tokens(m, k, dtype, batch), b, 1e-2, config=config)
    a2 = torch.randn(k, -(-m // 8) * 8, device="cuda").to(dtype)[:, :m].t()  # benchmarks.gemm_skinny_configs.tokens
    run_twice(a2, weight(n, k, dtype), 1e-2, config=config)


@pytest.mark.parametrize("m", [1, 9, 16])
@pytest.mark.parametrize("config", [SkinnyConfig(4, 4, 1), SkinnyConfig(4, 4, 3), SkinnyConfig(8, 2, 7),
                                    SkinnyConfig(2, 3, 16), SkinnyConfig(16, 3, 2), SkinnyConfig(8, 6, 2)])
@pytest.mark.parametrize("token_vectors", [False, True], ids=["isa_order", "token_vectors"])
def test_row_major_column_major_tokens_configs_and_splits(hopper, m, config, token_vectors):
    """Row-major B: ring depths 2 to 6, split K; 16 x 3 and 8 x 6 stages hold 9 to 16 tokens only without token
    stages (past 227 KB with them): those keep the pair-by-pair loads."""
    config = dataclasses.replace(config, token_vectors=token_vectors)
    a, b = column_tokens(m, 3000, torch.bfloat16), row_weight(1000, 3000, torch.bfloat16)
    run_twice(a, b, 1e-2, config=config)

"""nvfly's grouped GEMM against a float32 per-group reference: ragged groups (empty, smaller than a tile, unaligned),
both weight majors, the masked layout, K-grouped (weight gradient) with ragged K tails and empty groups, batched
experts, the fused gate/up SiLU epilogue, dtypes, torch._grouped_mm agreement, poisoned outputs (every row a group
owns is written, no other row is)."""
import pytest
import torch

from nvfly.ops import grouped
from nvfly.ops.gemm import GemmConfig
from nvfly.ops.grouped.plan import kgrouped_variants

pytestmark = pytest.mark.gpu

SMALL = GemmConfig(64, 128, 9, 1, stream_k=False)    # the decode tile
LARGE = GemmConfig(128, 256, 4, 2, stream_k=False)   # the prefill tile
NARROW = GemmConfig(128, 128, 6, 2, stream_k=False)


def sizes_to_offs(sizes):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()


def weights(e, k, n, major, dtype=torch.bfloat16):
    """[E, K, N] weights, N contiguous ("MN") or K contiguous ("K": F.linear's [E, N, K] passed as w.mT)."""
    if major == "MN":
        return torch.randn(e, k, n, device="cuda").to(dtype)
    return torch.randn(e, n, k, device="cuda").to(dtype).mT


def check(out, ref, tol=1e-2):
    """Rows the reference leaves NaN (no group's) must still be the poison; the others match and are finite."""
    unowned = ref.isnan()
    assert torch.equal(out.float().isnan(), unowned), "a row was written that no group owns, or one was missed"
    got, want = out.float()[~unowned], ref[~unowned]
    if want.numel() == 0:
        return 0.0
    err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    assert err < tol, err
    return err


# sizes: empty groups, groups under a tile, unaligned, one large, the last group short of the tokens' end
CONTIGUOUS_SIZES = [[0, 5, 0, 130, 64, 1, 300, 0], [17] * 8, [0, 0, 0, 513, 0, 0, 0, 0],
                    [127, 129, 3, 0, 200, 64, 1, 2]]


@pytest.mark.parametrize("config", [None, SMALL, LARGE], ids=["heuristic", "64x128", "128x256"])
@pytest.mark.parametrize("b_major", ["MN", "K"])
@pytest.mark.parametrize("sizes", CONTIGUOUS_SIZES, ids=["ragged", "even17", "one", "mixed"])
def test_contiguous_forward(hopper, sizes, b_major, config):
    k, n = 320, 272  # a K tail and an N tail
    t = sum(sizes) + 11  # rows past offs[-1]: never written
    a = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    b = weights(len(sizes), k, n, b_major)
    offs = sizes_to_offs(sizes)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, b, offs, out=out, config=config)
    check(out, grouped.reference(a, b, offs))


# the forward's candidate tiles (plan.forward_variants, benchmarks.grouped --variants) around the prefill tile
FORWARD_VARIANTS = ["current", "tma-store", "cluster2", "cluster2-tma", "cluster2n", "cluster2n-tma", "256x128-tma",
                    "pingpong-tma", "skip-empty"]


def forward_variant(name, groups, layout="contiguous", b_major="K"):
    from nvfly.ops.grouped.plan import forward_variants
    return forward_variants(LARGE, groups, layout, b_major)[name]


@pytest.mark.sweep
@pytest.mark.parametrize("name", FORWARD_VARIANTS)
@pytest.mark.parametrize("b_major", ["MN", "K"])
@pytest.mark.parametrize("sizes", CONTIGUOUS_SIZES, ids=["ragged", "even17", "one", "mixed"])
def test_forward_variants_contiguous(hopper, sizes, b_major, name):
    """Each forward variant on ragged groups (empty, under a tile, a consumer slice crossing a group's end: the TMA
    store's register fallback; a cluster's padding tile row past a group's end): every owned row right, no other
    row written; an N tail that TMA clips (and, N-clusters, a padding tile column past N)."""
    k, n = 320, 272
    t = sum(sizes) + 11
    a = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    b = weights(len(sizes), k, n, b_major)
    offs = sizes_to_offs(sizes)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, b, offs, out=out, config=forward_variant(name, len(sizes), b_major=b_major))
    check(out, grouped.reference(a, b, offs))


@pytest.mark.parametrize("name", FORWARD_VARIANTS)
def test_forward_variants_many_tiles_a_block(hopper, name):
    """Several tiles a block (the persistent loop, ping-pong turns, the ring across tiles of different groups, the
    staging buffer reused) on random ragged groups with zeros, then a second call of other sizes on the same plan."""
    gen = torch.Generator().manual_seed(FORWARD_VARIANTS.index(name))
    sizes = torch.randint(0, 800, (16,), generator=gen).tolist()
    sizes[3] = sizes[9] = 0
    k, n = 1024, 1040
    config = forward_variant(name, len(sizes))
    a = torch.randn(sum(sizes), k, device="cuda").to(torch.bfloat16)
    b = weights(len(sizes), k, n, "K")
    for group_sizes in (sizes, sizes[::-1]):
        offs = sizes_to_offs(group_sizes)
        out = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
        grouped.grouped_mm(a, b, offs, out=out, config=config)
        check(out, grouped.reference(a, b, offs))


@pytest.mark.parametrize("name", FORWARD_VARIANTS)
@pytest.mark.parametrize("b_major", ["MN", "K"])
def test_forward_variants_masked(hopper, b_major, name):
    check_masked(b_major, forward_variant(name, MASKED_EXPERTS, "masked", b_major))


@pytest.mark.parametrize("name", ["tma-store", "256x128-tma", "pingpong-tma", "cluster2n", "cluster2n-tma",
                                  "skip-empty"])
def test_forward_variants_fused_and_fallbacks(hopper, name):
    """The TMA-store and N-cluster variants on the fused gate/up tile (the output tile's staging geometry, A
    multicast), and where the output takes the register epilogue instead: rows of 540 bytes (no TMA descriptor) and
    float32 outputs."""
    sizes = [0, 9, 150, 64, 3, 129]
    offs = sizes_to_offs(sizes)
    k = 256
    a = torch.randn(sum(sizes), k, device="cuda").to(torch.bfloat16)
    config = forward_variant(name, len(sizes), b_major="MN")
    b = weights(len(sizes), k, 2 * 200, "MN")
    out = torch.full((a.shape[0], 200), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, b, offs, out=out, fuse="silu_mul", config=config)
    check(out, grouped.reference(a, b, offs, fuse="silu_mul"))
    b = weights(len(sizes), k, 270, "K")
    out = torch.full((a.shape[0], 270), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, b, offs, out=out, config=config)
    check(out, grouped.reference(a, b, offs))
    check(grouped.grouped_mm(a, b, offs, out_dtype=torch.float32, config=config), grouped.reference(a, b, offs),
          tol=3e-3)


def test_dtypes_and_k_tail(hopper):
    sizes = [40, 0, 90, 7]
    offs = sizes_to_offs(sizes)
    a = torch.randn(sum(sizes), 144, device="cuda").to(torch.float16)[:, :137]  # rows padded to 16 bytes
    b = weights(4, 137, 200, "MN", torch.float16)
    for out_dtype in (None, torch.float32, torch.bfloat16):
        out = grouped.grouped_mm(a, b, offs, out_dtype=out_dtype)
        assert out.dtype == (out_dtype or torch.float16)
        check(out, grouped.reference(a, b, offs), tol=1e-2 if out_dtype != torch.float32 else 3e-3)


def test_column_major_tokens_are_declined(hopper):
    """A group may start at any token, and with column-major tokens that start would be a TMA coordinate of the
    contiguous dimension (an illegal instruction unless a multiple of 16 bytes): nvfly declines them (the torch ops
    run torch's kernel), it never launches."""
    offs = sizes_to_offs([40, 0, 90, 7])
    a = torch.randn(256, 137, device="cuda").to(torch.float16).t().contiguous().t()[:137]
    b = weights(4, 137, 200, "MN", torch.float16)
    assert grouped.eligibility(a, b, offs).startswith("a: column-major tokens")
    with pytest.raises(ValueError, match="a: column-major tokens"):
        grouped.grouped_mm(a, b, offs)


def test_one_group(hopper):
    a = torch.randn(37, 192, device="cuda").to(torch.bfloat16)
    b = weights(1, 192, 96, "MN")
    offs = sizes_to_offs([30])
    out = torch.full((37, 96), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, b, offs, out=out)
    check(out, grouped.reference(a, b, offs))


@pytest.mark.parametrize("groups", [128, 1024])
def test_many_groups(hopper, groups):
    gen = torch.Generator().manual_seed(groups)
    sizes = torch.randint(0, 12, (groups,), generator=gen)
    sizes[torch.randperm(groups, generator=gen)[: groups // 3]] = 0
    offs = sizes_to_offs(sizes.tolist())
    a = torch.randn(int(sizes.sum()), 256, device="cuda").to(torch.bfloat16)
    b = weights(groups, 256, 64, "K")
    out = torch.full((a.shape[0], 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, b, offs, out=out)
    check(out, grouped.reference(a, b, offs))


@pytest.mark.parametrize("config", [None, SMALL, NARROW], ids=["heuristic", "64x128", "128x128"])
@pytest.mark.parametrize("b_major", ["MN", "K"])
def test_masked(hopper, b_major, config):
    check_masked(b_major, config)


MASKED_EXPERTS = 6


def check_masked(b_major, config):
    """The masked layout on 6 experts with counts 0, 1, a partial tile, full, and one past the capacity."""
    e, mmax, k, n = MASKED_EXPERTS, 200, 192, 160
    counts = torch.tensor([0, 1, 64, 200, 130, 250], dtype=torch.int32).cuda()  # 250: clamped to Mmax
    a = torch.randn(e, mmax, k, device="cuda").to(torch.bfloat16)
    b = weights(e, k, n, b_major)
    out = torch.full((e, mmax, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm_masked(a, b, counts, out=out, config=config)
    check(out, grouped.reference(a, b, counts.clamp_max(mmax), masked=True))


def test_masked_column_major_tokens(hopper):
    """The masked layout's tiles start at multiples of the tile rows, so row-contiguous (MN-major) tokens run."""
    e, mmax, k, n = 3, 128, 192, 160
    counts = torch.tensor([77, 0, 128], dtype=torch.int32).cuda()
    a = torch.randn(e, k, mmax, device="cuda").to(torch.bfloat16).mT
    b = weights(e, k, n, "MN")
    assert grouped.eligibility(a, b, counts, masked=True) is None
    out = torch.full((e, mmax, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm_masked(a, b, counts, out=out)
    check(out, grouped.reference(a, b, counts, masked=True))


# K sizes: empty groups (zeros out), under one 64-wide k-block, unaligned tails, several k-blocks
KGROUPED_SIZES = [[0, 3, 64, 130, 0, 257], [0, 1000, 0, 0, 0, 0], [5, 0, 0, 70, 0, 0]]  # 6 groups: one kernel each


def kgrouped_operands(sizes, m, n, majors):
    """The weight gradient's operands: a = x.mT (M contiguous: "MN"), b = dy (N contiguous: "MN"); "K": K
    contiguous, rows padded to 16 bytes (TMA's stride rule)."""
    total = sum(sizes)
    padded = 8 * -(-total // 8)
    def rows(r, c):  # converted before slicing: .to() of a sliced (not dense) view would repack it
        return torch.randn(r, c, device="cuda").to(torch.bfloat16)
    a = rows(total, m).mT if majors[0] == "MN" else rows(m, padded)[:, :total]
    b = rows(total, n) if majors[1] == "MN" else rows(n, padded)[:, :total].mT
    return a, b, sizes_to_offs(sizes)


@pytest.mark.parametrize("config", [None, SMALL, NARROW], ids=["heuristic", "64x128", "128x128"])
@pytest.mark.parametrize("sizes", KGROUPED_SIZES, ids=["ragged", "one", "sparse"])
def test_kgrouped_weight_gradient(hopper, sizes, config):
    m, n = 136, 200
    a, b, offs = kgrouped_operands(sizes, m, n, ("MN", "MN"))
    out = torch.full((len(sizes), m, n), float("nan"), device="cuda", dtype=torch.float32)
    grouped.grouped_mm(a, b, offs, out=out, out_dtype=torch.float32, config=config)
    ref = grouped.reference(a, b, offs)
    check(out, ref, tol=3e-3)
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(out[g], torch.zeros_like(out[g]))


@pytest.mark.parametrize("variant", list(kgrouped_variants(18)))
def test_kgrouped_bf16_variants(hopper, variant):
    """bf16 weight gradients of random ragged K (empty groups, 1..7-row groups, unaligned tails, a group of many
    k-blocks) on each K-grouped tile; M and N tails clipped by the TMA store (136 x 200)."""
    gen = torch.Generator().manual_seed(len(variant))
    sizes = [0, 1, 0, 7] + torch.randint(0, 300, (10,), generator=gen).tolist() + [0, 700, 3, 0]
    config = kgrouped_variants(len(sizes))[variant]
    m, n = 136, 200
    a, b, offs = kgrouped_operands(sizes, m, n, ("MN", "MN"))
    out = torch.full((len(sizes), m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, b, offs, out=out, config=config)
    check(out, grouped.reference(a, b, offs))
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(out[g].float(), torch.zeros(m, n, device="cuda")), g
    # a second call with other sizes and the same signature (the plan and descriptors are reused)
    sizes2 = sizes[::-1]
    a2, b2, offs2 = kgrouped_operands(sizes2, m, n, ("MN", "MN"))
    out2 = grouped.grouped_mm(a2, b2, offs2, config=config)
    check(out2, grouped.reference(a2, b2, offs2))


@pytest.mark.parametrize("variant", [name for name, cfg in kgrouped_variants(128).items() if cfg.tma_store])
def test_kgrouped_small_k_many_tiles(hopper, variant):
    """The output-bound regime on the TMA-store tiles (the default and the small-K candidates): 128 experts of 0..16 tokens (one k-block each), 1024 x
    1032 outputs (N tail clipped): ~60 tiles a block, so every staging buffer (and a store_tiles ring) is reused
    many times over while earlier stores may still read it; every tile against the reference, twice (a reused
    buffer read early would show as another tile's values)."""
    gen = torch.Generator().manual_seed(7)
    sizes = torch.randint(0, 17, (128,), generator=gen).tolist()
    config = kgrouped_variants(len(sizes))[variant]
    m, n = 1024, 1032
    a, b, offs = kgrouped_operands(sizes, m, n, ("MN", "MN"))
    ref = grouped.reference(a, b, offs)
    for _ in range(2):
        out = torch.full((len(sizes), m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        grouped.grouped_mm(a, b, offs, out=out, config=config)
        check(out, ref)
        # elementwise too (a tile of another's values hardly moves the norm of ~8000 tiles): bf16 rounding only
        bad = ((out.float() - ref).abs() > 0.02 + 0.01 * ref.abs()).nonzero()
        assert bad.numel() == 0, f"{len(bad)} elements off, first (group, row, column) {bad[0].tolist()}"


def test_kgrouped_tma_store_needs_a_tma_output(hopper):
    """An output a TMA descriptor cannot cover (a row of 196 bf16 = 392 bytes) is stored through registers; a
    strided view (rows of 208 of which 200 are the output) is stored by TMA, which leaves the padding alone."""
    sizes = [0, 40, 3, 129, 0, 64]
    for m, n, view in ((72, 196, False), (136, 200, True)):
        a, b, offs = kgrouped_operands(sizes, m, n, ("MN", "MN"))
        if n % 8:  # b's rows padded to 16 bytes (TMA's rule for inputs); only the output's rows are not
            b = torch.zeros(b.shape[0], n + 4, device="cuda", dtype=b.dtype)[:, :n].copy_(b)
        base = torch.full((len(sizes), m, n + 8 * view), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = base[..., :n]
        grouped.grouped_mm(a, b, offs, out=out)
        check(out, grouped.reference(a, b, offs))
        if view:
            assert base[..., n:].isnan().all()


@pytest.mark.parametrize("majors", [("K", "K"), ("MN", "K"), ("K", "MN")], ids=["K-K", "MN-K", "K-MN"])
def test_kgrouped_k_contiguous_operands_are_declined(hopper, majors):
    """A group's K may start anywhere: with a K-contiguous operand that start would be a TMA coordinate of the
    contiguous dimension, so nvfly declines (no launch) and nvfly::grouped_mm computes it on torch."""
    import nvfly.torch  # noqa: F401
    sizes = KGROUPED_SIZES[0]
    a, b, offs = kgrouped_operands(sizes, 136, 200, majors)
    name = "a" if majors[0] == "K" else "b"
    assert grouped.eligibility(a, b, offs).startswith(f"{name}: K-contiguous")
    with pytest.raises(ValueError, match=f"{name}: K-contiguous"):
        grouped.grouped_mm(a, b, offs, out_dtype=torch.float32)
    check(torch.ops.nvfly.grouped_mm(a, b, offs, out_dtype=torch.float32), grouped.reference(a, b, offs))


def test_batched_experts(hopper):
    a = torch.randn(5, 96, 256, device="cuda").to(torch.bfloat16)
    b = weights(5, 256, 192, "K")
    check(grouped.grouped_mm(a, b), grouped.reference(a, b))


@pytest.mark.parametrize("b_major,config", [("MN", None), ("K", SMALL), ("MN", LARGE), ("K", LARGE)],
                         ids=["MN-heuristic", "K-64x128", "MN-128x256", "K-128x256"])
def test_fused_gate_up(hopper, b_major, config):
    sizes = [0, 9, 150, 64, 3]
    inter, k = 200, 256  # I not a multiple of the tile: the gate tile's tail reads up columns, never stored
    offs = sizes_to_offs(sizes)
    a = torch.randn(sum(sizes), k, device="cuda").to(torch.bfloat16)
    b = weights(len(sizes), k, 2 * inter, b_major)
    out = torch.full((a.shape[0], inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, b, offs, out=out, fuse="silu_mul", config=config)
    check(out, grouped.reference(a, b, offs, fuse="silu_mul"))
    # masked and batched fused
    counts = torch.tensor([5, 0, 33, 64, 17], dtype=torch.int32).cuda()
    a3 = torch.randn(len(sizes), 64, k, device="cuda").to(torch.bfloat16)
    out3 = torch.full((len(sizes), 64, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm_masked(a3, b, counts, out=out3, fuse="silu_mul", config=config)
    check(out3, grouped.reference(a3, b, counts, fuse="silu_mul", masked=True))
    check(grouped.grouped_mm(a3, b, fuse="silu_mul"), grouped.reference(a3, b, fuse="silu_mul"))


def test_agrees_with_torch_grouped_mm(hopper):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    sizes = [64, 0, 128, 32, 256, 16, 0, 8]  # torch needs 16-byte aligned groups
    offs = sizes_to_offs(sizes)
    a = torch.randn(sum(sizes), 512, device="cuda").to(torch.bfloat16)
    w = torch.randn(8, 384, 512, device="cuda").to(torch.bfloat16)  # F.linear style [E, N, K]
    ours = grouped.grouped_mm(a, w.mT, offs)
    theirs = torch._grouped_mm(a, w.mT, offs)
    assert ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item() < 1e-2


def test_offsets_past_the_end_are_clamped(hopper):
    """Invalid offsets (past the tokens, decreasing) never touch memory outside the operands: the kernel clamps
    them; validate_offsets (a host sync) reports them."""
    a = torch.randn(100, 128, device="cuda").to(torch.bfloat16)
    b = weights(3, 128, 64, "MN")
    offs = torch.tensor([40, 30, 500], dtype=torch.int32).cuda()
    out = torch.full((100, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_mm(a, b, offs, out=out)
    torch.cuda.synchronize()
    # group 1 is empty after clamping; group 2 runs from offs[1] = 30 to the tokens' end (its rows 30..39, also
    # group 0's, are raced: only memory safety is promised)
    ref = a[40:100].float() @ b[2].float()
    assert torch.allclose(out[40:].float(), ref, rtol=2e-2, atol=0.5)
    with pytest.raises(ValueError, match="offs: offsets must not decrease"):
        grouped.validate_offsets(offs, 100)
    with pytest.raises(ValueError, match="^nvfly.ops.grouped.grouped_mm: offs: the last offset 500 is beyond"):
        grouped.grouped_mm(a, b, torch.tensor([40, 60, 500], dtype=torch.int32).cuda(), check_offsets=True)


def test_routing_and_autograd(hopper, monkeypatch):
    """Under nvfly.torch.routing() torch._grouped_mm / F.grouped_mm run on nvfly, forward and both gradients
    (torch's autograd formula calls _grouped_mm again: dA as 2-D x 3-D, dB as 2-D x 2-D grouped along K)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    import nvfly.torch
    calls = []
    real = grouped.grouped_mm

    def counted(*args, **kwargs):
        calls.append((args[0].dim(), args[1].dim()))
        return real(*args, **kwargs)
    monkeypatch.setattr(grouped, "grouped_mm", counted)
    sizes = [64, 0, 32, 96, 8, 56]
    offs = sizes_to_offs(sizes)
    a = torch.randn(sum(sizes), 256, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(6, 128, 256, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    with nvfly.torch.routing():
        y = torch.nn.functional.grouped_mm(a, w.mT, offs=offs) if hasattr(torch.nn.functional, "grouped_mm") \
            else torch._grouped_mm(a, w.mT, offs)
        y.float().square().sum().backward()
    assert sorted(calls) == [(2, 2), (2, 3), (2, 3)], calls  # forward, dA and dB (K-grouped)
    a32, w32 = a.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = grouped.reference(a32, w32.mT, offs)
    check(y, ref)
    ref.square().sum().backward()
    for got, want in ((a.grad, a32.grad), (w.grad, w32.grad)):
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2


def test_custom_op_autograd_fused(hopper):
    import nvfly.torch  # noqa: F401
    sizes = [20, 0, 70, 38]
    offs = sizes_to_offs(sizes)
    a = torch.randn(sum(sizes), 128, device="cuda").to(torch.bfloat16).requires_grad_()
    b = (torch.randn(4, 128, 192, device="cuda") / 12).to(torch.bfloat16).requires_grad_()
    y = torch.ops.nvfly.grouped_mm(a, b, offs, fuse="silu_mul")
    y.float().square().sum().backward()
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ref = grouped.reference(a32, b32, offs, fuse="silu_mul")
    check(y, ref)
    ref.square().sum().backward()
    for got, want in ((a.grad, a32.grad), (b.grad, b32.grad)):
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2


def test_moe_layer_eager_and_compiled(hopper):
    from nvfly.ops import moe
    t, h, inter, e, k = 300, 512, 256, 16, 4
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    router = torch.randn(e, h, device="cuda").to(torch.bfloat16)
    w_gate_up = (torch.randn(e, 2 * inter, h, device="cuda") / 22).to(torch.bfloat16)
    w_down = (torch.randn(e, h, inter, device="cuda") / 16).to(torch.bfloat16)
    ref = moe.reference(x, router, w_gate_up, w_down, k)
    out = moe.moe(x, router, w_gate_up, w_down, k)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    compiled = torch.compile(lambda *args: moe.moe(*args, k))
    got = compiled(x, router, w_gate_up, w_down)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 2e-2


def test_moe_layer_gradients(hopper):
    """benchmarks.grouped's MoE layer on nvfly's differentiable ops (fused gate/up, the K-grouped weight gradients on
    the heuristic's ping-pong TMA-store tile), eager and compiled: the float32 layer's output, and the gradients of
    x and every weight of the eager torch._grouped_mm layer."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    import nvfly.torch  # noqa: F401
    from benchmarks.grouped import chunked_rel_err, nvfly_moe, torch_moe
    from nvfly.ops import moe
    t, h, inter, e, k = 300, 512, 256, 16, 4
    args = [torch.randn(t, h, device="cuda").to(torch.bfloat16),
            (torch.randn(e, h, device="cuda") / 22).to(torch.bfloat16),
            (torch.randn(e, 2 * inter, h, device="cuda") / 22).to(torch.bfloat16),
            (torch.randn(e, h, inter, device="cuda") / 16).to(torch.bfloat16)]
    ref = moe.reference(*args, k)
    leaves = [a.requires_grad_() for a in args]
    grad = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    want = torch.autograd.grad(torch_moe(*leaves, k), leaves, grad)
    for layer in (lambda *a: nvfly_moe(*a, k), torch.compile(lambda *a: nvfly_moe(*a, k))):
        out = layer(*leaves)
        assert chunked_rel_err(out, ref) < 2e-2
        for got, w in zip(torch.autograd.grad(out, leaves, grad), want):
            assert chunked_rel_err(got, w) < 2e-2


def test_inductor_max_autotune_grouped_mm(hopper):
    """nvfly's grouped candidates join max-autotune's grouped mm (ATen only beside them, to keep the compile short);
    the compiled result is right whichever wins."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    import nvfly.torch
    from torch._inductor import config as inductor_config
    from nvfly.torch.gemm_ops import decisions
    sizes = [64, 0, 128, 40, 200, 16]
    offs = sizes_to_offs(sizes)
    a = torch.randn(sum(sizes), 512, device="cuda").to(torch.bfloat16)
    w = torch.randn(6, 256, 512, device="cuda").to(torch.bfloat16)
    torch._dynamo.reset()
    nvfly.torch.install()
    try:
        with inductor_config.patch({"max_autotune_gemm_backends": "ATEN", "fx_graph_cache": False}):
            fn = torch.compile(lambda a, w, o: torch._grouped_mm(a, w.mT, o), mode="max-autotune-no-cudagraphs")
            out = fn(a, w, offs)
    finally:
        nvfly.torch.uninstall()
        torch._dynamo.reset()
    check(out, grouped.reference(a, w.mT, offs))
    (d,) = [d for d in decisions() if d.where == "inductor" and d.op == "grouped_mm"][-1:]
    assert d.candidates and d.candidates[0] == "auto", d
    assert any(name.startswith("nvfly") for name in d.timings_ms), d  # nvfly's choices were benchmarked


def test_cuda_graph_replays_new_group_sizes(hopper):
    """No host read of the sizes: a captured call replays correctly after the device offsets and counts change (a
    host sync would also make the capture itself fail)."""
    e, k, n = 6, 256, 192
    b = weights(e, k, n, "K")
    a = torch.randn(400, k, device="cuda").to(torch.bfloat16)
    offs = sizes_to_offs([50, 0, 100, 7, 200, 43])
    out = torch.full((400, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    a3 = torch.randn(e, 64, k, device="cuda").to(torch.bfloat16)
    counts = torch.tensor([3, 64, 0, 17, 1, 40], dtype=torch.int32).cuda()
    out3 = torch.full((e, 64, n), float("nan"), device="cuda", dtype=torch.bfloat16)

    def step():
        grouped.grouped_mm(a, b, offs, out=out)
        grouped.grouped_mm_masked(a3, b, counts, out=out3)
    step()  # descriptors and kernels made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    offs.copy_(sizes_to_offs([0, 120, 3, 200, 0, 60]))
    counts.copy_(torch.tensor([64, 0, 9, 33, 2, 0], dtype=torch.int32))
    a.copy_(torch.randn_like(a))
    out.fill_(float("nan"))
    out3.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(out[:383], grouped.reference(a[:383], b, offs))
    assert out[383:].isnan().all()
    check(out3, grouped.reference(a3, b, counts, masked=True))

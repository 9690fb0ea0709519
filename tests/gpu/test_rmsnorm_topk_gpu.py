"""RMSNorm and TopK on the GPU: RMSNorm against a float64 reference (forward, fused residual add, backward),
TopK values and indices against torch.topk and against the documented tie rule (a stable sort), NaN and inf,
poisoned outputs, and routing of F.rms_norm / torch.topk in eager mode and next to torch.compile."""
import pytest
import torch
import torch.nn.functional as F

from nvfly.ops import rmsnorm, topk
from nvfly.ops.rmsnorm import plan as rmsnorm_plan
from nvfly.torch import ops as nvfly_ops  # noqa: F401  (registers the nvfly:: custom ops)
from nvfly.torch.routing import install_routing, installed, routing

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-5}


def poison_allocator(*shapes_dtypes):
    """Fill freed blocks of the sizes about to be allocated with NaN (or -1), so unwritten outputs show."""
    blocks = []
    for shape, dtype in shapes_dtypes:
        fill = float("nan") if dtype.is_floating_point else -1
        blocks.append(torch.full(shape, fill, dtype=dtype, device="cuda"))
    del blocks


def rms_norm_float64(x, weight, eps, dims):
    xd = x.double()
    rstd = torch.rsqrt(xd.pow(2).mean(dims, keepdim=True) + eps)
    y = xd * rstd
    return (y * weight.double() if weight is not None else y), rstd


# ---------------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048), (37, 4096), (256, 7168), (64, 8192), (9, 16384), (4096, 128),
                                   (5, 1001), (3, 4097), (2, 300_000), (1000, 2048),
                                   # long rows by their count: the row kernel at 2 vectors, persistent, two-pass
                                   (132, 8192), (512, 7168), (1000, 5120), (257, 16384), (384, 8192)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_float64(dtype, shape, with_weight):
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    w = torch.randn(shape[-1], device="cuda").to(dtype) if with_weight else None
    poison_allocator((shape, dtype), ((shape[0],), torch.float32))
    y, _, rstd = rmsnorm.rms_norm_forward(x, w, 1e-6)
    ref, ref_rstd = rms_norm_float64(x, w, 1e-6, [-1])
    assert torch.isfinite(y).all()
    tol = TOL[dtype]
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert torch.allclose(rstd.double(), ref_rstd.flatten(), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(33, 4096), (2, 2048), (300, 1001)])
def test_fused_add_rms_norm(dtype, shape):
    x = torch.randn(shape, device="cuda").to(dtype)
    r = torch.randn(shape, device="cuda").to(dtype)
    w = torch.randn(shape[-1], device="cuda").to(dtype)
    poison_allocator((shape, dtype), (shape, dtype))
    y, h = rmsnorm.rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(h, x + r)  # rounded to the storage type exactly like the unfused add
    ref, _ = rms_norm_float64(x + r, w, 1e-5, [-1])
    tol = TOL[dtype]
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_rms_norm_strided_rows_3d_and_default_eps():
    base = torch.randn(4, 6, 4096 + 64, device="cuda").to(torch.bfloat16)
    x = base[..., 8:4096 + 8]  # rows 4160 elements apart, starting 16 bytes in
    w = torch.randn(4096, device="cuda").to(torch.bfloat16)
    y = rmsnorm.rms_norm(x, w)
    ref = F.rms_norm(x.float(), (4096,), w.float()).double()  # eps=None: float32's epsilon in both
    assert torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2)
    z = torch.randn(8, 16, 64, device="cuda")
    y2 = rmsnorm.rms_norm(z, normalized_shape=(16, 64), eps=1e-6)
    ref2, _ = rms_norm_float64(z, None, 1e-6, [-2, -1])
    assert torch.allclose(y2.double(), ref2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048), (300, 4096), (4096, 2048), (17, 1001), (64, 16384), (8, 7168)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_backward_matches_float64_autograd(dtype, shape, residual):
    x = torch.randn(shape, device="cuda").to(dtype).requires_grad_()
    r = torch.randn(shape, device="cuda").to(dtype).requires_grad_() if residual else None
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(dtype).requires_grad_()
    dy = torch.randn(shape, device="cuda").to(dtype)
    dh = torch.randn(shape, device="cuda").to(dtype) if residual else None
    if residual:
        y, h, _ = torch.ops.nvfly.fused_add_rms_norm(x, r, [shape[-1]], w, 1e-6)
        torch.autograd.backward([y, h], [dy, dh])
    else:
        y, _ = torch.ops.nvfly.rms_norm(x, [shape[-1]], w, 1e-6)
        y.backward(dy)
    xd = x.detach().double().requires_grad_()
    rd = r.detach().double().requires_grad_() if residual else None
    wd = w.detach().double().requires_grad_()
    hd = xd + rd if residual else xd
    yd, _ = rms_norm_float64(hd, wd, 1e-6, [-1])
    outputs, grads = ([yd, hd], [dy.double(), dh.double()]) if residual else ([yd], [dy.double()])
    torch.autograd.backward(outputs, grads)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for got, ref in [(x.grad, xd.grad), (w.grad, wd.grad)] + ([(r.grad, rd.grad)] if residual else []):
        scale = ref.abs().max().item()
        assert torch.allclose(got.double(), ref, rtol=tol, atol=tol * scale), (got - ref).abs().max()


def test_rms_norm_backward_without_weight_and_large_m():
    x = torch.randn(20000, 1024, device="cuda").requires_grad_()
    y, _ = torch.ops.nvfly.rms_norm(x, [1024], None, 1e-6)
    dy = torch.randn_like(y)
    y.backward(dy)
    xd = x.detach().double().requires_grad_()
    rms_norm_float64(xd, None, 1e-6, [-1])[0].backward(dy.double())
    assert torch.allclose(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- RMSNorm persistent
def rms_norm_float32(x, weight, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * (weight.float() if weight is not None else 1)), rstd.flatten()


# (16421, 2048): 8211 tiles over the 5-blocks-an-SM grid, uneven; (5, 2048): fewer tiles than blocks; odd lengths
# read in element accesses; 7168 and 16384: rows whose last vector is partly past the row end / 512-thread blocks
PERSISTENT_SHAPES = [(16421, 2048), (4099, 7168), (1001, 4096), (5, 2048), (777, 1001), (3001, 8192), (2051, 16384)]


def forward_inputs(shape, dtype, variant):
    """x (scaled randn), and the weight and residual the variant ("plain", "weight", "residual") uses."""
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    w = torch.randn(shape[1], device="cuda").to(dtype) if variant != "plain" else None
    r = torch.randn(shape, device="cuda").to(dtype) if variant == "residual" else None
    return x, w, r


def check_forward_on_request(shape, dtype, variant, options, kind):
    """The forward under ``options`` (whose plan must be ``kind``: "persistent", "two_pass") against a float32
    reference, outputs poisoned: y, rstd, and x + r bit for bit."""
    x, w, r = forward_inputs(shape, dtype, variant)
    assert getattr(rmsnorm.plan_of(x, w, r, options=options), kind)
    poison_allocator((shape, dtype), (shape, dtype), ((shape[0],), torch.float32))
    y, h, rstd = rmsnorm.rms_norm_forward(x, w, 1e-6, r, options=options)
    if r is not None:
        assert torch.equal(h, x + r)  # every element written, rounded like the unfused add
    ref, ref_rstd = rms_norm_float32(x + r if r is not None else x, w, 1e-6)
    assert torch.isfinite(y).all() and torch.isfinite(rstd).all()
    tol = TOL[dtype]
    assert torch.allclose(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert torch.allclose(rstd, ref_rstd, rtol=1e-5)


@pytest.mark.parametrize("dtype,hints", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False),
                                         (torch.float32, False)])
@pytest.mark.parametrize("shape", PERSISTENT_SHAPES)
@pytest.mark.parametrize("variant", ["plain", "weight", "residual"])
def test_persistent_rms_norm_matches_float32(dtype, hints, shape, variant):
    options = rmsnorm.ForwardOptions(persistent=True, cache_hints=hints)
    if dtype == torch.float32 and shape[1] == 16384:  # two tiles of fp32 rows of 16384 do not fit the registers
        x, w, r = forward_inputs(shape, dtype, variant)
        with pytest.raises(ValueError, match="persistent"):
            rmsnorm.rms_norm_forward(x, w, 1e-6, r, options=options)
        return
    check_forward_on_request(shape, dtype, variant, options, "persistent")


@pytest.mark.parametrize("option, m, n", [("persistent", 16421, 2048), ("two_pass", 1000, 8192)])
def test_forward_plan_on_request_agrees_with_the_row_kernel(option, m, n):
    x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, device="cuda").to(torch.bfloat16)
    forced = rmsnorm.ForwardOptions(**{option: True})
    assert getattr(rmsnorm.plan_of(x, w, options=forced), option) and not getattr(rmsnorm.plan_of(x, w), option)
    poison_allocator((x.shape, x.dtype))
    y = rmsnorm.rms_norm_forward(x, w, 1e-6, options=forced)[0]
    rows = rmsnorm.rms_norm(x, w, 1e-6)
    # the same fp32 math but another order of the sum of squares: at most a rounding step of bf16 apart
    assert torch.allclose(y.float(), rows.float(), rtol=2 ** -7, atol=0)


def check_strided_rows(options, kind):
    """x and the residual as views of wider rows (4160 elements apart, starting 16 and 32 bytes in), 3-D, under
    ``options`` (whose plan must be ``kind``, in 16-byte vectors): y, rstd, and x + r bit for bit."""
    base = torch.randn(4, 6, 4096 + 64, device="cuda").to(torch.bfloat16)
    x, r = base[..., 8:4096 + 8], base[..., 16:4096 + 16]
    w = torch.randn(4096, device="cuda").to(torch.bfloat16)
    p = rmsnorm.plan_of(x, w, r, options=options)
    assert getattr(p, kind) and p.vec == 8
    poison_allocator((x.shape, x.dtype), (x.shape, x.dtype), ((24,), torch.float32))
    y, h, rstd = rmsnorm.rms_norm_forward(x, w, 1e-6, r, options=options)
    assert torch.equal(h, x + r)
    ref, ref_rstd = rms_norm_float32((x + r).reshape(24, 4096), w, 1e-6)
    assert torch.allclose(y.reshape(24, 4096).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert torch.allclose(rstd, ref_rstd, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- RMSNorm bulk copies
# rows a block walks past its ring more than once (4099, 5000), fewer rows than blocks (1, 64, 133), rows whose
# last vector some threads do not have (7168 at 256 threads), rows of a block of 512 (16384)
BULK_SHAPES = [(4099, 7168), (1001, 8192), (300, 2048), (64, 16384), (1, 8192), (133, 4096), (5000, 4096)]
BULK_OPTIONS = {
    "default": rmsnorm.ForwardOptions(bulk=True),
    "2 stages": rmsnorm.ForwardOptions(bulk=True, bulk_stages=2),
    "128x4": rmsnorm.ForwardOptions(bulk=True, bulk_threads=128, bulk_blocks_per_sm=4),
    "1 block": rmsnorm.ForwardOptions(bulk=True, bulk_blocks_per_sm=1),
}


@pytest.mark.parametrize("dtype,options", [(torch.bfloat16, name) for name in BULK_OPTIONS] +
                         [(torch.float16, "default"), (torch.float32, "default")])
@pytest.mark.parametrize("shape", BULK_SHAPES)
@pytest.mark.parametrize("variant", ["plain", "weight", "residual"])
def test_bulk_rms_norm_matches_float32(dtype, options, shape, variant):
    chosen = BULK_OPTIONS[options]
    x, w, r = forward_inputs(shape, dtype, variant)
    try:
        rmsnorm.plan_of(x, w, r, options=chosen)
    except ValueError as e:  # fp32 rows of 16384 (1024 threads), 128 threads for rows over 4096: said, not run
        assert "options.bulk" in str(e) and shape[1] * x.element_size() // 16 > 128 * rmsnorm_plan.BULK_VECTORS_PER_THREAD
        return
    check_forward_on_request(shape, dtype, variant, chosen, "bulk")


def test_bulk_rms_norm_strided_rows_and_odd_lengths():
    """x and the residual as views of wider rows (4160 elements apart, starting 16 and 32 bytes in), 3-D; rows
    that are not whole 16-byte vectors are declined with the reason."""
    check_strided_rows(BULK_OPTIONS["default"], "bulk")
    odd = torch.randn(8, 1001, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="options.bulk"):
        rmsnorm.rms_norm_forward(odd, None, 1e-6, options=BULK_OPTIONS["default"])


# ---------------------------------------------------------------------------------------------- RMSNorm two-pass
# one step a row (8192: exactly; 7168 and 2048: the last vector of some threads past the row end), rows of several
# steps (16384 at 256 threads, 300_008: a masked last step, and the default's 1024 threads), odd lengths read in
# element accesses (1001, 4097), a single row
TWO_PASS_SHAPES = [(4099, 7168), (1001, 8192), (300, 2048), (64, 16384), (3, 300_008), (777, 1001), (33, 4097),
                   (1, 8192)]
TWO_PASS_OPTIONS = {
    "default": rmsnorm.ForwardOptions(two_pass=True),
    "hints": rmsnorm.ForwardOptions(two_pass=True, cache_hints=True),
    "256x4": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=256, two_pass_vectors=4),
    "1024x1": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=1024, two_pass_vectors=1),
    # blocks of 14 and 5 warps: block_sum over a warp count that is not a power of two
    "448": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=448, cache_hints=rmsnorm.LOAD_HINTS),
    "160x4": rmsnorm.ForwardOptions(two_pass=True, two_pass_threads=160, two_pass_vectors=4),
}


@pytest.mark.parametrize("dtype,options", [(torch.bfloat16, name) for name in TWO_PASS_OPTIONS] +
                         [(torch.float16, "default"), (torch.float32, "default"), (torch.float32, "hints")])
@pytest.mark.parametrize("shape", TWO_PASS_SHAPES)
@pytest.mark.parametrize("variant", ["plain", "weight", "residual"])
def test_two_pass_rms_norm_matches_float32(dtype, options, shape, variant):
    check_forward_on_request(shape, dtype, variant, TWO_PASS_OPTIONS[options], "two_pass")


@pytest.mark.parametrize("options", ["default", "hints"])
def test_two_pass_rms_norm_strided_rows(options):
    """x and the residual as views of wider rows (4160 elements apart, starting 16 and 32 bytes in), 3-D."""
    check_strided_rows(TWO_PASS_OPTIONS[options], "two_pass")


# ---------------------------------------------------------------------------------------------- TopK
def permuted_levels(shape, dtype):
    """Rows holding a random permutation of evenly spaced levels, exact in the dtype: distinct values in fp32,
    256 levels (so ties once rows are longer) in 16-bit types."""
    m, n = shape
    levels = n if dtype == torch.float32 else min(n, 256)
    base = torch.rand(m, n, device="cuda").argsort(-1) % levels
    return ((base.float() - levels / 2) / 4).to(dtype)


def stable_reference(x, k, largest):
    """The documented rule: a stable sort (ties lowest index first, NaN largest)."""
    v, i = torch.sort(x, dim=-1, descending=largest, stable=True)
    return v[..., :k], i[..., :k]


def check_topk(x, k, largest=True):
    poison_allocator(((x.shape[0], k), x.dtype), ((x.shape[0], k), torch.int64))
    values, indices = topk.topk(x, k, largest=largest)
    ref_v, ref_i = stable_reference(x, k, largest)
    assert torch.equal(indices, ref_i)
    assert torch.equal(values.isnan(), ref_v.isnan()) and torch.equal(values.nan_to_num(), ref_v.nan_to_num())
    tv, ti = torch.topk(x, k, largest=largest)
    assert torch.equal(values.isnan(), tv.isnan()) and torch.equal(values.nan_to_num(), tv.nan_to_num())
    if k > 32:  # torch's sort of the selected elements is stable there: identical indices
        assert torch.equal(indices, ti)
    else:  # same elements selected; torch's bitonic sort may order equal values differently
        assert torch.equal(indices.sort(-1).values, ti.sort(-1).values)


SUITE = [(64, 128, 2), (4096, 256, 8), (16384, 128, 2), (16384, 256, 8), (1, 128256, 50), (64, 151936, 1024),
         (256, 151936, 50), (256, 128256, 1024), (1, 151936, 1024)]
OTHER = [(3, 8, 8), (7, 1000, 33), (2, 262144, 2048), (100_000, 128, 2), (5, 5000, 1000), (1, 64, 1),
         (11, 4096, 2048), (3, 4097, 17), (130, 50257, 64), (70_000, 1100, 40)]


@pytest.mark.parametrize("m,n,k", SUITE + OTHER)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_exact_against_torch(m, n, k, dtype):
    x = torch.randn(m, n, device="cuda").to(dtype)  # bf16 rows of 128K+ have many ties
    check_topk(x, k)
    check_topk(x, min(k, n), largest=False)


@pytest.mark.parametrize("m,n,k", [(64, 256, 8), (3, 151936, 50), (4, 9000, 1024), (2, 1000, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk_permuted_levels_and_heavy_ties(m, n, k, dtype):
    check_topk(permuted_levels((m, n), dtype), k)
    ties = torch.randint(-2, 3, (m, n), device="cuda").to(dtype)  # five values: most of the top k are ties
    check_topk(ties, k)
    check_topk(ties, k, largest=False)
    check_topk(torch.zeros(m, n, device="cuda", dtype=dtype), k)


@pytest.mark.parametrize("n,k", [(256, 8), (151936, 50), (5000, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_nan_and_inf(n, k, dtype):
    """NaN ranks above +inf (first when largest, last when smallest), as in torch.topk on CUDA."""
    x = torch.randn(4, n, device="cuda")
    special = torch.rand(4, n, device="cuda")
    x[special < 0.01] = float("nan")
    x[(special >= 0.01) & (special < 0.02)] = float("inf")
    x[(special >= 0.02) & (special < 0.03)] = -float("inf")
    x = x.to(dtype)
    check_topk(x, k)
    check_topk(x, k, largest=False)


def test_topk_sorted_false_other_dims_and_sorted_inputs():
    x = torch.randn(6, 3000, 5, device="cuda")
    v, i = topk.topk(x, 40, dim=1, sorted=False)
    tv, ti = torch.topk(x, 40, dim=1)
    assert torch.equal(v, tv) and torch.equal(i, ti)
    rising = torch.arange(200_000, device="cuda", dtype=torch.float32).repeat(2, 1)  # every element a candidate
    check_topk(rising, 1024)
    check_topk(rising.flip(-1).contiguous(), 1024)


# ---------------------------------------------------------------------------------------------- routing
@pytest.fixture
def routed():
    install_routing()
    with routing():  # registered while a block is in force
        assert {"aten::_fused_rms_norm", "aten::_fused_rms_norm_backward", "aten::topk"} <= set(installed())
    assert installed() == []


def test_routing_sends_eligible_calls_to_nvfly(routed, monkeypatch):
    calls = []
    for module, name in [(rmsnorm, "rms_norm_forward"), (rmsnorm, "rms_norm_backward"), (topk, "topk")]:
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    x = torch.randn(8192, 4096, device="cuda").to(torch.bfloat16).requires_grad_()  # 128 MiB moved: not launch-bound
    w = torch.randn(4096, device="cuda").to(torch.bfloat16).requires_grad_()
    logits = torch.randn(8, 151936, device="cuda")
    y_torch = F.rms_norm(x, (4096,), w, 1e-6)
    topk_torch = torch.topk(logits, 50)
    assert calls == []
    with routing():
        F.rms_norm(x[:64].detach(), (4096,), w.detach(), 1e-6)  # 1 MiB eagerly: launch-bound, torch runs it
        y = F.rms_norm(x, (4096,), w, 1e-6)
        y.float().square().sum().backward()
        v, i = torch.topk(logits, 50)
        torch.topk(logits, 4096)  # k > 2048: declined, torch runs it
    assert calls == ["rms_norm_forward", "rms_norm_backward", "topk"]
    assert torch.allclose(y.float(), y_torch.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(v, topk_torch.values) and torch.equal(i, topk_torch.indices)
    grad_x, grad_w = x.grad.clone(), w.grad.clone()
    x.grad, w.grad = None, None
    F.rms_norm(x, (4096,), w, 1e-6).float().square().sum().backward()
    assert torch.allclose(grad_x.float(), x.grad.float(), rtol=5e-2, atol=5e-2)
    assert torch.allclose(grad_w.float(), w.grad.float(), rtol=5e-2, atol=0.5)


def test_routing_falls_back_when_nvfly_raises(routed, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated nvfly failure")

    monkeypatch.setattr(topk, "topk", broken)
    logits = torch.randn(4, 1000, device="cuda")
    with routing():
        v, i = torch.topk(logits, 10)
    ref = torch.topk(logits, 10)
    assert torch.equal(v, ref.values) and torch.equal(i, ref.indices)


def test_custom_ops_under_torch_compile():
    x = torch.randn(32, 4096, device="cuda").to(torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda").to(torch.bfloat16)
    logits = torch.randn(16, 151936, device="cuda")

    def model(x, r, w, logits):
        y, h, _ = torch.ops.nvfly.fused_add_rms_norm(x, r, [4096], w, 1e-6)
        z, _ = torch.ops.nvfly.rms_norm(h * 2, [4096], w, 1e-6)
        v, i = torch.ops.nvfly.topk(logits.float() * 2, 50)
        return y, z, v, i

    compiled = torch.compile(model, fullgraph=True)
    for got, ref in zip(compiled(x, r, w, logits), model(x, r, w, logits)):
        assert torch.equal(got, ref)


def test_routing_next_to_torch_compile(routed):
    x = torch.randn(16, 2048, device="cuda").requires_grad_()
    w = torch.randn(2048, device="cuda").requires_grad_()

    def f(x, w):
        return F.rms_norm(x, (2048,), w, 1e-6).sum()

    with routing():
        compiled = torch.compile(f)(x, w)  # Inductor's own kernel inside the graph
        eager = f(x, w)  # nvfly
    assert torch.allclose(compiled, eager, rtol=1e-4, atol=1e-2)

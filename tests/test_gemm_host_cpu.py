"""GEMM's per-call host path on CPU: a cached call signature launches exactly what a first call would.

Kernels 'launch' on CPU tensors through the real binder and generated launch code with a recording
cuLaunchKernel; TMA descriptors carry their tensor's address in place of the driver's encoding."""
import struct

import pytest
import torch

from nvfly.ops import gemm
from nvfly.ops.common import scheduler
from nvfly.ops.common.opcall import Declined, OpCalls
from nvfly.ops.gemm import GemmConfig
from nvfly.ops.gemm.skinny_config import SkinnyConfig
from nvfly.runtime.tma import TmaDescriptor


@pytest.fixture
def fake_launches(recorded_launches, monkeypatch):
    """recorded_launches (conftest), eligibility assumed, and TMA descriptors that hold their tensor's address
    in place of the driver's encoding."""
    def descriptor(tensor, box, swizzle=128):
        desc = TmaDescriptor(tensor, box, swizzle)
        desc.raw = struct.pack("<Q", tensor.data_ptr()).ljust(128, b"\0")
        return desc
    monkeypatch.setattr(gemm.skinny_plan, "current_stream", lambda device: 0)
    monkeypatch.setattr(gemm.api, "current_stream", lambda device: 0)
    monkeypatch.setattr(gemm.api, "eligibility", lambda *args, **kwargs: None)
    monkeypatch.setattr(gemm, "eligibility", lambda *args, **kwargs: None)  # as the torch ops look it up
    monkeypatch.setattr(gemm.api, "cached_descriptor", descriptor)
    gemm.api._CALLS.clear()
    yield recorded_launches
    gemm.api._CALLS.clear()


def _bf(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


CASES = [
    ("wgmma", lambda: (_bf(256, 128), _bf(128, 384)), {}),
    ("wgmma tma-store", lambda: (_bf(256, 128), _bf(384, 128).t()), {"config": GemmConfig(128, 128, 5, 2,
                                                                                          pingpong=True,
                                                                                          tma_store=True)}),
    ("wgmma split-K bias", lambda: (_bf(128, 2048), _bf(2048, 256)),
     {"config": GemmConfig(128, 128, 4, 2, split_k=4), "c": _bf(256), "alpha": 0.5}),
    ("wgmma swap-AB", lambda: (_bf(24, 256), _bf(256, 512)), {"skinny": False}),
    ("wgmma swap-AB split-K bias", lambda: (_bf(40, 2048), _bf(2048, 256)),
     {"config": GemmConfig(64, 40, 4, 1, split_k=4), "swap": True, "c": _bf(40, 1), "alpha": 0.5}),
    ("wgmma stream-K tail", lambda: (_bf(2000, 2560), _bf(2560, 2104)), {"c": _bf(2104), "alpha": 0.5}),
    ("wgmma batched", lambda: (_bf(2, 128, 64), _bf(2, 64, 128)), {}),
    ("skinny", lambda: (_bf(4, 512), _bf(256, 512).t()), {}),
    ("skinny split-K", lambda: (_bf(16, 4096), _bf(64, 4096).t()), {"config": SkinnyConfig(splits=4)}),
    ("skinny row-B", lambda: (_bf(8, 256), _bf(256, 128)), {"skinny": True, "activation": "silu"}),
]


@pytest.mark.parametrize("name,make,options", CASES, ids=[c[0] for c in CASES])
def test_repeat_calls_launch_what_a_first_call_would(fake_launches, name, make, options):
    first, second = make(), make()
    gemm.matmul(*first, **options)
    n = len(fake_launches)
    out2 = gemm.matmul(*second, **options)
    fast = fake_launches[n:]
    assert len(fast) == n > 0
    gemm.api._CALLS.clear()
    out3 = gemm.matmul(*second, **options)
    c = options.get("c")
    _assert_same_launches(fast, fake_launches[2 * n:], [*second, out2] + ([c] if c is not None else []), out2, out3)


def _assert_same_launches(fast: list, reference: list, tensors: list, out: torch.Tensor,
                          reference_out: torch.Tensor) -> None:
    """The launches of a cached call (``fast``, writing ``out``) equal those of a first call (``reference``,
    writing ``reference_out``) up to the output's address and fresh scratch buffers (split-K partials)."""
    assert len(fast) == len(reference) > 0
    known = {t.data_ptr() for t in tensors}
    moved = {reference_out.data_ptr(): out.data_ptr()}

    def canonical(params, mapping):
        params = tuple(mapping.get(v, v) if type(v) is int else v for v in params)
        return tuple("scratch" if type(v) is int and v >= 1 << 32 and v not in known else
                     v.replace(struct.pack("<Q", reference_out.data_ptr()), struct.pack("<Q", out.data_ptr()))
                     if type(v) is bytes else v for v in params)
    for (k1, g1, p1), (k2, g2, p2) in zip(fast, reference):
        assert (k1, g1) == (k2, g2)
        assert canonical(p1, {}) == canonical(p2, moved)
    assert out.shape == reference_out.shape and out.stride() == reference_out.stride()


def _swap_config() -> str:
    from nvfly.torch.gemm_ops import encode_config
    return encode_config(GemmConfig(128, 32, 5, 2), swap=True)


OP_CASES = [
    ("mm_out wgmma", lambda: (_bf(256, 128), _bf(384, 128).t()), "mm_out", {}),
    ("mm_out swapped config", lambda: (_bf(24, 256), _bf(256, 512)), "mm_out", {"config": _swap_config}),
    ("addmm_out bias alpha", lambda: (_bf(384), _bf(256, 128), _bf(128, 384)), "addmm_out",
     {"alpha": 0.5, "beta": 2.0}),
    ("mm skinny", lambda: (_bf(4, 512), _bf(256, 512).t()), "mm", {}),
    ("bmm", lambda: (_bf(2, 128, 64), _bf(2, 64, 128)), "bmm", {}),
]


@pytest.mark.parametrize("name,make,op,options", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_repeat_op_calls_launch_what_a_first_call_would(fake_launches, monkeypatch, name, make, op, options):
    """nvfly's torch ops bind a signature's launches on its first call; later calls (other tensors, same layouts)
    go straight to them and launch exactly what a first call would."""
    import nvfly.torch  # noqa: F401  (defines torch.ops.nvfly)
    from nvfly.torch import gemm_ops
    options = {k: v() if callable(v) else v for k, v in options.items()}
    monkeypatch.setattr(gemm_ops, "_BOUND", OpCalls())

    def call(operands):
        *c, a, b = operands
        if op.endswith("_out"):
            out = torch.full((*a.shape[:-1], b.shape[-1]), float("nan")).to(torch.bfloat16)
            getattr(torch.ops.nvfly, op)(*operands, out, **options)
            return out
        return getattr(torch.ops.nvfly, op)(*operands, **options)
    first, second = make(), make()
    call(first)
    n = len(fake_launches)
    assert n > 0 and all(type(v) is not Declined for v in gemm_ops._BOUND.values())
    out2 = call(second)
    fast = fake_launches[n:]
    gemm_ops._BOUND.clear()
    gemm.api._CALLS.clear()
    out3 = call(second)
    _assert_same_launches(fast, fake_launches[2 * n:], [*second, out2], out2, out3)


def test_output_layout_is_part_of_the_signature(fake_launches):
    a, b = _bf(256, 128), _bf(384, 128).t()
    config = GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True)
    gemm.matmul(a, b, config=config)
    wide = torch.empty(256, 390).to(torch.bfloat16)[:, :384]  # a row stride TMA cannot store to (780 bytes)
    gemm.matmul(a, b, config=config, out=wide)
    calls = list(gemm.api._CALLS.values())
    assert len(calls) == 2 and [c.tma_store for c in calls] == [True, False]
    with pytest.raises(ValueError, match="out: expected"):
        gemm.matmul(a, b, out=torch.empty(256, 383).to(torch.bfloat16))


def test_stream_k_plan():
    """The GEMM's stream-K split is the scheduler's under STREAM_K_REGION (nvfly.ops.common.scheduler's tests check
    the splits and that their units cover every k-block once)."""
    assert gemm.plan.stream_k_plan(272, 112, 132) == scheduler.stream_k_split(272, 112, 132, scheduler.StreamK())
    assert (gemm.plan.stream_k_plan(448, 32, 132, "tail").dp_tiles, gemm.plan.stream_k_plan(448, 32, 132).dp_tiles) \
        == (396, 0)
    with pytest.raises(ValueError, match="stream-K region"):
        gemm.plan.stream_k_plan(133, 3, 132, "all")


def test_stream_k_plans_and_launches(fake_launches):
    a, b = _bf(2048, 7168), _bf(2112, 7168).t()  # 16 x 9 = 144 tiles of 128x128 on 132 SMs: a short last wave
    # the plan's invariants, not the tuned split: a whole first wave of data-parallel tiles, the rest dealt out
    plan = gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", None, False)
    tiles = -(-plan.m // plan.config.bm) * -(-plan.n // plan.config.bn)
    assert plan.block_iters > 0 and plan.dp_tiles + plan.sk_tiles == tiles and plan.dp_tiles % plan.grid == 0
    assert plan.config.check(2) is None and plan.grid <= 132
    assert gemm.path(a, b) == f"wgmma-streamK{plan.sk_tiles}x{plan.block_iters}"
    assert gemm.path(a, b, config=GemmConfig(128, 128, 6, 2, pingpong=True, stream_k=False)) == "wgmma"
    gemm.matmul(a, b)
    (name, grid, params), = fake_launches
    assert name == "gemm_kernel" and grid == (plan.grid, 1, 1)
    assert (plan.dp_tiles, plan.block_iters) in {params[i:i + 2] for i in range(len(params) - 1)}


@pytest.mark.parametrize("name,make", [
    ("split-K", lambda: (_bf(256, 2816), _bf(1024, 2816).t())),  # an MLP's down projection: wgmma-splitK2
    ("stream-K tail", lambda: (_bf(2048, 7168), _bf(2112, 7168).t())),
], ids=lambda v: v if isinstance(v, str) else "")
def test_op_calls_in_a_private_pool_keep_no_tensor(fake_launches, monkeypatch, name, make):
    """An op call whose allocations land in a private memory pool (cudagraph trees' warm-up run of an Inductor
    graph whose nvfly_mm_out choice won autotuning) leaves no tensor it allocated alive but its output: cudagraph
    trees then require every live block of the pool to be an output ("tensor(s) in the cudagraph pool not tracked
    as outputs"). The first call of a signature and a bound one, with the scratch cache of the stream empty."""
    import gc

    import nvfly.torch  # noqa: F401  (defines torch.ops.nvfly)
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from nvfly.ops.common import scratch
    from nvfly.torch import gemm_ops
    monkeypatch.setattr(gemm_ops, "_BOUND", OpCalls())
    for cache in (scratch._WORKSPACE, scratch._PARTIALS):
        monkeypatch.setattr(cache, "_entries", {})
    monkeypatch.setattr(scratch, "in_private_pool", lambda tensors: True)

    class Allocations(TorchDispatchMode):
        """Weak references to the storage of every tensor an op makes during the call."""
        def __init__(self):
            super().__init__()
            self.storages: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(t, torch.Tensor):
                    self.storages.append(StorageWeakRef(t.untyped_storage()))
            return result
    a, b = make()
    assert gemm.path(a, b).startswith("wgmma-s")
    for _ in range(2):  # a signature's first call (planned, bound), then the bound launches
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)
        mine = {StorageWeakRef(t.untyped_storage()).cdata for t in (a, b, out)}
        with Allocations() as made:  # the op's body: a mode would see torch.ops.nvfly.mm_out as one op
            gemm_ops._gemm("mm_out", a, b, out=out)
        gc.collect()
        alive = [ref for ref in made.storages if not ref.expired() and ref.cdata not in mine]
        assert made.storages and not alive, f"{len(alive)} tensor(s) allocated by the call outlive it"
    assert all(type(v) is not Declined for v in gemm_ops._BOUND.values())
    assert any(params for kernel, _, params in fake_launches if kernel == "gemm_kernel")

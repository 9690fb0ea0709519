"""Prefill's persistent LPT schedule (``PrefillPlan.persistent`` through ``plan_options``) against the float32
reference on fresh random inputs with NaN-poisoned outputs: causal and not, D 64, 128, 256 and 192/128, more
units than SMs (CTAs walk several units, the rings and ping-pong turns carried across them) and fewer, GQA, Sq !=
Skv both ways (rows that see no key), pair groups smaller than the launch (long Skv: K and V beyond L2's budget),
a window, mods and block masks; and the same bits as the CTA-per-tile kernel. Run under ``timeout``: a broken
barrier hand-off hangs."""
import pytest
import torch

from nvfly.ops import attention
from nvfly.ops.attention import prefill_api
from nvfly.ops.attention.prefill_api import plan_options
from nvfly.ops.attention.prefill_plan import pair_group
from nvfly.runtime.driver import plan_sm_count
from tests.gpu.test_attention_prefill_gpu import DTYPES, VARIANT_CASES, check, make_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture
def launches(monkeypatch):
    """The (plan, grid) of every prefill launch (``_launch``'s 14th argument is the grid)."""
    seen = []
    launch = prefill_api._launch

    def spy(plan, *args):
        seen.append((plan, args[12]))
        return launch(plan, *args)
    monkeypatch.setattr(prefill_api, "_launch", spy)
    return seen


@pytest.mark.parametrize("batch, sq, skv, hq, hkv, d, causal, dtype", [
    (2, 300, 300, 4, 4, 128, True, "bf16"),       # 24 units: fewer than the SMs
    (2, 300, 300, 4, 4, 128, False, "bf16"),
    (1, 300, 300, 4, 4, 64, True, "fp16"),
    (2, 2048, 2048, 8, 8, 128, True, "bf16"),     # 256 units: CTAs walk two
    (2, 2048, 2048, 8, 8, 128, False, "bf16"),
    (2, 2048, 2048, 8, 8, 64, True, "bf16"),
    (2, 2048, 2048, 8, 8, 64, False, "fp16"),
    (3, 1000, 1000, 12, 4, 64, True, "bf16"),     # GQA, 288 units
    (2, 1000, 1500, 16, 2, 128, False, "bf16"),   # GQA 8, Skv > Sq, 256 units
    (2, 777, 1500, 8, 2, 128, True, "bf16"),      # causal bottom-right, Skv > Sq
    (2, 1500, 700, 8, 4, 64, True, "bf16"),       # causal, early rows see no key
    (2, 2048, 2048, 8, 4, 256, True, "bf16"),     # 80-key blocks, the overlap
    (1, 1500, 1500, 16, 16, (192, 128), True, "bf16"),  # DeepSeek-like, 192 units
    (2, 1000, 1000, 4, 2, (192, 128), False, "fp16"),
])
def test_shapes_against_the_reference(launches, batch, sq, skv, hq, hkv, d, causal, dtype):
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    q, k, v = make_inputs(batch, sq, skv, hq, hkv, dqk, DTYPES[dtype], seed=sq * 1000 + skv + hq, dv=dv)
    with plan_options(persistent=True):
        check(q, k, v, causal=causal)
    (plan, grid), = launches
    units = -(-sq // plan.block_m) * hq * batch
    assert plan.persistent and grid == (min(units, plan_sm_count(q.get_device())), 1, 1)


@pytest.mark.parametrize("batch, sq, skv, hq, hkv, causal", [
    (2, 1024, 30000, 4, 4, True),    # groups of one (batch, head) pair: 8 groups, 64 units
    (3, 2048, 26000, 4, 4, False),   # 12 groups, 192 units
    (2, 1024, 20000, 8, 2, True),    # GQA 4: groups of two KV heads' eight query heads
])
def test_pair_groups_smaller_than_the_launch(launches, batch, sq, skv, hq, hkv, causal):
    """Long Skv at D 128: a group holds fewer (batch, head) pairs than the launch (units walk group after
    group)."""
    q, k, v = make_inputs(batch, sq, skv, hq, hkv, 128, torch.bfloat16, seed=skv)
    plan = attention.prefill_plan(128, 128, causal, persistent=True)
    assert pair_group(skv, hq // hkv, plan.kv_rows_in_l2(2)) < batch * hq
    with plan_options(persistent=True):
        check(q, k, v, causal=causal)
    assert launches[0][0].persistent


@pytest.mark.parametrize("d, causal", [(128, True), (64, False), (256, True)])
def test_the_same_bits_as_the_cta_per_tile_kernel(d, causal):
    """Each unit runs the CTA-per-tile kernel's code: out and LSE bit for bit, over several calls."""
    q, k, v = make_inputs(2, 2048, 2048, 8, 4, d, torch.bfloat16, seed=d)
    want, want_lse = attention.prefill(q, k, v, causal=causal, return_lse=True)
    with plan_options(persistent=True):
        for _ in range(3):
            got, lse = attention.prefill(q, k, v, causal=causal, return_lse=True)
            assert torch.equal(got, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("case", ["d128-causal", "d128-sq-gt-skv-fp16-bhsd", "d64-causal-top-left-mqa", "d64-window",
                                  "d128-soft-cap", "d64-document-mask", "d256-causal", "d192-alibi",
                                  "d64-block-mask", "d128-block-mask-256", "d128-block-mask-causal"])
def test_variants(launches, case):
    """The prefill tests' plan-variant cases (windows, mods, block masks, top-left causal, MQA) persistent."""
    with plan_options(persistent=True):
        VARIANT_CASES[case]()
    assert launches and all(plan.persistent for plan, _ in launches)


@pytest.mark.parametrize("overlap, pingpong", [(False, False), (True, True), (True, False)])
def test_serial_and_overlap_consumers(launches, overlap, pingpong):
    """Persistent with the serial consumers (no turns), and the overlap with and without ping-pong, D 128 causal
    with more units than SMs."""
    q, k, v = make_inputs(2, 2048, 2048, 8, 2, 128, torch.bfloat16, seed=5)
    with plan_options(persistent=True, overlap=overlap, pingpong=pingpong):
        check(q, k, v, causal=True)
    plan = launches[0][0]
    assert plan.persistent and (plan.overlap, plan.pingpong) == (overlap, pingpong)


@pytest.mark.parametrize("batch, sq, skv, hq, hkv, d, causal", [
    (2, 300, 300, 4, 4, 128, True),         # 24 units: fewer than the SMs, one a CTA
    (2, 2048, 2048, 8, 8, 128, True),       # 256 units: CTAs walk two or more, lists of unequal length
    (2, 2048, 2048, 8, 8, 64, False),
    (3, 1000, 1000, 12, 4, 64, True),       # GQA, 288 units
    (2, 777, 1500, 8, 2, 128, True),        # causal bottom-right, Skv > Sq
    (2, 1500, 700, 8, 4, 64, True),         # causal, early rows see no key (zero-cost units)
    (2, 2048, 2048, 8, 4, 256, True),       # 80-key blocks, the overlap
    (1, 1500, 1500, 16, 16, (192, 128), True),
    (2, 1024, 30000, 4, 4, 128, True),      # pair groups of one pair
])
def test_unit_table_against_the_reference(launches, batch, sq, skv, hq, hkv, d, causal):
    """``unit_table``: the CTAs walk host-built LPT lists; every unit once, against the reference."""
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    q, k, v = make_inputs(batch, sq, skv, hq, hkv, dqk, torch.bfloat16, seed=sq + skv + hq, dv=dv)
    with plan_options(persistent=True, unit_table=True):
        check(q, k, v, causal=causal)
    (plan, grid), = launches
    units = -(-sq // plan.block_m) * hq * batch
    assert plan.unit_table and grid == (min(units, plan_sm_count(q.get_device())), 1, 1)


@pytest.mark.parametrize("d, causal", [(128, True), (64, False), (256, True)])
def test_unit_table_the_same_bits_as_the_cta_per_tile_kernel(d, causal):
    """A unit's code is the CTA-per-tile kernel's whichever CTA runs it: out and LSE bit for bit, over several
    calls (the second and third reuse the cached table)."""
    q, k, v = make_inputs(2, 2048, 2048, 8, 4, d, torch.bfloat16, seed=d)
    want, want_lse = attention.prefill(q, k, v, causal=causal, return_lse=True)
    with plan_options(persistent=True, unit_table=True):
        for _ in range(3):
            got, lse = attention.prefill(q, k, v, causal=causal, return_lse=True)
            assert torch.equal(got, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("case", ["d64-window", "d128-soft-cap", "d64-document-mask", "d128-block-mask-causal"])
def test_unit_table_variants(launches, case):
    """Windows (the table's costs window-aware), mods and block masks (costs by position only) with the table."""
    with plan_options(persistent=True, unit_table=True):
        VARIANT_CASES[case]()
    assert launches and all(plan.unit_table for plan, _ in launches)

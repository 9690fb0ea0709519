"""Prefill's persistent LPT schedule (``PrefillPlan.persistent``) without a GPU: its plans compile for sm_90a
without spills or ptxas warnings to the same GEMMs as the CTA-per-tile kernel, with the persistent register
budgets; the plan refuses what it does not support; the host launches one CTA an SM; a model of the two
consumers' named-barrier turns, carried from unit to unit, hands the turn back and forth without a deadlock; and a
model of the K, V and Q rings over a CTA's units (random interleavings) neither deadlocks nor overwrites a stage
a consumer still reads."""
import dataclasses
import re

import pytest

from nvfly.ops import attention
from nvfly.ops.attention.prefill_plan import (CONSUMER_REGS, PERSISTENT_PRODUCER_REGS, TABLE_PRODUCER_REGS,
                                              PrefillPlan, key_blocks, pair_group, prefill_unit_table)
from nvfly.ops.common.scheduler import head_grouped_lpt_unit, lpt_work_lists, unpack_unit
from tests.test_attention_prefill_cpu import _cpu_prefill, _inputs, gmma_count

HEAD_DIM_PAIRS = [(64, 64), (128, 128), (256, 256), (192, 128)]


@pytest.mark.parametrize("dqk, dv", HEAD_DIM_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_plans_compile_without_spills(dqk, dv, causal):
    """The default plan's options with ``persistent``: the same HGMMA per trace as the CTA-per-tile kernel, no
    spills and no warnings, the producer at PERSISTENT_PRODUCER_REGS and the consumers at the rest."""
    plan = attention.prefill_plan(dqk, dv, causal, persistent=True)
    assert plan == dataclasses.replace(attention.prefill_plan(dqk, dv, causal), persistent=True)
    kernel = attention.compile_prefill(plan)
    traces = 2 + plan.overlap
    s_steps, pv_steps = dqk // 16, plan.block_n // 16
    assert gmma_count(kernel, f"64x{plan.block_n}x16", a_from_registers=False) == traces * s_steps
    assert gmma_count(kernel, f"64x{dv}x16", a_from_registers=True) == traces * pv_steps
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert "LDL" not in kernel.sass() and "STL" not in kernel.sass()
    assert not kernel.warnings
    assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {PERSISTENT_PRODUCER_REGS:#x} ;", kernel.sass())
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {plan.consumer_regs:#x} ;", kernel.sass())
    assert plan.producer_regs * 128 + plan.consumer_regs * 128 * plan.consumers <= 24 * 128 + CONSUMER_REGS * 256


@pytest.mark.parametrize("options, mods", [
    (dict(window=True), None), (dict(mods=True), "softcap"), (dict(kv_block=128, q_block=128), "window"),
    (dict(overlap=True), None), (dict(pingpong=False), None)])
def test_persistent_masks_mods_and_variants_compile_without_spills(options, mods):
    """A window, a score_mod, a BlockMask with its mask_mod, the overlap at D 128 and the serial consumers."""
    from nvfly.ops.attention import mods as M
    plan = attention.prefill_plan(128, 128, True, persistent=True, **options)
    given = {None: M.Mods(), "softcap": M.Mods(M.soft_cap(30.0)), "window": M.Mods(None, M.sliding_window(300))}
    kernel = attention.compile_prefill(plan, mods=given[mods])
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert not kernel.warnings


def test_persistent_plan_options_and_errors():
    """Off by default; no packed sequences nor fp8; the grid is min(units, SMs) and needs the SM count; a group
    holds as many KV heads as fit L2_KV_BYTES, times the GQA group."""
    assert not attention.prefill_plan(128, 128, True).persistent
    with pytest.raises(ValueError, match="no packed sequences"):
        attention.prefill_plan(128, 128, True, varlen=True, persistent=True)
    with pytest.raises(ValueError, match="no fp8"):
        attention.prefill_plan(128, 128, True, fp8=True, persistent=True)
    plan = PrefillPlan(128, 128, True, persistent=True)
    assert plan.grid(2, 8, 1000, 132) == (min(8 * 8 * 2, 132), 1, 1)
    assert plan.grid(1, 2, 300, 132) == (3 * 2, 1, 1)
    assert PrefillPlan(128, 128, True).grid(2, 8, 1000) == (8, 8, 2)
    with pytest.raises(ValueError, match="SM count"):
        plan.grid(2, 8, 1000)
    rows = plan.kv_rows_in_l2(2)
    assert rows * (128 + 128) * 2 <= 25 << 20 < (rows + 1) * (128 + 128) * 2
    assert pair_group(rows // 3, 4, rows) == 12 and pair_group(rows * 5, 1, rows) == 1 and pair_group(0, 2, rows) > 0


def test_host_path_launches_one_cta_an_sm(recorded_launches, monkeypatch):
    """``plan_options(persistent=True)`` reaches prefill's plan: a (min(units, 132), 1, 1) grid on a CPU tensor
    (``plan_sm_count``: an H200's 132 SMs), the default's other options; packed sequences ignore it."""
    import torch

    from nvfly.ops.attention import prefill_api
    _cpu_prefill(monkeypatch)
    q, k, v = _inputs(b=2, sq=300, skv=77, hq=6, hkv=2, d=128)
    with prefill_api.plan_options(persistent=True):
        attention.prefill(q, k, v, causal=True)
        q2, k2, v2 = _inputs(b=3, sq=1000, skv=1000, hq=8, hkv=8, d=64)
        attention.prefill(q2, k2, v2)
    assert [(name, grid) for name, grid, _ in recorded_launches] == [
        ("attention_prefill_kernel", (3 * 6 * 2, 1, 1)), ("attention_prefill_kernel", (132, 1, 1))]
    plans = []
    monkeypatch.setattr(prefill_api, "_launch", lambda plan, *args: plans.append(plan))
    with prefill_api.plan_options(persistent=True):
        attention.prefill(q, k, v, causal=True)
        cu = torch.tensor([0, 300], dtype=torch.int32)
        attention.prefill_varlen(q[0], k[0, :77], v[0, :77], cu, torch.tensor([0, 77], dtype=torch.int32))
    assert plans[0] == dataclasses.replace(attention.prefill_plan(128, 128, True), persistent=True)
    assert plans[1].varlen and not plans[1].persistent


# ---------------------------------------------------------------------------------------------- unit table
@pytest.mark.parametrize("dqk, dv", [(64, 64), (128, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_unit_table_plans_compile_without_spills(dqk, dv, causal):
    """``unit_table``: the same HGMMA as the persistent kernel, no spills and no warnings, the producer at
    TABLE_PRODUCER_REGS (24 spills) and the consumers at the rest."""
    plan = attention.prefill_plan(dqk, dv, causal, persistent=True, unit_table=True)
    assert plan == dataclasses.replace(attention.prefill_plan(dqk, dv, causal), persistent=True, unit_table=True)
    kernel = attention.compile_prefill(plan)
    traces = 2 + plan.overlap
    assert gmma_count(kernel, f"64x{plan.block_n}x16", a_from_registers=False) == traces * (dqk // 16)
    assert gmma_count(kernel, f"64x{dv}x16", a_from_registers=True) == traces * (plan.block_n // 16)
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert "LDL" not in kernel.sass() and "STL" not in kernel.sass()
    assert not kernel.warnings
    assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {TABLE_PRODUCER_REGS:#x} ;", kernel.sass())
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {plan.consumer_regs:#x} ;", kernel.sass())
    assert plan.producer_regs * 128 + plan.consumer_regs * 256 <= 24 * 128 + CONSUMER_REGS * 256


def test_unit_table_plan_options():
    """Off by default, only with ``persistent``."""
    assert not attention.prefill_plan(128, 128, True, persistent=True).unit_table
    with pytest.raises(ValueError, match="unit_table"):
        attention.prefill_plan(128, 128, True, unit_table=True)


@pytest.mark.parametrize("batch, heads, sq, skv, group, causal, window, ctas", [
    (2, 8, 2048, 2048, 1, True, False, 132), (2, 8, 2048, 2048, 1, False, False, 128),
    (3, 12, 1000, 1000, 3, True, False, 132), (2, 8, 777, 1500, 4, True, False, 132),
    (2, 8, 1500, 700, 2, True, False, 132), (1, 4, 300, 300, 1, True, False, 12),
    (2, 4, 1024, 30000, 1, True, False, 64), (2, 8, 4096, 4096, 2, True, True, 132),
    (1, 32, 16384, 16384, 4, True, False, 132)])
def test_unit_table_lists_every_unit_once_balanced(batch, heads, sq, skv, group, causal, window, ctas):
    """The CSR table: ctas + 1 offsets, every (tile, head, batch) unit exactly once, each CTA's list by
    non-increasing cost, and the greedy LPT bound: no CTA's load above sum / ctas + the largest unit."""
    plan = PrefillPlan(128, 128, causal, window=window, persistent=True, unit_table=True)
    offset, left, right = skv - sq, 500 if window else 0, 0
    table = prefill_unit_table(plan, batch, heads, sq, skv, group, offset, left, right, ctas)
    tiles = -(-sq // plan.block_m)
    assert table[0] == ctas + 1 and table[ctas] == len(table) == ctas + 1 + tiles * heads * batch
    assert all(a <= b for a, b in zip(table[:ctas], table[1:ctas + 1]))
    units = [unpack_unit(code) for code in table[ctas + 1:]]
    assert sorted(units) == sorted((m, h, b) for m in range(tiles) for h in range(heads) for b in range(batch))

    def cost(m):
        start, _, _, total = key_blocks(m, skv, causal, window, offset, left, right, plan.block_m, plan.block_n)
        return max(total - start, 0)
    loads = []
    for cta in range(ctas):
        costs = [cost(unpack_unit(code)[0]) for code in table[table[cta]:table[cta + 1]]]
        assert costs == sorted(costs, reverse=True)
        loads.append(sum(costs))
    every = [cost(m) for m, _, _ in units]
    assert max(loads) <= sum(every) / ctas + max(every)


def test_lpt_work_lists_keep_ties_in_order():
    """Equal costs go out in index order, each to the least-loaded (then lowest) worker."""
    assert lpt_work_lists([1, 3, 3, 2, 1], 2) == [[1, 3], [2, 0, 4]]
    assert lpt_work_lists([5], 3) == [[0], [], []]


def test_unit_table_refuses_sizes_a_code_cannot_hold():
    plan = PrefillPlan(128, 128, True, persistent=True, unit_table=True)
    with pytest.raises(ValueError, match="query tiles"):
        prefill_unit_table(plan, 1, 1, 4097 * 128, 4097 * 128, 1, 0, 0, 0, 132)
    with pytest.raises(ValueError, match="heads"):
        prefill_unit_table(plan, 1, 257, 128, 128, 1, 0, 0, 0, 132)
    with pytest.raises(ValueError, match="batch"):
        prefill_unit_table(plan, 2049, 1, 128, 128, 1, 0, 0, 0, 132)


def test_host_path_passes_a_cached_unit_table(monkeypatch):
    """``plan_options(persistent=True, unit_table=True)``: the launch gets the table of its grid, built once a
    call signature."""
    import torch

    from nvfly.ops.attention import prefill_api
    _cpu_prefill(monkeypatch)
    prefill_api._unit_table.cache_clear()
    calls = []
    monkeypatch.setattr(prefill_api, "_launch", lambda plan, *args: calls.append((plan, args)))
    q, k, v = _inputs(b=2, sq=300, skv=300, hq=4, hkv=2, d=128)
    with prefill_api.plan_options(persistent=True, unit_table=True):
        attention.prefill(q, k, v, causal=True)
        attention.prefill(q, k, v, causal=True)
    (plan, args), (_, again) = calls
    assert plan.unit_table and args[-1] is again[-1] and args[-1].dtype == torch.int32
    table = args[-1].tolist()
    assert table == prefill_unit_table(plan, 2, 4, 300, 300, 2, 0, 0, 0, args[12][0])
    assert prefill_api._unit_table.cache_info().hits == 1


# ---------------------------------------------------------------------------------------------- ping-pong model
def consumer_program(consumer, blocks, overlap):
    """A consumer's named-barrier operations and GEMM issues over its units (``blocks``: each unit's key blocks,
    the same for both consumers), as the persistent kernel runs them: ("arrive", barrier), ("sync", barrier),
    ("gemm", unit); consumer 0 arrives on its own barrier once before the first unit."""
    own, other = 1 + consumer, 2 - consumer
    program = [("arrive", own)] if consumer == 0 else []
    for unit, n in enumerate(blocks):
        if overlap:  # first block's S alone, then per block S and the pending P·V under the turn, last P·V alone
            program.append(("free", unit))
            for _ in range(1, n):
                program += [("sync", own), ("gemm", unit), ("arrive", other)]
            program.append(("free", unit))
        else:  # the turn covers the first S, then each P·V with the next S; handed over after the last P·V
            program += [("sync", own), ("gemm", unit)]
            for _ in range(n):
                program += [("arrive", other), ("free", unit), ("sync", own), ("gemm", unit)]
            program.append(("arrive", other))
    return program


def run_turns(programs):
    """Runs the two consumers' programs on a model of named barriers of 256 threads (arrive: 128 arrivals;
    sync: 128 arrivals, then wait for the barrier's phase to complete), one operation at a time, either consumer
    first; returns the order in which (consumer, unit) issued GEMMs. Fails on a deadlock or when both consumers
    hold the turn (are between a passed sync and their next arrive) at once."""
    counts = {1: 0, 2: 0}
    phases = {1: 0, 2: 0}
    waiting = [None, None]  # the (barrier, phase) a consumer's sync waits for
    position = [0, 0]
    holding = [False, False]
    issued = []
    while position[0] < len(programs[0]) or position[1] < len(programs[1]):
        progressed = False
        for c in (0, 1):
            if waiting[c] is not None:
                barrier, phase = waiting[c]
                if phases[barrier] == phase:
                    continue
                waiting[c] = None
                holding[c] = True
                assert not holding[1 - c], "both consumers hold the turn"
                position[c] += 1
                progressed = True
                continue
            if position[c] == len(programs[c]):
                continue
            op, arg = programs[c][position[c]]
            progressed = True
            if op in ("arrive", "sync"):
                counts[arg] += 128
                if counts[arg] == 256:
                    counts[arg], phases[arg] = 0, phases[arg] + 1
                if op == "sync":
                    waiting[c] = (arg, phases[arg] if counts[arg] else phases[arg] - 1)
                    continue
                holding[c] = False
            elif op == "gemm":
                assert holding[c], "a GEMM issued without the turn"
                issued.append((c, arg))
            position[c] += 1
        assert progressed, f"deadlock at {position}"
    return issued


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("blocks", [[3], [1, 4, 2], [0, 2, 0, 0, 5], [2, 1, 1, 1, 1, 3], [5, 5, 1, 0, 7]])
def test_pingpong_turns_carry_from_unit_to_unit(blocks, overlap):
    """One arrive of consumer 0 before the walk and the same waits and arrives every unit: the consumers take
    turns through every unit (units without key blocks included), alternating, consumer 0 first, no deadlock.
    (With the overlap a unit of n key blocks has n - 1 turns; a unit of none, none.)"""
    issued = run_turns([consumer_program(0, blocks, overlap), consumer_program(1, blocks, overlap)])
    turns = [max(n - 1, 0) if overlap else n + 1 for n in blocks]
    assert [c for c, _ in issued] == [0, 1] * sum(turns)
    for c in (0, 1):
        assert [u for d, u in issued if d == c] == [u for u, t in enumerate(turns) for _ in range(t)]


def test_units_keep_exactly_the_tiles_key_blocks():
    """The walk's units, causal: the key blocks ``key_blocks`` gives each (the same as the CTA-per-tile kernel's
    tile) are non-increasing in count within a group (longest processing time first)."""
    plan = PrefillPlan(128, 128, True, persistent=True)
    sq = skv = 1000
    tiles_m, heads, batches = -(-sq // plan.block_m), 3, 2
    pairs = heads * batches
    counts = []
    for unit in range(tiles_m * pairs):
        m_tile, head, batch = head_grouped_lpt_unit(unit, tiles_m, heads, pairs, pairs)
        start, _, _, total = key_blocks(m_tile, skv, True, False, 0, 0, 0, plan.block_m, plan.block_n)
        counts.append(total - start)
    assert counts == sorted(counts, reverse=True) and counts[0] == -(-skv // plan.block_n)


# ---------------------------------------------------------------------------------------------- ring model
class Mbarrier:
    """An mbarrier: ``expected`` arrivals complete a phase; a wait on parity P passes once the phase of that
    parity is complete (at once for the parity before the first phase)."""

    def __init__(self, expected):
        self.expected, self.arrivals, self.completed = expected, 0, 0

    def arrive(self):
        self.arrivals += 1
        if self.arrivals == self.expected:
            self.arrivals, self.completed = 0, self.completed + 1

    def passes(self, parity):
        return self.completed % 2 != parity


class Ring:
    """``sm90.TmaPipeline`` of ``stages`` stages released by ``consumers`` arrivals, and what each stage holds."""

    def __init__(self, stages, consumers):
        self.full = [Mbarrier(1) for _ in range(stages)]
        self.empty = [Mbarrier(consumers) for _ in range(stages)]
        self.holds = [None] * stages
        self.stages = stages


class Walker:
    """One role's position in each ring (stage, phase), carried across units, and its steps: ("load", ring,
    content) (the producer: waits for the stage's release, then the TMA lands and completes the full barrier),
    ("wait", ring) (a consumer: waits for the stage to land), ("read", ring, content) (checks what the stage holds),
    ("release", ring) (the consumer's arrive on the stage's empty barrier; the position moves on)."""

    def __init__(self, rings, steps):
        self.rings, self.steps, self.at = rings, steps, 0
        self.positions = {name: (0, 0) for name in rings}

    def done(self):
        return self.at == len(self.steps)

    def can_step(self):
        kind, name, *_ = self.steps[self.at]
        ring = self.rings[name]
        stage, phase = self.positions[name]
        if kind == "load":
            return ring.empty[stage].passes(phase ^ 1)
        if kind == "wait":
            return ring.full[stage].passes(phase)
        return True

    def step(self):
        kind, name, *content = self.steps[self.at]
        ring = self.rings[name]
        stage, phase = self.positions[name]
        if kind == "read":
            assert ring.holds[stage] == content[0], (name, ring.holds[stage], content[0])
        if kind == "load":
            ring.holds[stage] = content[0]
            ring.full[stage].arrive()
        if kind in ("load", "release"):
            if kind == "release":
                ring.empty[stage].arrive()
            stage += 1
            self.positions[name] = (0, phase ^ 1) if stage == ring.stages else (stage, phase)
        self.at += 1


def producer_steps(blocks):
    """The persistent producer's thread: per unit, Q once its buffer is released, then K and V of each block."""
    steps = []
    for unit, n in enumerate(blocks):
        steps.append(("load", "q", unit))
        for block in range(n):
            steps += [("load", "k", (unit, block)), ("load", "v", (unit, block))]
    return steps


def consumer_steps(blocks, overlap):
    """A consumer warpgroup: per unit, Q's wait; each key block's K (its S reads Q and K) and V (P·V), in
    ``attend_block``'s order or the overlap's (K of block j with V of block j - 1, the last V alone); Q released
    after the unit's last S."""
    steps = []
    for unit, n in enumerate(blocks):
        steps.append(("wait", "q"))
        for block in range(n):
            if overlap:
                steps.append(("wait", "k"))
                if block:
                    steps += [("wait", "v"), ("read", "v", (unit, block - 1))]
                steps += [("read", "q", unit), ("read", "k", (unit, block)), ("release", "k")]
                if block:
                    steps.append(("release", "v"))
            else:
                steps += [("wait", "k"), ("read", "q", unit), ("read", "k", (unit, block)), ("release", "k"),
                          ("wait", "v"), ("read", "v", (unit, block)), ("release", "v")]
        if overlap and n:
            steps += [("wait", "v"), ("read", "v", (unit, n - 1)), ("release", "v")]
        steps.append(("release", "q"))
    return steps


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("blocks", [[3], [1, 4, 2], [0, 2, 0, 0, 5], [2, 1, 1, 1, 1, 3], [5, 5, 1, 0, 7]])
def test_rings_carry_from_unit_to_unit(blocks, overlap):
    """The producer and two consumers over a CTA's units in random interleavings (2-stage K and V rings, Q's
    one-stage ring, positions carried across units): no deadlock, and every read finds the block (Q: the unit)
    it is for, so nothing is overwritten while a consumer still needs it."""
    import random
    for seed in range(50):
        rng = random.Random(seed)
        rings = {"k": Ring(2, 2), "v": Ring(2, 2), "q": Ring(1, 2)}
        walkers = [Walker(rings, producer_steps(blocks))] + [Walker(rings, consumer_steps(blocks, overlap))
                                                             for _ in range(2)]
        while not all(w.done() for w in walkers):
            ready = [w for w in walkers if not w.done() and w.can_step()]
            assert ready, f"deadlock at {[w.at for w in walkers]} (seed {seed})"
            rng.choice(ready).step()

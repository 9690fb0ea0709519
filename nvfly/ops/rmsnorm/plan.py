"""RMSNorm's plans and the heuristics that choose them: pure Python, no device code.

``forward_plan`` picks the forward's kernel (the row kernel, the persistent one, the two-pass one) and its launch
shape, ``bulk_plan`` the opt-in bulk-copy kernel's, ``row_plan`` the row-in-registers shape that the forward and
the backward share. The measurements behind the thresholds are in docs/ops/rmsnorm.md.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

TARGET_VECTORS_PER_THREAD = 8   # enough bytes in flight per thread to cover memory latency
MAX_VECTORS_PER_THREAD = 8      # more 16-byte vectors of a row per thread spill (x and residual both in flight)
NARROW_MAX_ELEMENTS = 32        # the same limit for rows read in narrower accesses (odd lengths), in elements
MAX_GROUP = 512                 # threads per row: blocks of 512 keep a 128-register budget (1024 would allow 64)
BACKWARD_VECTORS_PER_THREAD = 2  # backward also keeps the weight-gradient sums in registers
BACKWARD_MAX_ELEMENTS = 16      # of a row per thread in the backward kernel (1024 threads): more would spill
SM_SUB_PARTITIONS = 4           # warp schedulers per SM, each with a quarter of the register file
# Threads of a forward block that packs short rows: one warp per sub-partition. Registers are allocated per
# sub-partition, so a register-limited SM holds 4 x (warps that fit in 16K registers) warps (resident_warps):
# blocks of 4 warps fill that count whatever the registers per thread, blocks of 8 leave 4 warps' registers
# idle when the count per sub-partition is odd (bf16 rows of 2048, 88 registers: 20 warps fit, 8-warp blocks
# use 16), and smaller blocks hold no more warps.
ROW_BLOCK_THREADS = 32 * SM_SUB_PARTITIONS
BACKWARD_ROW_BLOCK_THREADS = 256  # the persistent backward launches about two blocks per SM: 16 warps
# The two-pass kernel (rows too long for registers; any row on request): TWO_PASS_VECTORS 16-byte vectors a thread
# per step, blocks of 128 to 1024 threads (two_pass_plan), registers as two_pass_registers estimates them
TWO_PASS_VECTORS = 2
TWO_PASS_MIN_THREADS = 128
TWO_PASS_MAX_THREADS = 1024
TWO_PASS_OTHER_REGISTERS = 16   # besides the loaded vectors and the sum: row addresses, the column, rstd
COLUMN_SUM_COLS = 32            # columns per block of the weight-gradient partial sum
SM_REGISTERS = 65536            # sm_90 limits for resident_warps
SM_MAX_WARPS = 64
FULL_SM_REGISTERS = SM_REGISTERS // (SM_MAX_WARPS * 32)  # 32 registers a thread: 64 warps an SM
SM_MAX_BLOCKS = 32
REGISTER_ALLOCATION_UNIT = 256  # registers are given to a warp in multiples of this
# The persistent forward (forward_plan): it holds two row tiles (the one it normalises, the next one in flight) and
# the weight, so half the row kernel's vectors per thread; its register budget (without, with the residual: x and
# the residual of the next tile in flight) sets its blocks per SM: 5 or 4 blocks of 128 threads.
PERSISTENT_VECTORS_PER_THREAD = 4
PERSISTENT_REGISTERS = (96, 128)
# Rows of at most SHORT_ROW_VECTORS 16-byte vectors (8 KB) take SHORT_ROW_TARGET_VECTORS a thread: more warps, the
# same bytes in flight (docs/ops/rmsnorm.md, "Short rows").
SHORT_ROW_VECTORS = 512
SHORT_ROW_TARGET_VECTORS = 2
# Long rows (over SHORT_ROW_VECTORS, no residual), sm_count to PERSISTENT_MAX_ROWS of them, take the persistent
# kernel where its blocks get PERSISTENT_MIN_TILES tiles each or more (the next tile's loads in flight under this
# one's reduction); fewer than two an SM of rows up to 2 x SHORT_ROW_VECTORS take the row kernel at
# SHORT_ROW_TARGET_VECTORS a thread, fewer tiles the two-pass kernel (rows up to 2 x SHORT_ROW_VECTORS) or the
# row kernel (longer ones): docs/ops/rmsnorm.md, "Long rows by their count".
PERSISTENT_MAX_ROWS = 2048
PERSISTENT_MIN_TILES = 1.75
# The two-pass kernel with Inductor's cache hints (LOAD_HINTS) is the default for rows of TWO_PASS_MIN_ROW_BYTES or
# more, TWO_PASS_MIN_ROWS rows or more: it ties Inductor there (docs/ops/rmsnorm.md, "Many long rows").
TWO_PASS_MIN_ROW_BYTES = 12 * 1024
TWO_PASS_MIN_ROWS = 1024
# The bulk-copy kernel (rms_norm_bulk_kernel): rows padded to BULK_ROW_ALIGN bytes in its ring, which starts
# BULK_BARRIER_BYTES into dynamic shared memory (after the stage barriers); BULK_SMEM_PER_SM bytes of an SM's
# shared memory (228 KB, less 1 KB a block the driver reserves and the static scratch) shared by its blocks
BULK_ROW_ALIGN = 128
BULK_BARRIER_BYTES = 1024
BULK_SMEM_PER_SM = 224 * 1024
BULK_MAX_STAGES = 8
# a thread holds at most 4 vectors of the row and 4 of the weight (8 of each spill at 128 registers); a block is
# the fewest threads (BULK_MIN_THREADS to TWO_PASS_MAX_THREADS) that hold the row so
BULK_VECTORS_PER_THREAD = 4
BULK_MIN_THREADS = 128
BULK_BLOCKS_PER_SM = 2
BULK_SM_THREADS = 512         # threads an SM at most: 128 registers a thread (the row and the weight in registers)
EARLY_WEIGHT = True   # the row kernel loads the weight with the row: one round trip, not one per vector
CACHE_HINTS = False   # L1/L2 eviction hints on the forward's accesses (see hints.STREAM_L1)
LOAD_HINTS = "loads"  # the cache_hints value that hints the loads only (hints.row_hints, hints.two_pass_hints)


@dataclass(frozen=True)
class RowPlan:
    """How a row of N elements is spread over threads: ``vec`` elements per access, ``group`` threads per row
    (a power of two), ``rows`` rows per block; ``looped`` when the row does not fit in registers."""
    vec: int
    group: int
    rows: int
    looped: bool
    persistent: bool = False    # the forward's persistent kernel, ``blocks_per_sm`` blocks per SM
    blocks_per_sm: int = 0
    two_pass: bool = False      # the forward's two-pass kernel (a block of ``group`` threads a row), ``vectors``
    vectors: int = 0            # accesses of ``vec`` elements a thread per step of each pass
    early_weight: bool = False  # the forward's row kernel reads the weight with the row
    cache_hints: Any = False    # False, True or LOAD_HINTS
    bulk: bool = False          # the forward's bulk-copy kernel: a block of ``group`` threads a row, ``stages``
    stages: int = 0             # rows a block in flight, ``blocks_per_sm`` blocks an SM
    # the rows' storage dtype as torch names it ("torch.bfloat16"), set by the host (plan_of); the heuristics
    # here see it only through ``vec`` and ``max_vectors`` (None: a plan made from element counts alone)
    dtype: Optional[str] = None

    @property
    def threads(self) -> int:
        """Threads per block of the row-in-registers kernels."""
        return self.group * self.rows


@dataclass(frozen=True)
class ForwardOptions:
    """The forward's plan choices (``benchmarks/rmsnorm.py --compare-plans`` times them side by side); the defaults
    are the model's (``forward_plan``)."""
    block_threads: int = ROW_BLOCK_THREADS  # threads of a block packing short rows: a power of two, 32 to 512
    persistent: bool = False                # the persistent kernel (forward_plan says when it is the default)
    target_vectors: Optional[int] = None    # 16-byte vectors of a row per thread (None: forward_plan's, persistent 4)
    early_weight: bool = EARLY_WEIGHT
    cache_hints: Any = CACHE_HINTS          # False, True (loads and stores) or LOAD_HINTS (the loads only)
    two_pass: bool = False                  # the two-pass kernel for any row (rows too long for registers take it)
    two_pass_threads: Optional[int] = None  # its block, a row each: whole warps, 128 to 1024 (None: forward_plan's)
    two_pass_vectors: int = TWO_PASS_VECTORS  # its 16-byte vectors a thread per step of each pass, 1 to 8
    bulk: bool = False                      # the bulk-copy kernel (rows of whole 16-byte vectors)
    bulk_threads: Optional[int] = None      # its block: a power of two, 128 to 1024 (None: bulk_plan's)
    bulk_stages: Optional[int] = None       # its ring's rows a block (None: as many as fit, up to BULK_MAX_STAGES)
    bulk_blocks_per_sm: Optional[int] = None  # 1 to 4 (None: two blocks of up to 256 threads, else one)
    vector_bytes: Optional[int] = None      # narrower accesses than the layout allows: 4 or 8 (None: up to 16)

    def __post_init__(self) -> None:
        # checked here, not per call: options equal as values (128 == 128.0) share a cached plan
        threads, vectors = self.block_threads, self.target_vectors
        if type(threads) is not int or not 32 <= threads <= MAX_GROUP or threads & (threads - 1):
            raise ValueError(f"options.block_threads: expected a power of two from 32 to {MAX_GROUP}, got {threads!r}")
        if vectors is not None and (type(vectors) is not int or not 1 <= vectors <= MAX_VECTORS_PER_THREAD):
            raise ValueError(f"options.target_vectors: expected None or 1 to {MAX_VECTORS_PER_THREAD}, "
                             f"got {vectors!r}")
        if self.cache_hints not in (False, True, LOAD_HINTS) or type(self.cache_hints) not in (bool, str):
            raise ValueError(f"options.cache_hints: expected False, True or {LOAD_HINTS!r}, got {self.cache_hints!r}")
        for name in ("persistent", "early_weight", "two_pass", "bulk"):
            value = getattr(self, name)
            if type(value) is not bool:
                raise ValueError(f"options.{name}: expected a bool, got {value!r}")
        if self.persistent + self.two_pass + self.bulk > 1:
            raise ValueError("options: at most one of persistent, two_pass and bulk (each is a kernel)")
        # whole warps (block_reduce takes any count)
        _check_block_or_none("two_pass_threads", self.two_pass_threads, TWO_PASS_MIN_THREADS, any_warps=True)
        vectors = self.two_pass_vectors
        if type(vectors) is not int or not 1 <= vectors <= MAX_VECTORS_PER_THREAD:
            raise ValueError(f"options.two_pass_vectors: expected 1 to {MAX_VECTORS_PER_THREAD}, got {vectors!r}")
        _check_block_or_none("bulk_threads", self.bulk_threads, BULK_MIN_THREADS)
        stages = self.bulk_stages
        if stages is not None and (type(stages) is not int or not 2 <= stages <= BULK_MAX_STAGES):
            raise ValueError(f"options.bulk_stages: expected None or 2 to {BULK_MAX_STAGES}, got {stages!r}")
        if self.vector_bytes not in (None, 4, 8):
            raise ValueError(f"options.vector_bytes: expected None, 4 or 8, got {self.vector_bytes!r}")
        blocks = self.bulk_blocks_per_sm
        if blocks is not None and (type(blocks) is not int or not 1 <= blocks <= 4):
            raise ValueError(f"options.bulk_blocks_per_sm: expected None or 1 to 4, got {blocks!r}")


def _check_block_or_none(name: str, threads: Any, least: int, any_warps: bool = False) -> None:
    """ForwardOptions' block sizes of a row a block: None or a power of two (with ``any_warps``, a multiple of 32)
    from ``least`` to TWO_PASS_MAX_THREADS."""
    if threads is not None and (type(threads) is not int or (threads % 32 if any_warps else threads & (threads - 1))
                                or not least <= threads <= TWO_PASS_MAX_THREADS):
        kind = "a multiple of 32" if any_warps else "a power of two"
        raise ValueError(f"options.{name}: expected None or {kind} from {least} to {TWO_PASS_MAX_THREADS}, "
                         f"got {threads!r}")


def fewest_threads(least: int, per_thread: int, amount: int) -> int:
    """The fewest threads, a power of two from ``least`` to TWO_PASS_MAX_THREADS, that cover ``amount`` at
    ``per_thread`` each (TWO_PASS_MAX_THREADS where none does)."""
    threads = least
    while threads < TWO_PASS_MAX_THREADS and threads * per_thread < amount:
        threads *= 2
    return threads


@functools.lru_cache(maxsize=4096)
def row_plan(n: int, vec: int, m: int, sm_count: int, target_vectors: int = TARGET_VECTORS_PER_THREAD,
             max_vectors: int = MAX_VECTORS_PER_THREAD, max_group: int = MAX_GROUP,
             block_threads: int = ROW_BLOCK_THREADS) -> RowPlan:
    """The launch shape for ``m`` rows of ``n`` elements read ``vec`` at a time (kernels.py describes the kernels).

    Threads per row grow until each holds about ``target_vectors`` vectors; short rows share a block of
    ``block_threads`` threads (rows of more threads get a block each), but never so many that fewer than two
    blocks per SM would be launched (blocks stay whole warps).
    """
    row_vectors = -(-n // vec)
    group = 1
    while group < max_group and group * target_vectors < row_vectors:
        group *= 2
    if -(-row_vectors // group) > max_vectors:
        return RowPlan(vec, TWO_PASS_MAX_THREADS, 1, True)
    # whole warps only (rows of less than a warp are packed by 32 // group)
    per_warp = max(1, 32 // group)
    rows = max(per_warp, min(block_threads // group, m // (2 * sm_count)) // per_warp * per_warp)
    return RowPlan(vec, group, rows, False)


@functools.lru_cache(maxsize=4096)
def forward_plan(n: int, vec: int, m: int, sm_count: int, max_vectors: int = MAX_VECTORS_PER_THREAD,
                 has_residual: bool = False, options: ForwardOptions = ForwardOptions()) -> RowPlan:
    """The forward's kernel and launch shape: the row kernel (one row tile per block), the persistent one, or the
    two-pass one (``two_pass_plan``: rows too long for registers, or any row with ``options.two_pass``; and rows of
    TWO_PASS_MIN_ROW_BYTES or more when there are TWO_PASS_MIN_ROWS of them, with LOAD_HINTS).

    The row kernel (one row tile per block, the weight loaded with the row where registers allow) is the default;
    rows of at most SHORT_ROW_VECTORS vectors take SHORT_ROW_TARGET_VECTORS a thread. The persistent kernel (a grid
    of ``blocks_per_sm`` x SMs blocks looping over tiles, the next tile's loads issued before each tile's
    reduction and stores, the weight read once; PERSISTENT_VECTORS_PER_THREAD vectors of two tiles a thread) is
    taken with ``options.persistent`` (ValueError where two tiles of a row do not fit) and for long rows when there
    are sm_count to PERSISTENT_MAX_ROWS of them (fewer than two an SM of rows up to 2 x SHORT_ROW_VECTORS take the
    row kernel at SHORT_ROW_TARGET_VECTORS instead, and fewer than PERSISTENT_MIN_TILES tiles a block the two-pass
    kernel: see PERSISTENT_MAX_ROWS). On large shapes it loses to the row kernel (docs/ops/rmsnorm.md).
    """
    row_vectors = -(-n // vec)
    chosen = options.target_vectors is None and not options.persistent and not options.cache_hints
    wide = max_vectors == MAX_VECTORS_PER_THREAD  # 16-byte vectors: the row is n * 16 // vec bytes
    # long rows, sm_count to PERSISTENT_MAX_ROWS of them (that fit the persistent kernel), no kernel asked for
    by_rows = chosen and wide and not has_residual and SHORT_ROW_VECTORS < row_vectors <= \
        MAX_GROUP * PERSISTENT_VECTORS_PER_THREAD and sm_count <= m <= PERSISTENT_MAX_ROWS
    to_16_kb = row_vectors <= 2 * SHORT_ROW_VECTORS
    one_wave = by_rows and m < 2 * sm_count and to_16_kb
    target = options.target_vectors or (SHORT_ROW_TARGET_VECTORS if row_vectors <= SHORT_ROW_VECTORS or one_wave
                                        else TARGET_VECTORS_PER_THREAD)
    rows = row_plan(n, vec, m, sm_count, target, max_vectors, block_threads=options.block_threads)
    if options.two_pass:
        return two_pass_plan(n, vec, max_vectors, options)
    if options.persistent or by_rows and not one_wave:
        vectors = options.target_vectors or PERSISTENT_VECTORS_PER_THREAD
        tiled = row_plan(n, vec, m, sm_count, vectors, max_vectors, block_threads=options.block_threads)
        if tiled.looped or -(-n // (vec * tiled.group)) > vectors:
            raise ValueError(f"options: rows of {n} elements do not fit the persistent kernel "
                             f"({vectors} vectors of {vec} per thread)")
        blocks_per_sm = max(1, SM_REGISTERS // (PERSISTENT_REGISTERS[has_residual] * tiled.threads))
        if options.persistent or -(-m // tiled.rows) >= PERSISTENT_MIN_TILES * blocks_per_sm * sm_count:
            return dataclasses.replace(tiled, persistent=True, blocks_per_sm=blocks_per_sm,
                                       cache_hints=options.cache_hints)
        if to_16_kb:  # longer rows: the row kernel's 8 vectors (see PERSISTENT_MIN_TILES)
            return two_pass_plan(n, vec, max_vectors, dataclasses.replace(options, cache_hints=LOAD_HINTS))
    # long rows, many of them, no other kernel asked for: Inductor's structure and cache hints (LOAD_HINTS)
    if rows.looped or chosen and wide and n * 16 // vec >= TWO_PASS_MIN_ROW_BYTES and m >= TWO_PASS_MIN_ROWS:
        return two_pass_plan(n, vec, max_vectors, dataclasses.replace(
            options, cache_hints=options.cache_hints or LOAD_HINTS))
    # the weight read with the row is a third stream of vectors in registers with the residual's: only where
    # the row kernel's budget (two streams of max_vectors) holds it
    streams = 2 + has_residual
    early_weight = options.early_weight and -(-n // (vec * rows.group)) * streams <= 2 * max_vectors
    return dataclasses.replace(rows, early_weight=early_weight, cache_hints=options.cache_hints)


def two_pass_plan(n: int, vec: int, max_vectors: int, options: ForwardOptions) -> RowPlan:
    """The two-pass kernel's block and accesses a thread per step: ``options.two_pass_vectors`` 16-byte vectors (of
    narrower accesses, ``max_vectors / MAX_VECTORS_PER_THREAD`` times as many, as the row kernel's budget), and
    ``options.two_pass_threads`` threads, else the fewest (a power of two, TWO_PASS_MIN_THREADS to
    TWO_PASS_MAX_THREADS) that take the row in one step: longer rows loop over steps."""
    vectors = options.two_pass_vectors * max_vectors // MAX_VECTORS_PER_THREAD
    threads = options.two_pass_threads or fewest_threads(TWO_PASS_MIN_THREADS, vectors * vec, n)
    return RowPlan(vec, threads, 1, False, two_pass=True, vectors=vectors, cache_hints=options.cache_hints)


def two_pass_registers(first_streams: int, second_streams: int, vectors: int, vec: int, itemsize: int,
                       steps: int) -> int:
    """The two-pass kernel's registers a thread, estimated: what it holds at once and TWO_PASS_OTHER_REGISTERS.
    The first pass holds ``first_streams`` (x, the residual) x ``vectors`` accesses of ``vec`` elements (twice that
    when the row takes several steps: LLVM unrolls that loop by two) and the fp32 sum of squares, the second pass
    ``second_streams`` (x, the residual, the weight) x ``vectors`` accesses. Where it is FULL_SM_REGISTERS or
    fewer the kernel asks ptxas for a full SM of warps; otherwise ptxas chooses (a cap below its choice spills)."""
    words = -(-vec * itemsize // 4)
    first = first_streams * vectors * words * (2 if steps > 1 else 1) + vec
    return TWO_PASS_OTHER_REGISTERS + max(first, second_streams * vectors * words)


def bulk_row_bytes(n: int, itemsize: int) -> int:
    """A row's bytes in a stage of the bulk kernel's ring: padded to BULK_ROW_ALIGN."""
    return -(-n * itemsize // BULK_ROW_ALIGN) * BULK_ROW_ALIGN


def bulk_stage_bytes(n: int, itemsize: int, has_residual: bool) -> int:
    """One stage of the bulk kernel's ring: the row of x (and of the residual)."""
    return bulk_row_bytes(n, itemsize) * (1 + has_residual)


def bulk_plan(n: int, vec: int, itemsize: int, has_residual: bool, options: ForwardOptions) -> RowPlan:
    """The bulk-copy kernel's block, ring and blocks per SM (ValueError where it cannot take the rows: they must
    be whole 16-byte vectors, few enough a thread, and two stages must fit): ``options.bulk_threads`` threads, else
    the fewest that hold the row in BULK_VECTORS_PER_THREAD vectors a thread; as many stages as fit the shared
    memory of ``options.bulk_blocks_per_sm`` blocks, up to ``options.bulk_stages`` (or BULK_MAX_STAGES)."""
    if vec * itemsize != 16 or n % vec:
        raise ValueError(f"options.bulk: rows of {n} elements of {itemsize} bytes read {vec} at a time are not whole "
                         "16-byte vectors (the bulk copies move 16-byte units from 16-byte aligned rows)")
    row_vectors = n // vec
    threads = options.bulk_threads or fewest_threads(BULK_MIN_THREADS, BULK_VECTORS_PER_THREAD, row_vectors)
    blocks = options.bulk_blocks_per_sm or (BULK_BLOCKS_PER_SM if threads <= BULK_SM_THREADS // 2 else 1)
    if -(-row_vectors // threads) > BULK_VECTORS_PER_THREAD or threads * blocks > BULK_SM_THREADS:
        raise ValueError(f"options.bulk: rows of {n} elements on {threads} threads, {blocks} blocks an SM: over the "
                         f"kernel's {BULK_VECTORS_PER_THREAD} vectors or 128 registers a thread")
    budget = BULK_SMEM_PER_SM // blocks - BULK_BARRIER_BYTES
    stages = min(options.bulk_stages or BULK_MAX_STAGES, budget // bulk_stage_bytes(n, itemsize, has_residual))
    if stages < 2:
        raise ValueError(f"options.bulk: two stages of rows of {n} elements do not fit the shared memory of "
                         f"{blocks} blocks an SM")
    return RowPlan(vec, threads, 1, False, bulk=True, stages=stages, blocks_per_sm=blocks)


def resident_warps(registers: int, threads: int) -> int:
    """Warps an sm_90 SM holds of blocks of ``threads`` threads using ``registers`` each (shared memory aside):
    the register, warp and block limits as cuda_occupancy.h computes them, where each sub-partition holds the
    warps its quarter of the register file fits."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    by_registers = SM_REGISTERS // SM_SUB_PARTITIONS // per_warp * SM_SUB_PARTITIONS
    return min(by_registers // warps, SM_MAX_WARPS // warps, SM_MAX_BLOCKS) * warps

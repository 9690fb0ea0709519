"""The config space, epilogue options and shared-memory constants of the warp-specialised TMA + wgmma GEMM that the
dense (nvfly.ops.gemm), grouped and scaled (FP8) kernels share (their mainloop: ``mainloop``).

Pure Python (no tracing): plans, the autotuner and the kernels all read these.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional

BK_BYTES = 128   # one 128-byte swizzle row of K per k-block
PRODUCER_REGS = 40
CONSUMER_REGS = 232
BARRIER_BYTES = 1024  # barriers first; the ring starts 1024-byte aligned (swizzle atoms need it)
SMEM_LIMIT = 232448
ARRIVAL_OFFSET = 512  # stream-K: each consumer's arrival count, in the barrier area after the ring's barriers
STORE_BARRIER = 4  # named barriers 4 and 5: each consumer warpgroup's epilogue (2 and 3: ping-pong turns)


class StagedStore:
    """The TMA-store epilogue's staging geometry of a config with ``bn``, ``wg_m``, ``consumers``, ``tma_store`` and
    ``store_buffers`` (the dense/grouped ``GemmConfig`` and the scaled ``ScaledConfig``): each consumer warpgroup
    stages ``store_slices`` column slices of ``store_width`` columns of its ``wg_m`` rows, for ``store_tiles``
    tiles (more than 1: the slices rotate through the buffers across tiles, so that the stores of that many tiles
    may be in flight; a ``GemmConfig`` option, 1 elsewhere)."""
    store_tiles = 1

    @property
    def store_width(self) -> int:
        """Columns of one staging slice (one TMA store box): 64 (128-byte swizzle rows), else 32 or 16."""
        return store_width(self.bn)

    @property
    def store_slices(self) -> int:
        """Staging slices per consumer warpgroup (the tile's column slices, at most store_buffers)."""
        return min(self.store_buffers, self.bn // self.store_width)

    def staging_bytes(self, out_itemsize: int = 2) -> int:
        """Shared memory of the TMA-store epilogue's staging buffers (all consumers)."""
        if not self.tma_store:
            return 0
        rows = self.wg_m * self.consumers  # ping-pong: 2 x bm; cooperative: bm
        return rows * self.store_width * out_itemsize * self.store_slices * self.store_tiles

    def staging_reason(self) -> Optional[str]:
        """None when the TMA-store epilogue can stage this config's tiles (or it has none), else why not."""
        if not self.tma_store:
            return None
        if self.bn % 16:
            return f"bn={self.bn}: the TMA-store epilogue needs a multiple of 16 (stmatrix pairs of 8 columns)"
        if self.split_k != 1:
            return "the TMA-store epilogue does not store split-K partials (f32)"
        if self.store_buffers < 1:
            return "the TMA-store epilogue needs at least one staging buffer"
        if self.store_tiles < 1:
            return f"store_tiles={self.store_tiles}: at least 1"
        return None


@dataclass(frozen=True)
class GemmConfig(StagedStore):
    """One point of the GEMM config space.

    bm x bn: the block's output tile; consumers: consumer warpgroups splitting bm; stages: ring depth;
    group_m: tiles per rasterisation group along M; split_k: K splits (f32 partials reduced afterwards);
    cluster_m: blocks per cluster along M, which share (multicast) the B tile; pingpong: the two consumers
    take alternate whole tiles (bm rows each) and take turns issuing wgmma, so one's epilogue runs under the
    other's mainloop (instead of both splitting every tile); tma_store: the epilogue goes through shared
    memory (stmatrix + TMA store, 16-bit outputs; others fall back to the register epilogue), staging
    store_buffers column slices of store_width(bn) columns per consumer warpgroup; stream_k: a short last wave
    of tiles (plan.stream_k_plan says which) is dealt out as contiguous k ranges over all blocks (without
    split_k or a cluster); cluster_n: blocks per cluster along N, which share (multicast) the A tile (the grouped
    kernel's contiguous and masked layouts only: a cluster of a group's tile row never holds another group's rows;
    at most one of cluster_m and cluster_n above 1); store_tiles: the TMA-store epilogue stages the slices of this
    many tiles per consumer, rotating through them across tiles (a slice waits only for the store of the slice
    store_tiles tiles back; the kernel passes its tile count: the K-grouped weight gradient's, ``stage_tile``);
    skip_empty: a consumer whose rows of a tile all lie past its group's end (a group's last, partial tile row)
    waits for and releases the tile's stages without its wgmmas or stores (the grouped kernel's ragged layouts,
    cooperative tiles only).
    """
    bm: int = 128
    bn: int = 256
    stages: int = 4
    consumers: int = 2
    group_m: int = 8
    split_k: int = 1
    cluster_m: int = 1
    pingpong: bool = False
    tma_store: bool = False
    store_buffers: int = 2
    stream_k: bool = True
    stream_a: bool = False
    stream_b: bool = False
    cluster_n: int = 1
    store_tiles: int = 1
    skip_empty: bool = False
    # fields named (repr, config strings) only where not their default: the configs before them keep their names
    # (test ids, recorded results, autotuning records)
    LATE_FIELDS: ClassVar[tuple[str, ...]] = ("store_tiles", "skip_empty")

    def __repr__(self) -> str:
        shown = [f for f in fields(self) if f.name not in self.LATE_FIELDS or getattr(self, f.name) != f.default]
        return f"GemmConfig({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    def bk(self, itemsize: int) -> int:
        return BK_BYTES // itemsize

    def ring_end(self, itemsize: int) -> int:
        return BARRIER_BYTES + self.stages * (self.bm + self.bn) * self.bk(itemsize) * itemsize

    def smem_bytes(self, itemsize: int) -> int:
        return self.ring_end(itemsize) + self.staging_bytes()

    @property
    def wg_m(self) -> int:
        """Rows of the tile one consumer warpgroup computes."""
        return self.bm if self.pingpong else self.bm // self.consumers

    def check(self, itemsize: int, b_major: str = "K") -> Optional[str]:
        """None if this config can be compiled (for a B operand of this major-ness), else why not."""
        if self.pingpong and (self.consumers != 2 or self.split_k != 1 or self.cluster_m != 1 or self.cluster_n != 1):
            return "ping-pong needs 2 consumers, no K split and no cluster"
        wg_m = self.wg_m
        if self.consumers not in (1, 2) or self.bm % self.consumers or wg_m % 64 or wg_m > 128:
            return f"bm={self.bm} with {self.consumers} consumers: each consumer needs 64 or 128 rows"
        if self.bn % 8 or not 8 <= self.bn <= 256:
            return f"bn={self.bn}: must be a multiple of 8 in [8, 256]"
        if b_major == "MN" and self.bn % (32 // itemsize):
            return f"bn={self.bn}: an MN-major B tile spans at least one 32-byte swizzle row"
        if (wg_m // 64) * self.bn // 2 > 128:
            return f"{wg_m}x{self.bn} per consumer needs more than 128 accumulator registers"
        if self.stages < 2:
            return "at least 2 stages"
        if self.stream_a and self.stream_b:
            return "stream_a and stream_b: at most one operand is streamed"
        if self.cluster_m not in (1, 2) or self.cluster_n not in (1, 2):
            return f"cluster_m={self.cluster_m}, cluster_n={self.cluster_n}: 1 or 2"
        if self.cluster_m > 1 and self.cluster_n > 1:
            return "a cluster runs along M or along N, not both"
        # each block of a 2-block cluster loads half of the B tile: whole 8-row swizzle atoms (K-major) or whole
        # swizzle rows of at least 32 bytes (MN-major)
        if self.cluster_m == 2 and (self.bn % 16 or (b_major == "MN" and self.bn // 2 % (32 // itemsize))):
            return (f"cluster_m=2 with bn={self.bn}: each block loads half of B, a multiple of 8 rows (K-major) or "
                    f"of {32 // itemsize} columns (MN-major)")
        if self.cluster_m == 2 and self.group_m % 2:
            return "a 2-block cluster needs an even group_m"
        if self.store_tiles != 1 and not self.tma_store:
            return "store_tiles: the staging ring of the TMA-store epilogue (tma_store)"
        if self.staging_reason():
            return self.staging_reason()
        if self.smem_bytes(itemsize) > SMEM_LIMIT:
            return f"{self.smem_bytes(itemsize)} bytes of shared memory exceed {SMEM_LIMIT}"
        return None


def store_width(bn: int) -> int:
    for w in (64, 32, 16):
        if bn % w == 0:
            return w
    return 0


def load_hint(cfg: Any, operand: str) -> Optional[str]:
    """The L2 eviction hint of operand ``operand``'s ("A" or "B") loads for a config with ``stream_a`` and
    ``stream_b`` (``GemmConfig``, the scaled ``ScaledConfig``): the streamed operand's evict_first, the other's
    evict_last; None when neither is streamed."""
    if not (cfg.stream_a or cfg.stream_b):
        return None
    return "evict_first" if (cfg.stream_a if operand == "A" else cfg.stream_b) else "evict_last"


def store_box(cfg: StagedStore, batched: bool) -> tuple[tuple[int, ...], int]:
    """(TMA box, swizzle) of the output descriptor of the TMA-store epilogue (16-bit outputs)."""
    width = cfg.store_width
    return (1,) * batched + (cfg.wg_m, width), width * 2


@dataclass(frozen=True)
class Epilogue:
    """What the epilogue applies: out = act(alpha * acc + beta * C_in) (``scaled``: alpha is not 1);
    ``partial``: write raw f32 partial sums (split-K) instead."""
    has_c: bool = False
    activation: str = "none"  # none, relu, gelu_tanh, silu
    partial: bool = False
    scaled: bool = False


ACTIVATIONS = ("none", "relu", "gelu_tanh", "silu")

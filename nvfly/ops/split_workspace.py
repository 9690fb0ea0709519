"""The zeroed f32 workspace and arrival counters of kernels that reduce across CTAs: the skinny GEMM's split K and
the wgmma GEMM's stream-K tail (see ``nvfly.arch.gpu_scope``). Every launch leaves them zeroed, so the next one
needs no memset; launches on one stream are ordered, so they share one pair per (device, stream)."""
from __future__ import annotations

import torch

MIN_SUMS = 1 << 18  # f32 sums of a first allocation (1 MB), so that most calls never grow it
MIN_COUNTERS = 1024

_WORKSPACES: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device, stream: int, tiles: int, tile_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(f32 sums, i32 arrival counters) for ``tiles`` output tiles of ``tile_slots`` sums each, zero between
    launches, for launches on ``stream`` of ``device``; grown as needed. Allocate outside CUDA graph capture (the
    first such call on a stream allocates)."""
    key = (device.index, stream)
    entry = _WORKSPACES.get(key)
    if entry is None or entry[1].numel() < tiles or entry[0].numel() < tiles * tile_slots:
        sums, counts = (0, 0) if entry is None else (entry[0].numel(), entry[1].numel())
        entry = (torch.zeros(max(tiles * tile_slots, MIN_SUMS, sums), dtype=torch.float32, device=device),
                 torch.zeros(max(tiles, MIN_COUNTERS, counts), dtype=torch.int32, device=device))
        _WORKSPACES[key] = entry
    return entry

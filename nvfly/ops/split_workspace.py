"""Per-stream scratch of kernels that reduce across CTAs. ``workspace``: the zeroed f32 sums and arrival counters of
the skinny GEMM's split K and the wgmma GEMM's stream-K tail (see ``nvfly.arch.gpu_scope``); every launch leaves
them zeroed, so the next one needs no memset. ``partials``: the f32 partial products of the wgmma GEMM's split K,
which its reduce kernel reads back. Launches on one stream are ordered, so they share one of each per
(device, stream)."""
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


_PARTIALS: dict[tuple[int, int], torch.Tensor] = {}


def partials(device: torch.device, stream: int, numel: int) -> torch.Tensor:
    """A flat f32 buffer of at least ``numel`` elements (contents undefined) for launches on ``stream`` of
    ``device``; grown as needed. Under CUDA graph capture a new tensor of the graph's memory pool, not kept: a
    captured graph keeps writing to its buffer, which a later growth here would free."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(numel, dtype=torch.float32, device=device)
    key = (device.index, stream)
    buffer = _PARTIALS.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _PARTIALS[key] = torch.empty(max(numel, MIN_SUMS), dtype=torch.float32, device=device)
    return buffer

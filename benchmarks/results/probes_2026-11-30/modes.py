"""Old (HEAD f58a51e) vs new small-M plans, switchable in one process (probe only)."""
import math
import torch
from nvfly.ops import gemm

NEW_TOKEN = gemm.token_tile_config
NEW_HINTS = gemm.stream_hints


def old_token_tile_config(m, n, k, batches, itemsize, sms, b_major="K"):
    tiles = math.ceil(n / 32) * batches
    if not (48 < m <= 64 and 0.9 * sms <= tiles <= sms and math.ceil(k / 64) >= 32):
        return None
    return gemm.deepest_ring(gemm.replace(gemm.TOKEN_TILE, bn=32), itemsize)


def set_mode(mode):
    gemm.token_tile_config = old_token_tile_config if mode == "old" else NEW_TOKEN
    gemm.stream_hints = NEW_HINTS if mode == "new" else (lambda cfg, *a: cfg)
    gemm._CALLS.clear()


def operand(rows, cols, major, device="cuda"):
    if major == "row":
        return torch.randn(rows, cols, device=device).to(torch.bfloat16)
    return torch.randn(cols, rows, device=device).to(torch.bfloat16).t()


def plan_of(m, n, k, am, bm, mode, device="cpu"):
    set_mode(mode)
    a = torch.empty(m, k, dtype=torch.bfloat16, device=device) if am == "row" else \
        torch.empty(k, m, dtype=torch.bfloat16, device=device).t()
    b = torch.empty(k, n, dtype=torch.bfloat16, device=device) if bm == "row" else \
        torch.empty(n, k, dtype=torch.bfloat16, device=device).t()
    if device == "cpu":
        if gemm._skinny_wanted(a, b, None, None):
            return None
        return gemm._make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", None, False)
    return gemm._new_plan(a, b, False, "none", None, None, None, None, False)

"""The register epilogue of the wgmma GEMMs (dense, grouped, scaled split-K partials): each thread stores its
accumulator fragments straight to global memory as 4-byte pairs, after the activation (``activate``)."""
from __future__ import annotations

from typing import Any

import nvfly


@nvfly.func
def activate(x, KIND):
    if KIND == "relu":
        x = nvfly.maximum(x, 0.0)
    elif KIND == "gelu_tanh":
        x = 0.5 * x * (1.0 + nvfly.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif KIND == "silu":
        x = x / (1.0 + nvfly.exp2(x * -1.4426950408889634))
    return x


def _unit_stride(t: Any, dim: int) -> bool:
    """Whether dimension ``dim`` of a traced tensor is statically contiguous (allows vector stores)."""
    return isinstance(t.stride[dim], int) and t.stride[dim] == 1


@nvfly.func
def store_tile(out, c_in, accs, batch, row0, col0, m, n, alpha, beta, BN, ATOMS_M, EPI, inside):
    """Write the consumer's fragments (``store_fragments``): where the tile lies ``inside`` the output (a traced
    condition: the common case), without bounds checks; else masked to [0, m) x [0, n)."""
    if inside:
        store_fragments(out, c_in, accs, batch, row0, col0, m, n, alpha, beta, BN, ATOMS_M, EPI, False)
    else:
        store_fragments(out, c_in, accs, batch, row0, col0, m, n, alpha, beta, BN, ATOMS_M, EPI, True)


@nvfly.func
def store_fragments(out, c_in, accs, batch, row0, col0, m, n, alpha, beta, BN, ATOMS_M, EPI, MASKED):
    """Write the consumer's fragments: element 4j+2h+e of atom i is (row0 + 64i + 8h, col0 + 8j + e).

    Without MASKED (the tile lies inside the output) no element is bounds-checked.
    """
    vec = _unit_stride(out, 2)
    for i in nvfly.static_range(ATOMS_M):
        for h in nvfly.static_range(2):
            row = row0 + 64 * i + 8 * h
            if not MASKED or row < m:
                for j in nvfly.static_range(BN // 8):
                    col = col0 + 8 * j
                    v0 = accs[i][4 * j + 2 * h]
                    v1 = accs[i][4 * j + 2 * h + 1]
                    if not EPI.partial:
                        if EPI.scaled:
                            v0 = v0 * alpha
                            v1 = v1 * alpha
                        if EPI.has_c:
                            if not MASKED or col < n:
                                v0 = v0 + beta * c_in[batch, row, col].to(nvfly.f32)
                            if not MASKED or col + 1 < n:
                                v1 = v1 + beta * c_in[batch, row, col + 1].to(nvfly.f32)
                        v0 = activate(v0, EPI.activation)
                        v1 = activate(v1, EPI.activation)
                    if vec and (not MASKED or col + 1 < n):
                        out.store(nvfly.make_vector([v0, v1]).to(out.dtype), batch, row, col)
                    else:
                        if not MASKED or col < n:
                            out[batch, row, col] = v0.to(out.dtype)
                        if not MASKED or col + 1 < n:
                            out[batch, row, col + 1] = v1.to(out.dtype)

"""The online softmax step of the wgmma attention kernels (prefill's and MLA decode's), on a warpgroup's S
accumulator: each thread holds parts of two rows (element 4j + 2h + e of a 64 x N accumulator is row h of the
thread's two, see ``nvfly.arch.sm90.wgmma``), the four lanes of a quad share a row.

Maxima are kept in raw score units and the scale is folded into exp2's one FFMA: p = exp2(s · scale·log2e −
max · scale·log2e). Sums are thread-partial (the quad reduces them once, at the end).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import nvfly

NEG_INF = float("-inf")


class SoftmaxStep(NamedTuple):
    """The rows' new maxima and thread-partial sums, the factors that rescale the rows' O accumulator, and P (one
    value per S element)."""
    maxima: list
    sums: list
    rescales: list
    p: list


def row_of(i: int) -> int:
    """Which of the thread's two rows accumulator element ``i`` belongs to (element 4j + 2h + e is row h)."""
    return (i // 2) % 2


def online_softmax(scores: list, maxima: list, sums: list, scale_log2: Any, masked: bool,
                   tree_max: bool = False) -> SoftmaxStep:
    """Fold one block of ``scores`` (S's elements, masked ones -inf) into the rows' running ``maxima`` and
    ``sums``; ``masked``: a row may have no key kept yet (shift by 0, not -inf, so that exp2 gives 0, not NaN);
    ``tree_max``: each row's maximum by a pairwise tree (log2 of the row's scores dependent FMNMX before the quad's
    shuffles instead of one chain through all of them: the first exp2 waits on that chain)."""
    new_maxima, new_sums, shifts, rescales = [], [], [], []
    for r in nvfly.static_range(2):
        if tree_max:
            level = [maxima[r]] + [scores[i + e] for i in range(r * 2, len(scores), 4) for e in range(2)]
            while len(level) > 1:
                level = [nvfly.maximum(level[i], level[i + 1]) if i + 1 < len(level) else level[i]
                         for i in range(0, len(level), 2)]
            top = level[0]
        else:
            top = maxima[r]
            for i in nvfly.static_range(r * 2, len(scores), 4):
                top = nvfly.maximum(top, nvfly.maximum(scores[i], scores[i + 1]))
        top = nvfly.maximum(top, nvfly.shfl_xor(top, 1))  # the 4 lanes of a row
        top = nvfly.maximum(top, nvfly.shfl_xor(top, 2))
        reference = nvfly.select(top == NEG_INF, 0.0, top) if masked else top
        shift = reference * scale_log2
        rescales.append(nvfly.exp2(nvfly.fma(maxima[r], scale_log2, -shift)))
        shifts.append(-shift)
        new_maxima.append(top)
    # fused (one rounding; a separate multiply and subtract are an FMUL and an FADD a score: PTX's mul.rn / sub.rn
    # forbid ptxas to contract them)
    p = [nvfly.exp2(nvfly.fma(x, scale_log2, shifts[row_of(i)])) for i, x in enumerate(scores)]
    for r in nvfly.static_range(2):
        total = sums[r] * rescales[r]
        for i in nvfly.static_range(r * 2, len(p), 4):
            total = total + p[i] + p[i + 1]
        new_sums.append(total)
    return SoftmaxStep(new_maxima, new_sums, rescales, p)

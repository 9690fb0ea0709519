"""The online softmax step of the wgmma attention kernels (prefill's and MLA decode's), on a warpgroup's S
accumulator: each thread holds parts of two rows (element 4j + 2h + e of a 64 x N accumulator is row h of the
thread's two, see ``nvfly.arch.sm90.wgmma``), the four lanes of a quad share a row.

Maxima are kept in raw score units and the scale is folded into exp2's one FFMA: p = exp2(s · scale·log2e −
max · scale·log2e). Sums are thread-partial (the quad reduces them once, at the end).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import nvfly
from nvfly.arch.reduce import tree_reduce

NEG_INF = float("-inf")
LN2 = math.log(2.0)  # a log2-unit LSE times LN2 is in natural log, torch's convention
LOG2E = 1.0 / LN2
# 2^f on [-1/2, 1/2] by c0 + c1 f + c2 f^2: relative error < 1.8e-3 (far under e4m3 P's 2^-4 rounding)
EXP2_POLYNOMIAL = (1.0004426, 0.7034338, 0.2384212)
# bf16/fp16 P: c0 + c1 f + c2 f^2 + c3 f^3, relative error < 7.5e-5 (a 1/50 of bf16's rounding; near-minimax by
# reweighted least squares)
EXP2_CUBIC = (0.99992806, 0.69326097, 0.24261115, 0.05517167)
ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: x + it rounds x to an integer, held in the sum's low mantissa bits


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


def polynomial_slots(per_16: int) -> frozenset:
    """Which scores of every 16 (a thread's, by index % 16) ``online_softmax`` exponentiates by ``exp2_polynomial``:
    ``per_16`` of them, spread out."""
    return frozenset(16 * k // per_16 + 16 // per_16 - 1 for k in range(per_16)) if per_16 else frozenset()


def exp2_polynomial(x: Any, coefficients: tuple = EXP2_POLYNOMIAL) -> Any:
    """2^x for x <= 0 on the FMA and integer pipes instead of MUFU (whose 16 exp2 a clock per SM are as many
    cycles as fp8 D 128's GEMMs): x clamped to -126 (-inf: 2^-126, 0 once P is in e4m3), rounded to an integer j
    by the magic-number add, 2^(x - j) by the polynomial (``EXP2_POLYNOMIAL``: 7 instructions, relative error <
    1.8e-3; ``EXP2_CUBIC``: 8, < 7.5e-5) and j added to its exponent bits (the sum's low bits shifted up by 23:
    the magic's bits shift out). With ``EXP2_CUBIC`` (bf16/fp16 P, where 2^-126 survives the rounding) x below
    -126 gives 0 (a select): a row without keys must sum to 0."""
    clamped = nvfly.maximum(x, -126.0)
    rounded = clamped + ROUND_MAGIC
    f = clamped - (rounded - ROUND_MAGIC)
    p = nvfly.fma(f, coefficients[-1], coefficients[-2])
    for c in reversed(coefficients[:-2]):
        p = nvfly.fma(p, f, c)
    p = (p.bitcast(nvfly.i32) + (rounded.bitcast(nvfly.i32) << 23)).bitcast(nvfly.f32)
    return nvfly.select(x < -126.0, 0.0, p) if coefficients == EXP2_CUBIC else p


def online_softmax(scores: list, maxima: list, sums: list, scale_log2: Any, masked: bool,
                   tree_max: bool = False, poly_exp2: int = 0, polynomial: tuple = EXP2_POLYNOMIAL) -> SoftmaxStep:
    """Fold one block of ``scores`` (S's elements, masked ones -inf) into the rows' running ``maxima`` and
    ``sums``; ``masked``: a row may have no key kept yet (shift by 0, not -inf, so that exp2 gives 0, not NaN);
    ``tree_max``: each row's maximum by a pairwise tree (log2 of the row's scores dependent FMNMX before the quad's
    shuffles instead of one chain through all of them: the first exp2 waits on that chain); ``poly_exp2``: that
    many of every 16 scores exponentiated by ``exp2_polynomial`` (with ``polynomial``'s coefficients) instead of
    MUFU."""
    new_maxima, new_sums, shifts, rescales = [], [], [], []
    for r in nvfly.static_range(2):
        if tree_max:
            top = tree_reduce([maxima[r]] + [scores[i + e] for i in range(r * 2, len(scores), 4) for e in range(2)],
                              nvfly.maximum)
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
    slots = polynomial_slots(poly_exp2)
    p = [exp2_polynomial(nvfly.fma(x, scale_log2, shifts[row_of(i)]), polynomial) if i % 16 in slots
         else nvfly.exp2(nvfly.fma(x, scale_log2, shifts[row_of(i)])) for i, x in enumerate(scores)]
    for r in nvfly.static_range(2):
        total = sums[r] * rescales[r]
        for i in nvfly.static_range(r * 2, len(p), 4):
            total = total + p[i] + p[i + 1]
        new_sums.append(total)
    return SoftmaxStep(new_maxima, new_sums, rescales, p)

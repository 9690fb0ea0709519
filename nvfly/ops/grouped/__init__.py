"""Grouped GEMM on torch tensors (Hopper; MoE experts): ``grouped_mm`` with ``torch._grouped_mm``'s semantics
(2-D x 3-D with ragged offsets, 2-D x 2-D grouped along K, 3-D x 3-D) and an optional fused gate/up SiLU
epilogue, and ``grouped_mm_masked`` (fixed capacity per expert with device counts). One persistent TMA + wgmma
kernel (``kernel``) walks every group's tiles without a host read of the sizes; ``plan`` picks its tile, ``api``
holds the host functions re-exported here, and docs/ops/grouped.md the design and measurements.
"""
from nvfly.ops.grouped.api import (check, compile_variants, describe, eligibility, grouped_mm, grouped_mm_masked,
                                   product, reference, validate_offsets)
from nvfly.ops.grouped.plan import GroupedPlan

__all__ = ["GroupedPlan", "check", "compile_variants", "describe", "eligibility", "grouped_mm", "grouped_mm_masked",
           "product", "reference", "validate_offsets"]

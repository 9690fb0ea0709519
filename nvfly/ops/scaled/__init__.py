"""FP8 scaled GEMM on Hopper (``torch._scaled_mm`` / ``F.scaled_mm`` semantics): tensor-wise, row-wise and block
(1x128 activations x 128x128 weights, promoted every k-block) fp32 scales, and MX (e8m0 scales per 32 of K,
promoted every k-step; MXFP8, or MXFP4 weights converted in shared memory) on a persistent TMA + fp8 wgmma kernel
(``kernel``, planned by ``plan``); MXFP4 weights x bf16/fp16 activations on a weight-streaming mma.sync kernel
(``a16_kernel``, planned by ``a16_plan``); the grouped scaled GEMM of MoE experts (``scaled_grouped_mm`` contiguous,
``..._masked``; block, row-wise or MX scales, MXFP4 expert weights converted in shared memory) on
``grouped_kernel``, planned by ``grouped_plan``, host functions in ``grouped``; ``api`` holds the dense host
functions re-exported here, docs/ops/scaled.md the design and measurements.
"""
from nvfly.ops.scaled.a16_plan import A16Config
from nvfly.ops.scaled.api import check, dequantize, describe, eligibility, path, recipe, reference, scaled_mm
from nvfly.ops.scaled.config import ScaledConfig, ScaledEpilogue
from nvfly.ops.scaled.grouped import (check_grouped, describe_grouped, grouped_eligibility, grouped_recipe,
                                      grouped_reference, scaled_grouped_mm, scaled_grouped_mm_masked)

__all__ = ["A16Config", "ScaledConfig", "ScaledEpilogue", "check", "check_grouped", "dequantize", "describe",
           "describe_grouped", "eligibility", "grouped_eligibility", "grouped_recipe", "grouped_reference", "path",
           "recipe", "reference", "scaled_grouped_mm", "scaled_grouped_mm_masked", "scaled_mm"]

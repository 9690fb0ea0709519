"""RMSNorm forward and backward, with an optional weight and a fused residual add, at the memory roofline.

``y = x * rsqrt(mean(x**2) + eps) * weight`` over the last dimensions, in fp32 whatever the storage type
(bf16, fp16 or fp32); ``y`` takes the input's dtype. With ``residual``, ``h = x + residual`` is rounded to the
input's dtype (as the unfused ``x + residual`` would be), written out, and normalised.

Modules: ``api`` (the host functions re-exported here), ``plan`` (plans and the heuristics choosing them),
``kernels`` (device code), ``hints`` (the cache hints of its accesses); the reductions and the cache-hinted
accesses are ``nvfly.arch``'s (``reduce``, ``memory``); docs/ops/rmsnorm.md has the measurements behind the plans.
"""
from nvfly.ops.rmsnorm.api import (backward_eligibility, check_backward_shapes, check_shapes, eligibility, plan_of,
                                   rms_norm, rms_norm_backward, rms_norm_forward)
from nvfly.ops.rmsnorm.plan import LOAD_HINTS, ForwardOptions, RowPlan

__all__ = ["ForwardOptions", "LOAD_HINTS", "RowPlan", "backward_eligibility", "check_backward_shapes", "check_shapes",
           "eligibility", "plan_of", "rms_norm", "rms_norm_backward", "rms_norm_forward"]

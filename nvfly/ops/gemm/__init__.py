"""Dense GEMM on torch tensors (Hopper): out = act(alpha * A @ B + beta * C) for mm / addmm / bmm / linear, every
operand major-ness without copies, tails in M, N and K. Two kernels: the persistent TMA + wgmma kernel
(``kernel``, planned by ``plan``) and, for decode shapes, the memory-bound mma.sync skinny kernel
(``skinny_kernel``, planned by ``skinny_plan``); ``api`` holds the host functions re-exported here, and
docs/ops/gemm.md the measurements behind the heuristics.
"""
from nvfly.ops.gemm.api import bind, check, describe, eligibility, matmul, path, product_shape, reference
from nvfly.ops.gemm.config import ACTIVATIONS, Epilogue, GemmConfig
from nvfly.ops.gemm.plan import config_space

__all__ = ["ACTIVATIONS", "Epilogue", "GemmConfig", "bind", "check", "config_space", "describe", "eligibility",
           "matmul", "path", "product_shape", "reference"]

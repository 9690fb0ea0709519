"""Host-side checks the wgmma GEMM family shares (dense, grouped, scaled): the 16-bit operand dtypes, an operand's
major-ness, whether TMA can describe a tensor (or store an output), and whether the arguments sit on one Hopper
GPU."""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

import nvfly

OPERAND_DTYPES = {torch.bfloat16: nvfly.bf16, torch.float16: nvfly.f16}


def operand_major(t: torch.Tensor, contiguous_k_dim: int) -> Optional[str]:
    """'K' if the K dimension (``contiguous_k_dim``: -1 for A, -2 for B) is contiguous, 'MN' if the other
    matrix dimension is, None if neither."""
    other = -2 if contiguous_k_dim == -1 else -1
    if t.stride(contiguous_k_dim) == 1 or t.shape[contiguous_k_dim] == 1:
        return "K"
    if t.stride(other) == 1 or t.shape[other] == 1:
        return "MN"
    return None


def tma_reason(name: str, t: torch.Tensor, unit_dim: int) -> Optional[str]:
    """None when TMA can describe tensor ``t`` (dimension ``unit_dim`` contiguous), else why not."""
    if t.data_ptr() % 16:
        return f"{name}: its address is not 16-byte aligned (TMA needs it)"
    for d in range(t.dim()):
        if d % t.dim() == unit_dim % t.dim() or t.shape[d] == 1:
            continue
        if (t.stride(d) * t.element_size()) % 16:
            return (f"{name}: stride {t.stride(d)} of dimension {d} is not a multiple of 16 bytes "
                    f"(TMA cannot describe it)")
    return None


@functools.lru_cache(maxsize=None)
def capability(device: int) -> tuple[int, int]:
    """The GPU's compute capability (asked once a device)."""
    return torch.cuda.get_device_capability(device)


def hopper_reason(what: str, a: Any, **others: Any) -> Optional[str]:
    """Why ``what`` cannot run on operand ``a``'s device with the ``others`` (by argument name; None: absent):
    ``a`` not on CUDA, another tensor on another device, or a GPU other than sm_90; None when they can."""
    if not a.is_cuda:
        return f"a is on {a.device}, not CUDA"
    for name, t in others.items():
        if t is not None and t.device != a.device:
            return f"{name} is on {t.device}, a on {a.device}"
    major, minor = capability(a.device.index)
    if major != 9:
        return f"a is on an sm_{major}{minor} GPU: {what} needs an sm_90 (Hopper) GPU"
    return None


def store_reason(out3: torch.Tensor) -> Optional[str]:
    """None when the TMA-store epilogue can write the output view ``out3`` ([B,] M, N as the kernel sees it), else
    why the register epilogue stores it instead."""
    if out3.element_size() != 2:
        return "the TMA-store epilogue stores 16-bit outputs (stmatrix); f32 goes through registers"
    if out3.stride(-1) != 1 and out3.shape[-1] != 1:
        return "the output's last dimension is not contiguous"
    if out3.shape[-1] * out3.element_size() % 16:
        # seen on the H200: with such an extent the TMA store also wrote the columns just past it (the
        # padding of a strided view), so only whole 16-byte rows are stored through TMA
        return "the output's rows are not a multiple of 16 bytes long"
    return tma_reason("out", out3, -1)

"""PyTorch integration: custom ops, eager routing of aten calls to nvfly kernels, and TorchInductor hooks.

    import nvfly.torch
    nvfly.torch.install()                       # nvfly joins torch.compile(mode="max-autotune") GEMM autotuning,
                                                # and compiled SDPA and flex_attention go to nvfly where it wins
    with nvfly.torch.routing():                 # eager: mm/addmm/bmm, _scaled_mm, SDPA (decode, prefill, training),
                                                # flex_attention, RMSNorm, TopK, _grouped_mm, _scaled_grouped_mm
                                                # to nvfly where faster
        y = model(x)
    nvfly.torch.autotune([(16, 4096, 4096)])    # fills the database that routing and Inductor's candidates read
    print(nvfly.torch.explain(16, 4096, 4096))  # candidates, times, winner, and why nvfly was declined or lost
    print(nvfly.torch.explain_sdpa(1, 32, 8, 4096, 4096, 128, is_causal=True))  # which kernel runs SDPA, and why
    print(nvfly.torch.explain_flex(1, 16, 8, 8192, 8192, 256, mods=("softcap", "window")))  # and flex_attention

Importing this package registers nvfly's GEMM, grouped-GEMM, scaled-GEMM and attention custom ops
(``torch.ops.nvfly.*``) and changes nothing else: Inductor hooks are installed by ``install()`` only; aten routes are
registered while a ``routing()`` block or ``enable_routing()`` is in force, and removed after (outside routing,
torch calls cost what they cost without nvfly).
No GPU is needed to import it.
"""
from __future__ import annotations

import sys

import torch

# ``routing`` is the routing module, callable as its switch (``with nvfly.torch.routing():``). ``autotune`` and
# ``explain`` name both a submodule and its main function: importing the function here, after the submodule,
# leaves the function as the package attribute (reach the modules with ``from nvfly.torch.autotune import ...``)
from nvfly.torch import attention_ops, grouped_ops, routing  # noqa: F401  (attention_ops: nvfly::attention_decode,
# SDPA route; grouped_ops: nvfly::grouped_mm, the _grouped_mm route)
from nvfly.torch import moe_ops  # noqa: F401  (nvfly::moe_route, moe_permute, moe_unpermute: the MoE shuffles)
from nvfly.torch import flex_compile  # noqa: F401  (nvfly::flex_attention: flex under torch.compile)
from nvfly.torch import scaled_grouped_ops, scaled_ops  # noqa: F401  (the _scaled_mm and _scaled_grouped_mm routes,
# nvfly::scaled_mm_out)
from nvfly.torch.autotune import autotune, database
from nvfly.torch.explain import explain, explain_flex, explain_sdpa
from nvfly.torch.routing import install_routing, routing_enabled

__all__ = ["install", "uninstall", "routing", "enable_routing", "disable_routing", "routing_enabled",
           "install_routing", "autotune", "database", "explain", "explain_flex", "explain_sdpa"]


def install(*, max_candidates: int = 4, attention: bool = True) -> None:
    """Make nvfly a GEMM backend of ``torch.compile(mode="max-autotune")`` (see ``nvfly.torch.inductor``) and, with
    ``attention``, rewrite the SDPA calls of graphs compiled in any mode to nvfly's attention where the eager rule
    accepts them (see ``nvfly.torch.attention_compile``) and make nvfly a flex_attention backend of
    ``torch.compile`` (``nvfly.torch.flex_compile``: per call, and by its auto rule)."""
    from nvfly.torch.inductor import install as install_inductor
    if attention:
        from nvfly.torch import attention_compile
        attention_compile.install()
        flex_compile.install(auto=True)
    install_inductor(max_candidates=max_candidates)


def uninstall() -> None:
    """Undo ``install()``: GEMMs and SDPA compiled from now on are left to torch."""
    inductor = sys.modules.get("nvfly.torch.inductor")
    if inductor is not None:
        inductor.uninstall()
    attention_compile = sys.modules.get("nvfly.torch.attention_compile")
    if attention_compile is not None:
        attention_compile.uninstall()
    flex_compile.uninstall()


def enable_routing() -> None:
    """Route eligible aten calls to nvfly from now on in this thread / async context (``routing()`` for a block);
    the routes stay registered until ``disable_routing()`` here.

    Backward passes started here run on this thread (not on autograd's CUDA worker threads, which would not see
    the switch), so their GEMMs are routed too."""
    routing.enable_routing()
    torch.autograd.set_multithreading_enabled(False)


def disable_routing() -> None:
    """Undo ``enable_routing()`` (its routes are removed unless a ``routing()`` block holds them)."""
    routing.disable_routing()
    torch.autograd.set_multithreading_enabled(True)

"""PyTorch integration: custom ops, eager routing of aten calls to nvfly kernels, and TorchInductor hooks.

    import nvfly.torch
    nvfly.torch.install()                       # nvfly joins torch.compile(mode="max-autotune") GEMM autotuning
    with nvfly.torch.routing():                 # eager: mm/addmm/bmm, _scaled_mm, decode SDPA (and RMSNorm, TopK)
                                                # to nvfly where faster (_scaled_mm: where eligible)
        y = model(x)
    nvfly.torch.autotune([(16, 4096, 4096)])    # fills the database that routing and Inductor's candidates read
    print(nvfly.torch.explain(16, 4096, 4096))  # candidates, times, winner, and why nvfly was declined or lost

Importing this package registers nvfly's GEMM and attention-decode custom ops (``torch.ops.nvfly.*``) and
changes nothing else: Inductor hooks are installed by ``install()`` only, aten routes by ``routing()`` /
``enable_routing()`` only.
No GPU is needed to import it.
"""
from __future__ import annotations

import sys

import torch

# ``routing`` is the routing module, callable as its switch (``with nvfly.torch.routing():``). ``autotune`` and
# ``explain`` name both a submodule and its main function: importing the function here, after the submodule,
# leaves the function as the package attribute (reach the modules with ``from nvfly.torch.autotune import ...``)
from nvfly.torch import attention_ops, routing  # noqa: F401  (attention_ops: nvfly::attention_decode, SDPA route)
from nvfly.torch import scaled_ops  # noqa: F401,E402  (the _scaled_mm routes)
from nvfly.torch.autotune import autotune, database
from nvfly.torch.explain import explain
from nvfly.torch.routing import install_routing, routing_enabled

__all__ = ["install", "uninstall", "routing", "enable_routing", "disable_routing", "routing_enabled",
           "install_routing", "autotune", "database", "explain"]


def install(*, max_candidates: int = 4) -> None:
    """Make nvfly a GEMM backend of ``torch.compile(mode="max-autotune")`` (see ``nvfly.torch.inductor``)."""
    from nvfly.torch.inductor import install as install_inductor
    install_inductor(max_candidates=max_candidates)


def uninstall() -> None:
    """Undo ``install()``: GEMMs compiled from now on are tuned without nvfly."""
    inductor = sys.modules.get("nvfly.torch.inductor")
    if inductor is not None:
        inductor.uninstall()


def enable_routing() -> None:
    """Route eligible aten calls to nvfly from now on in this thread / async context (``routing()`` for a block).

    Backward passes started here run on this thread (not on autograd's CUDA worker threads, which would not see
    the switch), so their GEMMs are routed too."""
    install_routing()
    routing.enable_routing()
    torch.autograd.set_multithreading_enabled(False)


def disable_routing() -> None:
    """Undo ``enable_routing()``."""
    routing.disable_routing()
    torch.autograd.set_multithreading_enabled(True)

"""nvfly as a GEMM backend of TorchInductor's max-autotune, without patching torch.

    nvfly.torch.install()                                   # explicit; nvfly.torch.uninstall() undoes it
    model = torch.compile(model, mode="max-autotune")       # mm / addmm / bmm / baddbmm / _grouped_mm /
                                                            # _scaled_mm: ATen, Triton, nvfly

How a GEMM flows (torch 2.11 and 2.13 alike):
1. Inductor's lowering of aten.mm/addmm/bmm/baddbmm asks ``V.choices.get_template_configs`` for choices. nvfly
   installs ``config.inductor_choices_class`` (a subclass of ``InductorChoices``) and, in the call that carries
   the ATen choice, appends its own. When another choices class already holds that slot, nvfly adds its choices
   from an ``add_preprocessing_fn`` hook instead, reading the ATen choice's inputs and layout.
2. Workload analysis: static sizes, strides, dtypes and alignment of the IR inputs go through the same
   eligibility as eager calls (``gemm_ops.analyze``); a decline is logged and recorded for ``explain``.
3. Candidates: nvfly's heuristic ("auto"), the autotune database's best for the shape class and a few variants
   (``autotune.candidates``), each an extern choice calling ``nvfly_gemm`` with a config string. They start
   compiling in a thread pool right away (``precompile``); a config that fails to compile is dropped.
4. Inductor benchmarks them beside ATen and Triton. A winning nvfly choice is emitted as a call of the custom
   op ``torch.ops.nvfly.mm_out`` / ``addmm_out`` with its config string.

Grouped mm (``aten._grouped_mm``, MoE experts) does not ask ``V.choices``: the ``add_preprocessing_fn`` hook adds
nvfly's grouped candidates (``grouped_ops.inductor_candidates``) next to the ATen choice, emitted as
``torch.ops.nvfly.grouped_mm_out``; the rest (compile, benchmark, fallback) is the GEMM's.

FP8 scaled mm (``aten._scaled_mm``; in torch 2.13 also ``_scaled_mm_v2``, whose lowering uses the same ATen choice)
asks ``V.choices`` with op name "scaled_mm": ``NvflyChoices`` appends nvfly's scaled-GEMM candidates
(``scaled_ops.inductor_candidates``: "auto" and ScaledConfig strings) next to ATen's ``_scaled_mm`` choice, reading its
out_dtype and use_fast_accum; the preprocessing hook adds them instead when another choices class holds the slot or
the lowering never asked ``V.choices``. Declines (fp8 outputs, MX scales, layouts, dynamic shapes, ...:
``scaled_ops.inductor_analysis``) are recorded; a winner is emitted as ``torch.ops.nvfly.scaled_mm_out``.

Caching: a choice's ``hash_key()`` is its op, config and ``uuid()`` (nvfly's toolchain fingerprint, which
includes nvfly's version and source hash, plus the codegen settings), identical across processes, so Inductor's
autotune cache hits. The FX-graph cache key includes the choices class's ``uuid()`` from torch 2.12 on; where it
does not (2.11), or when the preprocessing hook is used, nvfly chains a no-op ``post_grad_custom_post_pass``
whose ``uuid()`` is the same.

Fallback: an analysis error declines the GEMM; a compile error drops the candidate; a benchmark error becomes a
RuntimeError, which Inductor turns into an infinite time; a launch error inside the compiled model makes the op
compute with torch. ATen must stay in ``max_autotune_gemm_backends`` (the default): it is the fallback.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import inspect
import json
import logging
from typing import Any, Callable, NoReturn, Optional, Sequence

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.runtime.benchmarking import benchmarker
from torch._inductor.select_algorithm import (ExternKernelCaller, ExternKernelChoice, add_feedback_saver,
                                              add_preprocessing_fn)

from nvfly import settings
from nvfly.compiler import toolchain
from nvfly.runtime.driver import sm_count
from nvfly.torch.autotune import candidates, database
from nvfly.ops import grouped
from nvfly.torch.gemm_ops import (Decision, TensorInfo, Workload, analyze, bound_reason, nvfly_gemm, precompile,
                                  record)
from nvfly.torch import scaled_ops
from nvfly.torch.grouped_ops import bench_grouped_mm_out, inductor_candidates, out_bound_reason, precompile_grouped

log = logging.getLogger("nvfly")

# aten op (the ATen extern choice's name) -> nvfly out-variant op; the last input pair is (A, B), a first one C
_OPS = {"mm": "mm_out", "bmm": "mm_out", "addmm": "addmm_out", "baddbmm": "addmm_out"}


@dataclasses.dataclass
class _State:
    active: bool = False
    max_candidates: int = 4
    prior_choices: Optional[Callable[[], Any]] = None  # the choices factory nvfly replaced
    via_preprocessing: bool = False
    hooks_registered: bool = False  # the feedback saver and preprocessing hook (they cannot be removed)
    scaled_via_choices: bool = False  # this torch's scaled-mm lowering was seen asking V.choices


_STATE = _State()
_POOL: Optional[concurrent.futures.ThreadPoolExecutor] = None


# ---------------------------------------------------------------------------------------------- install
def install(*, max_candidates: int = 4) -> None:
    """Make nvfly a candidate of every max-autotune GEMM compiled from now on (``max_candidates`` configs each)."""
    if _STATE.active:
        uninstall()
    _STATE.max_candidates = max_candidates
    current = inductor_config.inductor_choices_class
    _STATE.via_preprocessing = current is not None
    _STATE.prior_choices = current
    if not _STATE.hooks_registered:
        add_feedback_saver(_record_timings)
        add_preprocessing_fn(_preprocess)
        _STATE.hooks_registered = True
    _STATE.active = True
    if _STATE.via_preprocessing:
        log.info("nvfly: inductor_choices_class is taken (%s): adding nvfly's GEMM choices from a preprocessing "
                 "hook", current)
    else:
        inductor_config.inductor_choices_class = choices_factory
        _set_thread_choices(NvflyChoices())
    if _STATE.via_preprocessing or not _choices_uuid_in_graph_key():
        inductor_config.post_grad_custom_post_pass = CacheKeyPass(inductor_config.post_grad_custom_post_pass)


def uninstall() -> None:
    """Stop adding nvfly choices (graphs compiled before keep calling nvfly's ops, which stay registered)."""
    global _POOL
    if not _STATE.active:
        return
    _STATE.active = False
    if inductor_config.inductor_choices_class is choices_factory:
        inductor_config.inductor_choices_class = _STATE.prior_choices
        _set_thread_choices(_STATE.prior_choices() if _STATE.prior_choices else InductorChoices())
    current = inductor_config.post_grad_custom_post_pass
    if isinstance(current, CacheKeyPass):
        inductor_config.post_grad_custom_post_pass = current.prior
    if _POOL is not None:
        _POOL.shutdown(wait=False)
        _POOL = None


def installed() -> bool:
    return _STATE.active


def uuid() -> str:
    """What decides the code nvfly's choices generate: toolchain and sources, codegen settings, nvfly's options."""
    blob = json.dumps([toolchain.fingerprint(), settings.codegen_fingerprint(), _STATE.active,
                       _STATE.max_candidates], default=str)
    return "nvfly-" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def choices_factory() -> InductorChoices:
    """The ``inductor_choices_class`` factory (a module-level function, so configs holding it pickle)."""
    return NvflyChoices()


def _set_thread_choices(choices: InductorChoices) -> None:
    # Inductor caches the choices object per thread on first use: replace this thread's so that install and
    # uninstall take effect here even after an earlier compile (other threads read the config when they start)
    from torch._inductor.virtualized import V
    V.set_choices_handler(choices)


def _choices_uuid_in_graph_key() -> bool:
    # torch >= 2.12 puts inductor_choices_class().uuid() into the FX-graph cache key
    return "inductor_choices_class" in getattr(inductor_config, "_cache_config_factory_keys", ())


class ChainedPass(CustomGraphPass):
    """A custom graph pass that takes the place of the pass(es) it found in its config slot: it runs them, then its
    own ``run``; its ``uuid()`` is its ``own_uuid()`` and theirs (None, bypassing the cache as Inductor would, when
    one of them has none)."""

    def __init__(self, prior: Any):
        self.prior = prior

    def _priors(self) -> Sequence[Any]:
        if self.prior is None:
            return ()
        return tuple(self.prior) if isinstance(self.prior, (list, tuple)) else (self.prior,)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self._priors():
            p(graph)
        self.run(graph)

    def run(self, graph: torch.fx.Graph) -> None:
        """This pass's own change of the graph (none by default)."""

    def own_uuid(self) -> str:
        raise NotImplementedError

    def uuid(self) -> Any:
        priors = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self._priors()]
        if None in priors:
            return None  # a prior pass without a uuid: Inductor bypasses the cache, as it would without nvfly
        return (self.own_uuid(), *priors)


class CacheKeyPass(ChainedPass):
    """A post-grad pass that changes nothing but puts nvfly's ``uuid()`` into the FX-graph cache key; it runs
    the pass(es) it replaced."""

    def own_uuid(self) -> str:
        return uuid()


# ---------------------------------------------------------------------------------------------- choices
class NvflyChoices(InductorChoices):
    """Inductor's default choices, plus nvfly's extern choices for mm, addmm, bmm and baddbmm."""

    def uuid(self) -> str:
        return uuid()

    def get_template_configs(self, *args: Any, **kwargs: Any) -> list[Any]:
        choices = super().get_template_configs(*args, **kwargs)
        if not _STATE.active or _STATE.via_preprocessing:
            return choices
        try:  # read the call by parameter name: the signature has changed between torch releases
            call = _TEMPLATE_CONFIGS_SIGNATURE.bind(self, *args, **kwargs).arguments
            op_name, kernel_inputs, templates = call["op_name"], call["kernel_inputs"], call["templates"]
        except (TypeError, KeyError) as exc:
            log.debug("nvfly: unexpected get_template_configs call (%s): no nvfly choices", exc)
            return choices
        # addmm asks several times (ATen, Triton, subgraph templates): join the call carrying the ATen choice
        if op_name in _OPS and any(isinstance(t, ExternKernelChoice) and t.name == op_name for t in templates):
            choices += nvfly_choices(op_name, lambda: (
                kernel_inputs.nodes(), {n: kernel_inputs.get_scalar(n) for n in _SCALARS[_OPS[op_name]]},
                kernel_inputs.output_layout(flexible=False)))
        elif op_name == "scaled_mm":  # _scaled_mm and, in torch >= 2.12, _scaled_mm_v2 (both call ATen's _scaled_mm)
            aten = [c for c in choices if isinstance(c, ExternKernelCaller) and c.choice.name == _SCALED_ATEN]
            if aten:
                _STATE.scaled_via_choices = True
                choices += scaled_choices(kernel_inputs.nodes(), kernel_inputs.output_layout(flexible=False),
                                          aten[0].kwargs)
        return choices


_TEMPLATE_CONFIGS_SIGNATURE = inspect.signature(InductorChoices.get_template_configs)
_SCALARS = {"mm_out": (), "addmm_out": ("beta", "alpha")}
_SCALED_ATEN = "_scaled_mm"  # the name of Inductor's ATen choice for scaled mm (aten._scaled_mm.out)


def _preprocess(choices: list[Any]) -> list[Any]:
    """Add nvfly's grouped-mm choices next to ATen's; nvfly's scaled-mm choices next to ATen's when the lowering did
    not ask ``NvflyChoices`` (another choices class holds the slot, or this torch's lowering does not ask V.choices);
    and, when another choices class holds the slot, nvfly's GEMM choices next to the ATen GEMM."""
    if not _STATE.active or any(isinstance(c, NvflyCaller) for c in choices):
        return choices
    for c in choices:
        if isinstance(c, ExternKernelCaller) and c.choice.name == "_grouped_mm":
            return choices + grouped_choices(c)
        if isinstance(c, ExternKernelCaller) and c.choice.name == _SCALED_ATEN:
            if _STATE.via_preprocessing or not _STATE.scaled_via_choices:
                return choices + scaled_choices(c.input_nodes, c.layout, c.kwargs)
            return choices
    if not _STATE.via_preprocessing:
        return choices
    for c in choices:
        if isinstance(c, ExternKernelCaller) and c.choice.name in _OPS:
            names = _SCALARS[_OPS[c.choice.name]]
            return choices + nvfly_choices(c.choice.name, lambda: (
                c.input_nodes, {n: c.kwargs.get(n, 1) for n in names}, c.layout))
    return choices


def nvfly_choices(op: str, lowering: Callable[[], tuple[Sequence[Any], dict[str, Any], Any]]) -> list[Any]:
    """nvfly's choices for one GEMM lowering (``lowering()``: its input nodes, addmm's beta and alpha, the output
    layout); [] with the reason recorded when nvfly is declined. Never raises: nvfly must not break a compile."""
    try:
        nodes, scalars, layout = lowering()
        *c, a, b = [_operand(n) for n in nodes]
    except Exception as exc:  # a symbolic size, stride or offset, an input without a plain layout, ...
        record(Decision("inductor", op, (0, 0, 0, 0), "(operands unknown)",
                        reason=f"workload analysis failed: {type(exc).__name__}: {exc}"))
        return []
    reason = _declined(scalars)
    w, reason = (None, reason) if reason else analyze(a, b, *c)
    if w is None:
        record(Decision.of("inductor", op, a, b, reason=reason))
        return []
    try:
        configs = _candidates(w, b.device)
        callers = [_extern_choice(_OPS[op]).bind(nodes, layout, config=cfg, **scalars) for cfg in configs]
        decision = record(Decision.of("inductor", op, a, b, candidates=tuple(configs)))
        for caller in callers:
            caller.start_compile([*c, a, b], decision)
    except Exception as exc:  # e.g. an unreadable GPU property
        record(Decision.of("inductor", op, a, b, reason=f"candidate generation failed: {exc}"))
        return []
    return callers


def grouped_choices(aten: Any) -> list[Any]:
    """nvfly's choices for one grouped-mm lowering, from its ATen choice (inputs a, b, offs; its output layout); []
    with the reason recorded when nvfly is declined. Never raises."""
    try:
        if len(aten.input_nodes) != 3:
            raise ValueError("no offsets: 3-D x 3-D grouped mm is a bmm (nvfly's GEMM candidates cover bmm)")
        a, b, offs = [_operand(n) for n in aten.input_nodes]
    except Exception as exc:
        record(Decision("inductor", "grouped_mm", (0, 0, 0, 0), "(operands unknown)",
                        reason=f"workload analysis failed: {type(exc).__name__}: {exc}"))
        return []
    out_dtype = aten.kwargs.get("out_dtype")
    reason = _declined({}) or (f"out_dtype {out_dtype} is not a's dtype" if out_dtype not in (None, a.dtype)
                               else grouped.eligibility(a, b, offs))
    if reason:
        record(Decision.of("inductor", "grouped_mm", a, b, reason=reason))
        return []
    try:
        configs = inductor_candidates(a, b, offs, _STATE.max_candidates)
        callers = [_extern_choice("grouped_mm_out").bind(aten.input_nodes, aten.layout, config=cfg)
                   for cfg in configs]
        decision = record(Decision.of("inductor", "grouped_mm", a, b, candidates=tuple(configs)))
        for caller in callers:
            caller.start_compile([a, b, offs], decision)
    except Exception as exc:
        record(Decision.of("inductor", "grouped_mm", a, b, reason=f"candidate generation failed: {exc}"))
        return []
    return callers


def scaled_choices(nodes: Sequence[Any], layout: Any, aten_kwargs: dict[str, Any]) -> list[Any]:
    """nvfly's choices for one scaled-mm lowering (``nodes``: a, b, scale_a, scale_b and a bias if any; the output
    layout; the ATen choice's out_dtype and use_fast_accum); [] with the reason recorded when nvfly is declined.
    Never raises."""
    try:
        a, b, scale_a, scale_b, *bias = [_operand(n) for n in nodes]
        out = TensorInfo(_ints(layout.size), _ints(layout.stride), layout.dtype, layout.device,
                         _ints([layout.offset])[0] * layout.dtype.itemsize % 16)
    except Exception as exc:
        record(Decision("inductor", "scaled_mm", (0, 0, 0, 0), "(operands unknown)",
                        reason=f"workload analysis failed: {type(exc).__name__}: {exc}"))
        return []
    fast = bool(aten_kwargs.get("use_fast_accum", False))
    declined = _declined({})
    scaling, reason = (None, declined) if declined else scaled_ops.inductor_analysis(
        a, b, scale_a, scale_b, bias[0] if bias else None, out, aten_kwargs.get("out_dtype"))
    if reason:
        record(Decision.of("inductor", "scaled_mm", a, b, reason=reason))
        return []
    try:
        configs = scaled_ops.inductor_candidates(a.shape[0], b.shape[1], a.shape[1], scaling, fast, bool(bias),
                                                 sm_count(a.device.index), _STATE.max_candidates)
        callers = [_extern_choice("scaled_mm_out").bind(nodes, layout, config=cfg, use_fast_accum=fast)
                   for cfg in configs]
        decision = record(Decision.of("inductor", "scaled_mm", a, b, candidates=tuple(configs)))
        for caller in callers:
            caller.start_compile([a, b, scale_a, scale_b, *bias], decision)
    except Exception as exc:
        record(Decision.of("inductor", "scaled_mm", a, b, reason=f"candidate generation failed: {exc}"))
        return []
    return callers


def _declined(scalars: dict[str, Any]) -> Optional[str]:
    """Why nvfly sits out this autotuning, whatever the operands are."""
    if not (inductor_config.max_autotune or inductor_config.max_autotune_gemm):
        return "max-autotune is off (nvfly joins only max-autotune GEMM tuning)"
    if inductor_config.autotune_in_subproc or getattr(inductor_config, "pipeline_max_autotune_gemm", False):
        return "Inductor benchmarks in subprocesses (autotune_in_subproc / pipelined), which lack nvfly's choices"
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in scalars.values()):
        return f"alpha/beta {scalars} are not real numbers"
    return None


def _ints(values: Sequence[Any]) -> tuple[int, ...]:
    """Static sizes, strides or offsets (ValueError for a symbolic one)."""
    out = []
    for v in values:
        if not isinstance(v, (int, sympy.Integer)):
            raise ValueError(f"dynamic shape ({v}): nvfly needs static sizes and strides")
        out.append(int(v))
    return tuple(out)


def _operand(node: Any) -> TensorInfo:
    """The static metadata of an IR input (ValueError when a size, stride or offset is symbolic)."""
    dtype = node.get_dtype()
    offset = _ints([node.get_layout().offset])[0] * dtype.itemsize
    return TensorInfo(_ints(node.get_size()), _ints(node.get_stride()), dtype, node.get_device(), offset % 16)


def _candidates(w: Workload, device: torch.device) -> list[str]:
    entry = database(device.index).lookup(w.key())
    sms = sm_count(device.index)
    return [c.config for c in candidates(w, entry, _STATE.max_candidates, sms)]


def _record_timings(timings: dict[Any, float], name: str, input_nodes: Any, choices: Sequence[Any],
                    *rest: Any) -> None:
    """Inductor's feedback hook: keep every backend's time and the winner on nvfly's decision."""
    ours = [c for c in choices if isinstance(c, NvflyCaller) and c.decision is not None]
    if not ours or not timings:
        return
    decision = ours[0].decision
    decision.timings_ms = {_label(c): float(t) for c, t in timings.items()}
    decision.winner = _label(min(timings, key=timings.__getitem__))


def _label(choice: Any) -> str:
    if isinstance(choice, NvflyCaller):
        return choice.description
    if isinstance(choice, ExternKernelCaller):
        return f"aten {choice.name}"
    return str(choice.name)


# ---------------------------------------------------------------------------------------------- extern choices
def _bench_mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor, config: str) -> None:
    nvfly_gemm(a, b, out=out, config=config)


def _bench_addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor, config: str,
                 beta: float = 1.0, alpha: float = 1.0) -> None:
    nvfly_gemm(a, b, c, alpha=alpha, beta=beta, out=out, config=config)


_BENCH = {"mm_out": _bench_mm, "addmm_out": _bench_addmm, "grouped_mm_out": bench_grouped_mm_out,
          "scaled_mm_out": scaled_ops.bench_scaled_mm_out}
# why the emitted op ran torch for a benchmark's operands (then its time is torch's)
_BOUND_REASON = {"mm_out": bound_reason, "addmm_out": bound_reason, "grouped_mm_out": out_bound_reason,
                 "scaled_mm_out": scaled_ops.out_bound_reason}
# the ops whose kernels specialise on the output's layout: precompiled with a stand-in output
_PRECOMPILE_OUT = {"grouped_mm_out": precompile_grouped, "scaled_mm_out": scaled_ops.precompile_scaled}
_EXTERN: dict[str, "NvflyExternChoice"] = {}


def _extern_choice(op: str) -> "NvflyExternChoice":
    # ExternKernelChoice registers itself by name on Inductor's extern_kernels: one per op and process
    if op not in _EXTERN:
        _EXTERN[op] = NvflyExternChoice(op)
    return _EXTERN[op]


class NvflyExternChoice(ExternKernelChoice):
    """An nvfly op as an Inductor extern choice: benchmarked through ``nvfly_gemm`` (which raises on failure),
    emitted as a call of ``torch.ops.nvfly.<op>.default`` (which falls back to torch on failure)."""

    def __init__(self, op: str):
        super().__init__(_BENCH[op], name=f"nvfly_{op}", has_out_variant=True,
                         op_overload=getattr(torch.ops.nvfly, op).default)
        self.op = op
        self.ordered_kwargs_for_cpp_kernel: Sequence[str] = ()

    def call_name(self) -> str:
        return f"torch.ops.nvfly.{self.op}.default"

    def hash_key(self) -> str:
        return f"nvfly-{self.op}-{uuid()}"

    def bind(self, input_nodes: Any, layout: Any, ordered_kwargs_for_cpp_kernel: Sequence[str] = (),
             **kwargs: Any) -> "NvflyCaller":
        return NvflyCaller(self, input_nodes, layout, kwargs)


class NvflyCaller(ExternKernelCaller):
    """One nvfly config as an autotuning choice. Compiling starts when it is created; a compile or run error
    becomes a RuntimeError (Inductor drops the choice), never an aborted compile."""

    choice: NvflyExternChoice

    def __init__(self, choice: NvflyExternChoice, input_nodes: Any, layout: Any, kwargs: dict[str, Any]):
        super().__init__(choice, input_nodes, layout, kwargs, has_out_variant=True)
        self.description = f"nvfly {kwargs['config']}"
        self.decision: Optional[Decision] = None
        self._compiled: Optional[concurrent.futures.Future] = None

    def start_compile(self, operands: Sequence[TensorInfo], decision: Decision) -> None:
        global _POOL
        self.decision = decision
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="nvfly-compile")
        self._compiled = _POOL.submit(self._compile, operands)

    def _compile(self, operands: Sequence[TensorInfo]) -> None:
        # stand-ins with the operands' sizes and strides give the exact kernel specialisations of the real call
        tensors = [torch.empty_strided(o.shape, o.strides, dtype=o.dtype, device=o.device) for o in operands]
        if self.choice.op in _PRECOMPILE_OUT:
            layout = self.layout
            out = torch.empty_strided([int(s) for s in layout.size], [int(s) for s in layout.stride],
                                      dtype=layout.dtype, device=layout.device)
            _PRECOMPILE_OUT[self.choice.op](*tensors, out=out, **self.kwargs)
            return
        *c, a, b = tensors
        precompile(a, b, *c, config=self.kwargs["config"])

    def precompile(self) -> None:
        """Wait for the compile (Inductor calls this from its precompile pool; a raise drops the choice)."""
        if self._compiled is not None:
            try:
                self._compiled.result()
            except Exception as exc:
                self._fail("compile", exc)

    def benchmark(self, *args: Any, out: torch.Tensor) -> float:
        """Time the op the compiled graph calls (the dispatcher and nvfly's host path included), as Inductor
        times ATen's, after one strict call (raises when nvfly cannot run these operands; loads the kernel)."""
        self.precompile()
        try:
            _BENCH[self.choice.op](*args, out=out, **self.kwargs)
            elapsed = benchmarker.benchmark(self.choice.op_overload, args, {"out": out, **self.kwargs})
        except Exception as exc:
            self._fail("benchmark", exc)
        # the op falls back to torch instead of raising: then the time would be torch's
        fallback = _BOUND_REASON[self.choice.op](*args, out=out, **self.kwargs)
        if fallback is not None:
            self._fail("benchmark", RuntimeError(fallback))
        return elapsed

    def _fail(self, phase: str, exc: Exception) -> NoReturn:
        reason = f"{self.description} failed to {phase}: {type(exc).__name__}: {exc}"
        if self.decision is not None and reason not in (self.decision.reason or ""):  # once, not per wait
            log.debug("nvfly: %s", reason, exc_info=exc)
            self.decision.reason = "; ".join(filter(None, [self.decision.reason, reason]))
        raise RuntimeError(reason) from exc

    def info_dict(self) -> dict[str, Any]:
        return {"backend": "nvfly", "kernel_call_name": self.choice.call_name(), "config": self.kwargs["config"]}

    def autoheuristic_id(self) -> str:
        return f"nvfly_{self.choice.op}_{self.kwargs['config']}"

"""``nvfly explain``: for one GEMM shape, whether nvfly can run it, what its heuristic runs (``gemm.describe``:
kernel, tile, blocks, epilogue, L2 hints), the candidates Inductor would benchmark, their times (from the autotune
database, or measured now), the winner, and why nvfly was declined or lost.

    print(nvfly.torch.explain(16, 4096, 4096))                 # no GPU needed (then nothing is measured)
    print(nvfly.torch.explain(16, 4096, 4096, benchmark=True))  # times the candidates and torch on the GPU
    $ nvfly explain 16 4096 4096 --benchmark

It also lists what Inductor, eager routing and the nvfly ops decided for that shape in this process.
"""
from __future__ import annotations

import dataclasses
import io
from typing import Any, Optional

import torch

from nvfly.ops import gemm
from nvfly.runtime.driver import sm_count
from nvfly.torch.autotune import Candidate, Entry, TORCH, candidates, database, make_operands, measure
from nvfly.torch.gemm_ops import Decision, TensorInfo, Workload, analyze, decisions


@dataclasses.dataclass
class Explanation:
    """What nvfly does with one GEMM shape (see the module docstring); ``str()`` renders it as a report."""
    workload: Workload
    declined: Optional[str]
    auto: str  # what the heuristic's config ("auto") runs: gemm.describe
    candidates: list[Candidate]
    entry: Optional[Entry]
    measured: Optional[Entry]
    decisions: list[Decision]

    @property
    def times(self) -> Optional[Entry]:
        """The measurement the verdict rests on: this run's, else the database's."""
        return self.measured or self.entry

    def verdict(self) -> str:
        if self.declined:
            return f"nvfly is declined: {self.declined}"
        times = self.times
        if times is not None and times.torch_ms is not None:
            source = "measured now" if self.measured else "autotune database"
            if times.nvfly_faster:
                return (f"nvfly wins ({source}): {times.best} {times.best_ms:.4f} ms vs torch {times.torch_ms:.4f} ms "
                        f"({times.torch_ms / times.best_ms:.2f}x)")
            return (f"nvfly loses ({source}): its best, {times.best}, takes {times.best_ms:.4f} ms, torch "
                    f"{times.torch_ms:.4f} ms ({times.best_ms / times.torch_ms:.2f}x slower)")
        won = [d for d in self.decisions if d.winner]
        if won:
            return f"Inductor picked {won[-1].winner} (no nvfly timing stored for this shape class)"
        return "not measured: pass benchmark=True (--benchmark) on a GPU, or run nvfly.torch.autotune"

    def empty_columns(self) -> list[str]:
        """Why the table's time columns are empty, when they are."""
        notes = []
        if self.entry is None:
            notes.append("database ms is empty: no autotune result is stored for this shape class on this GPU "
                         "(nvfly.torch.autotune, or Inductor max-autotune with nvfly installed, stores them)")
        if self.measured is None:
            notes.append("measured ms is empty: nothing was timed now; --benchmark (benchmark=True) times the "
                         "candidates and torch on a CUDA GPU, for a shape nvfly is eligible for")
        return notes

    def to_dict(self) -> dict[str, Any]:
        w = self.workload
        return {"shape": {"batches": w.batches, "m": w.m, "n": w.n, "k": w.k}, "dtype": str(w.dtype),
                "majors": [w.a_major, w.b_major], "key": w.key(), "declined": self.declined, "auto": self.auto,
                "candidates": [dataclasses.asdict(c) for c in self.candidates],
                "database": dataclasses.asdict(self.entry) if self.entry else None,
                "measured": dataclasses.asdict(self.measured) if self.measured else None,
                "decisions": [dataclasses.asdict(d) for d in self.decisions], "verdict": self.verdict()}

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        buffer = io.StringIO()
        # the table fits 80 columns (long configs fold); lines of text stay whole, for logs and grep
        console = Console(file=buffer, width=80, no_color=True, soft_wrap=True)
        console.print(f"GEMM {self.workload} (shape class {self.workload.key()})")
        console.print(f"eligibility: {self.declined or 'eligible'}")
        console.print(f"auto (the heuristic's plan): {self.auto}")
        table = Table(title="candidates (what Inductor benchmarks beside ATen and Triton)")
        for column in ("config", "source", "database ms", "measured ms"):
            table.add_column(column, overflow="fold")
        rows = [(c.config, c.source) for c in self.candidates] + [(TORCH, "torch (cuBLAS)")]
        for config, source in rows:
            table.add_row(config, source, _ms(self.entry, config), _ms(self.measured, config))
        console.print(table)
        for note in self.empty_columns():
            console.print(note)
        for d in self.decisions:
            outcome = [f"candidates {', '.join(d.candidates)}"] if d.candidates else []
            outcome += [f"winner {d.winner}"] if d.winner else []
            outcome += [d.reason] if d.reason else []
            console.print(f"{d.where} {d.op} {d.problem}: {'; '.join(outcome)}")
            for name, ms in sorted(d.timings_ms.items(), key=lambda item: item[1]):
                console.print(f"    {ms:9.4f} ms  {name}")
        console.print(f"verdict: {self.verdict()}")
        return buffer.getvalue()


def _ms(entry: Optional[Entry], config: str) -> str:
    if entry is None:
        return ""
    ms = entry.torch_ms if config == TORCH else entry.times_ms.get(config)
    return "" if ms is None else f"{ms:.4f}"


def explain(m: int, n: int, k: int, *, batches: int = 1, dtype: torch.dtype = torch.bfloat16,
            majors: tuple[str, str] = ("K", "K"), benchmark: bool = False, device: Optional[int] = None,
            max_candidates: int = 4) -> Explanation:
    """Explain what nvfly does with ``[batches x] m x n x k`` (A: [M, K], B: [K, N], each "K"- or "MN"-major:
    ("K", "K") is x @ W^T of a Linear layer). ``benchmark`` times the candidates and torch now (GPU only)."""
    a_major, b_major = majors
    w = Workload(batches, m, n, k, dtype, dtype, a_major, b_major)
    gpu = torch.cuda.is_available()
    device = (torch.cuda.current_device() if device is None else device) if gpu else 0
    declined = _eligibility(w, device) if gpu else "no CUDA GPU in this process (eligibility not checked)"
    entry = database(device).lookup(w.key()) if gpu else None
    sms = sm_count(device) if gpu else 132
    found = candidates(w, entry, max_candidates, sms)
    measured = None
    if benchmark and not declined:
        a, b = make_operands(w, torch.device("cuda", device))
        measured = measure(w, a, b, [c.config for c in found])
    shape = (batches, m, n, k)
    auto = gemm.describe(m, n, k, batches=batches, dtype=dtype, majors=majors)
    return Explanation(w, declined, auto, found, entry, measured, [d for d in decisions() if d.shape == shape])


def _eligibility(w: Workload, device: int) -> Optional[str]:
    """Why nvfly declines operands of this shape and majors (aligned, densely packed), or None."""
    dev = torch.device("cuda", device)

    def info(rows: int, cols: int, rows_contiguous: bool) -> TensorInfo:
        strides = (1, rows) if rows_contiguous else (cols, 1)
        batch = ((w.batches,), (rows * cols,)) if w.batches > 1 else ((), ())
        return TensorInfo(batch[0] + (rows, cols), batch[1] + strides, w.dtype, dev)

    a = info(w.m, w.k, w.a_major == "MN")
    b = info(w.k, w.n, w.b_major == "K")
    return analyze(a, b)[1]


# ---------------------------------------------------------------------------------------------- attention
@dataclasses.dataclass
class SdpaExplanation:
    """What eager routing does with one ``F.scaled_dot_product_attention`` shape (``explain_sdpa``); ``str()``
    renders it as a report."""
    shape: tuple[int, int, int, int, int, int, int]  # (B, Hq, Hkv, Sq, Skv, Dqk, Dv)
    dtype: torch.dtype
    is_causal: bool
    requires_grad: bool
    kernel: str  # the nvfly kernel the shape would run: "decode" or "prefill"
    declined: Optional[str]
    torch_backend: Optional[str]  # what torch's SDPA picks for it (None: not asked, no GPU)
    plan: str
    measured_ms: dict[str, float]
    decisions: list[Decision]
    # eager routing hands such calls to torch before their signature (the route's skip: launch-bound, where nvfly's
    # host path would cost more than its kernel saves); their decisions are recorded only while routing logs them
    skipped: bool = False
    attn_mask: Optional[str] = None  # a kind of SDPA_MASKS
    dropout_p: float = 0.0

    def verdict(self) -> str:
        if self.declined:
            return f"torch's SDPA runs it: {self.declined}"
        nvfly_ms, torch_ms = self.measured_ms.get("nvfly"), self.measured_ms.get("torch")
        if nvfly_ms and torch_ms:
            faster = "wins" if nvfly_ms < torch_ms else "loses"
            return (f"nvfly's {self.kernel} runs it and {faster} (measured now): {nvfly_ms:.4f} ms vs torch "
                    f"({self.torch_backend}) {torch_ms:.4f} ms, {torch_ms / nvfly_ms:.2f}x")
        return f"nvfly's {self.kernel} runs it (routed); --benchmark (benchmark=True) times it against torch's"

    def to_dict(self) -> dict[str, Any]:
        b, hq, hkv, sq, skv, dqk, dv = self.shape
        return {"shape": {"batch": b, "hq": hq, "hkv": hkv, "sq": sq, "skv": skv, "dqk": dqk, "dv": dv},
                "dtype": str(self.dtype), "is_causal": self.is_causal, "requires_grad": self.requires_grad,
                "attn_mask": self.attn_mask, "dropout_p": self.dropout_p,
                "kernel": self.kernel, "declined": self.declined, "torch_backend": self.torch_backend,
                "plan": self.plan, "measured_ms": self.measured_ms,
                "decisions": [dataclasses.asdict(d) for d in self.decisions], "skipped": self.skipped,
                "verdict": self.verdict()}

    def __str__(self) -> str:
        b, hq, hkv, sq, skv, dqk, dv = self.shape
        lines = [f"SDPA q ({b}, {hq}, {sq}, {dqk}) k ({b}, {hkv}, {skv}, {dqk}) v ({b}, {hkv}, {skv}, {dv}) "
                 f"{self.dtype} is_causal={self.is_causal} requires_grad={self.requires_grad}"
                 + (f" attn_mask={SDPA_MASKS[self.attn_mask][0]}" if self.attn_mask else "")
                 + (f" dropout_p={self.dropout_p}" if self.dropout_p else ""),
                 f"nvfly kernel for this shape: {self.kernel} ({self.plan})",
                 f"torch's SDPA backend: {self.torch_backend or 'not asked (no CUDA GPU in this process)'}",
                 f"eligibility: {self.declined or 'eligible'}"]
        if self.skipped:
            lines.append("eager routing: launch-bound, handed to torch's SDPA before its signature is read (nvfly's "
                         "host path would cost more than its kernel saves; NVFLY_DEBUG=1 decides and logs each "
                         "signature)")
        for name, ms in sorted(self.measured_ms.items(), key=lambda item: item[1]):
            lines.append(f"    {ms:9.4f} ms  {name}")
        for d in self.decisions:
            lines.append(f"{d.where} {d.op} {d.problem}: {d.reason or 'nvfly ' + ', '.join(d.candidates)}")
        lines.append(f"verdict: {self.verdict()}")
        return "\n".join(lines) + "\n"


# explain_sdpa's attn_mask kinds: (what it is, its shape from (B, Sq, Skv), boolean)
SDPA_MASKS = {"padding": ("a (B, 1, 1, Skv) boolean padding mask", lambda b, sq, skv: (b, 1, 1, skv), True),
              "bool": ("a (B, 1, Sq, Skv) boolean mask", lambda b, sq, skv: (b, 1, sq, skv), True),
              "additive": ("a (B, 1, Sq, Skv) additive mask of q's dtype", lambda b, sq, skv: (b, 1, sq, skv), False)}


def explain_sdpa(batch: int, hq: int, hkv: int, sq: int, skv: int, dqk: int, dv: Optional[int] = None, *,
                 is_causal: bool = False, dtype: torch.dtype = torch.bfloat16, requires_grad: bool = False,
                 attn_mask: Optional[str] = None, dropout_p: float = 0.0, benchmark: bool = False,
                 device: Optional[int] = None) -> SdpaExplanation:
    """Explain what ``nvfly.torch.routing()`` does with ``F.scaled_dot_product_attention(q, k, v, attn_mask,
    dropout_p, is_causal=is_causal, enable_gqa=hq != hkv)`` on q (B, Hq, Sq, Dqk), k (B, Hkv, Skv, Dqk), v (B, Hkv,
    Skv, Dv), ``attn_mask`` one of ``SDPA_MASKS`` (its values do not change the decision) or None: which nvfly
    kernel, whether it is eligible and why not, what torch picks; ``benchmark`` times torch's SDPA and the routed
    call now (GPU only). Without a GPU, eligibility is not checked beyond the arguments (as for GEMMs)."""
    if attn_mask is not None and attn_mask not in SDPA_MASKS:
        raise ValueError(f"explain_sdpa: attn_mask: expected one of {', '.join(SDPA_MASKS)} or None, got "
                         f"{attn_mask!r}")
    from nvfly.ops.attention.plan import MAX_SQ
    from nvfly.ops.attention.prefill_plan import HEAD_DIMS, prefill_plan
    from nvfly.torch import attention_ops
    dv = dqk if dv is None else dv
    shape = (batch, hq, hkv, sq, skv, dqk, dv)
    kernel = "decode" if sq <= MAX_SQ else "prefill"
    if kernel == "prefill":
        plan = repr(prefill_plan(dqk, dv, is_causal)) if (dqk, dv) in HEAD_DIMS else "no plan for these head dims"
    else:
        plan = "split-KV decode, GQA packed (nvfly.ops.attention.decode_plan)"
    declined = attention_ops.sdpa_argument_reason(dropout_p)
    if declined is None and not torch.cuda.is_available():
        declined = "no CUDA GPU in this process (eligibility not checked)"
    backend, measured = None, {}
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        q, k, v = (torch.randn(batch, h, s, d, device=dev, dtype=dtype, requires_grad=requires_grad)
                   for h, s, d in ((hq, sq, dqk), (hkv, skv, dqk), (hkv, skv, dv)))
        mask = None
        if attn_mask is not None:
            _, mask_shape, boolean = SDPA_MASKS[attn_mask]
            mask = (torch.ones(mask_shape(batch, sq, skv), device=dev, dtype=torch.bool) if boolean
                    else torch.zeros(mask_shape(batch, sq, skv), device=dev, dtype=dtype))
        gqa = hq != hkv
        backend = attention_ops._torch_backend(q, k, v, gqa, is_causal, mask)
        if declined is None:
            declined = attention_ops._sdpa_reason(q, k, v, is_causal, gqa, requires_grad and torch.is_grad_enabled(),
                                                  mask=mask)
        if benchmark:
            measured = _time_sdpa(q, k, v, is_causal, gqa, routed=declined is None, mask=mask, dropout_p=dropout_p)
    found = [d for d in decisions() if d.op == "sdpa" and d.shape == shape]
    meta = [torch.empty(batch, h, s, d, device="meta", dtype=dtype) for h, s, d in ((hq, sq, dqk), (hkv, skv, dqk),
                                                                                    (hkv, skv, dv))]
    skipped = attention_ops.sdpa_skip(*meta, is_causal=is_causal, enable_gqa=hq != hkv)
    return SdpaExplanation(shape, dtype, is_causal, requires_grad, kernel, declined, backend, plan, measured, found,
                           skipped, attn_mask, dropout_p)


def _time_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, gqa: bool,
               routed: bool, mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0) -> dict[str, float]:
    """Median ms of torch's SDPA and (when routed) of the routed call, forward only (with backward when the
    inputs require grad)."""
    import statistics

    from nvfly.torch import routing

    def call() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal=is_causal,
                                                               enable_gqa=gqa)
        if out.requires_grad:
            out.backward(torch.ones_like(out))

    def median_ms(fn: Any) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    measured = {"torch": median_ms(call)}
    if routed:
        with routing.routing():  # one block around the timing: its start registers the routes (host time)
            measured["nvfly"] = median_ms(call)
    return measured


# ---------------------------------------------------------------------------------------------- flex_attention
def _softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return 50.0 * torch.tanh(score / 50.0)


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def _window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 4096)


# explain_flex's mods: name -> (what it is, "score" or "mask", the function)
FLEX_MODS = {"softcap": ("tanh soft-capping at 50 (score_mod)", "score", _softcap),
             "causal": ("causal, top-left (mask_mod in a BlockMask)", "mask", _causal),
             "window": ("causal 4096-key sliding window, Gemma-2's (mask_mod in a BlockMask)", "mask", _window)}


@dataclasses.dataclass
class FlexExplanation:
    """What nvfly does with one ``flex_attention`` call shape (``explain_flex``); ``str()`` renders it."""
    shape: tuple[int, int, int, int, int, int, int]  # (B, Hq, Hkv, Sq, Skv, Dqk, Dv)
    dtype: torch.dtype
    mods: tuple[str, ...]
    declined: Optional[str]  # why neither eager routing nor the compiled backend runs it (one rule decides both)
    kernel: str  # the nvfly kernel eager routing and the compiled backend run ("decode" or "prefill": one rule)
    auto_declined: Optional[str]  # why install()'s auto rule leaves an eligible call to Inductor
    decisions: list[Decision]

    def to_dict(self) -> dict[str, Any]:
        b, hq, hkv, sq, skv, dqk, dv = self.shape
        return {"shape": {"batch": b, "hq": hq, "hkv": hkv, "sq": sq, "skv": skv, "dqk": dqk, "dv": dv},
                "dtype": str(self.dtype), "mods": list(self.mods),
                "eager": {"kernel": self.kernel, "declined": self.declined},
                "compiled": {"kernel": self.kernel, "declined": self.declined,
                             "auto_declined": self.auto_declined},
                "decisions": [dataclasses.asdict(d) for d in self.decisions]}

    def __str__(self) -> str:
        b, hq, hkv, sq, skv, dqk, dv = self.shape
        mods = ", ".join(FLEX_MODS[m][0] for m in self.mods) or "no score_mod, no mask"
        lines = [f"flex_attention q ({b}, {hq}, {sq}, {dqk}) k ({b}, {hkv}, {skv}, {dqk}) v ({b}, {hkv}, {skv}, {dv}) "
                 f"{self.dtype}: {mods}"]
        traced = ", the mods traced into it" if self.mods else ""
        if self.declined:
            lines.append(f"eager, under nvfly.torch.routing(): torch's flex_attention runs it: {self.declined}")
        else:
            lines.append(f"eager, under nvfly.torch.routing(): nvfly's {self.kernel}{traced} (torch's eager "
                         "flex_attention computes the whole score matrix)")
        compiled = "torch.compile, after nvfly.torch.install():"
        generated = " (the mods' Inductor subgraphs generated into it)" if self.mods else ""
        if self.declined:
            lines.append(f"{compiled} Inductor's flex kernel runs it: {self.declined}")
        elif self.auto_declined:
            lines.append(f"{compiled} Inductor's flex kernel by default ({self.auto_declined}); "
                         f"kernel_options={{'NVFLY': True}} runs nvfly's {self.kernel}{generated}")
        else:
            lines.append(f"{compiled} nvfly's {self.kernel}{generated}, picked by the auto rule; "
                         "kernel_options={'NVFLY': False} keeps Inductor's flex kernel")
        for d in self.decisions:
            lines.append(f"{d.where} {d.op} {d.problem}: {d.reason or 'nvfly ' + ', '.join(d.candidates)}")
        return "\n".join(lines) + "\n"


def explain_flex(batch: int, hq: int, hkv: int, sq: int, skv: int, dqk: int, dv: Optional[int] = None, *,
                 mods: tuple[str, ...] = (), dtype: torch.dtype = torch.bfloat16) -> FlexExplanation:
    """Explain what nvfly does with ``flex_attention(q, k, v, score_mod, block_mask, enable_gqa=hq != hkv)`` on q
    (B, Hq, Sq, Dqk), k (B, Hkv, Skv, Dqk), v (B, Hkv, Skv, Dv) with ``mods`` (names of ``FLEX_MODS``: at most one
    score_mod and one mask): under eager routing and as the compiled backend (per call and by ``install()``'s auto
    rule), deciding on meta tensors (no GPU needed) with the mods traced to aten graphs, as Inductor hands them over.
    The decisions recorded in this process for flex_attention calls of the shape follow."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention.flex_attention import create_block_mask

    from nvfly.torch import flex_compile, flex_ops
    unknown = [m for m in mods if m not in FLEX_MODS]
    if unknown:
        raise ValueError(f"explain_flex: mods: expected names of {', '.join(FLEX_MODS)}, got {unknown}")
    kinds = [FLEX_MODS[m][1] for m in mods]
    if kinds.count("score") > 1 or kinds.count("mask") > 1:
        raise ValueError(f"explain_flex: mods: at most one score_mod and one mask, got {list(mods)}")
    dv = dqk if dv is None else dv
    ints = [torch.zeros((), dtype=torch.int32) for _ in range(4)]  # distinct, so that the trace tells them apart
    score_fn = next((FLEX_MODS[m][2] for m in mods if FLEX_MODS[m][1] == "score"), None)
    mask_fn = next((FLEX_MODS[m][2] for m in mods if FLEX_MODS[m][1] == "mask"), None)
    score_gm = None if score_fn is None else make_fx(score_fn)(torch.zeros(()), *ints)
    block_mask = None
    if mask_fn is not None:
        block_mask = create_block_mask(mask_fn, None, None, sq, skv, device="meta")
        block_mask.mask_mod = make_fx(mask_fn)(*ints)
    q, k, v = (torch.empty(batch, s, h, d, device="meta", dtype=dtype)
               for h, s, d in ((hq, sq, dqk), (hkv, skv, dqk), (hkv, skv, dv)))
    call = flex_ops.FlexCall(q, k, v, score_gm, None if block_mask is None else block_mask.mask_mod, block_mask,
                             1.0 / dqk ** 0.5, (), (), False)
    declined = flex_ops.reason_on_meta(call)
    kernel = flex_compile.kernel_path(call).split("_")[0]  # "decode_shifted" is the decode kernel
    auto = None if declined else flex_compile.auto_reason(sq, kernel)
    shape = (batch, hq, hkv, sq, skv, dqk, dv)
    found = [d for d in decisions() if d.op == "flex_attention" and d.shape in (shape, (batch, hq, sq, dqk))]
    return FlexExplanation(shape, dtype, tuple(mods), declined, kernel, auto, found)

"""The benchmark convention every suite follows: correctness first, then nvfly and its peers timed in the same
process, results written to ``benchmarks/results/<suite>_h200.json`` (meta + rows) with a PNG plot."""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence, TypeVar

import torch
from rich.progress import track

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


T = TypeVar("T")


def progress(cases: Sequence[T], suite: str) -> Iterable[T]:
    """The suite's cases with a progress bar on a terminal (the rows the suite prints scroll above it)."""
    return track(cases, description=suite, transient=True)


def meta(command: Optional[str] = None) -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=False).stdout.strip() or None
    except OSError:
        commit = None
    import nvfly
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "triton": triton_version, "nvfly": nvfly.__version__,
            "nvfly_commit": os.environ.get("NVFLY_COMMIT") or commit,
            "command": command or " ".join([os.path.basename(sys.executable)] + sys.argv)}


def bench_ms(fn: Callable[[], Any], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call (CUDA events, L2 flushed between calls by do_bench)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def interleaved_ms(fns: dict[str, Callable[[], Any]], rounds: int, warmup_ms: float = 25, rep_ms: float = 100,
                   around: Optional[dict[str, Callable[[], ContextManager[Any]]]] = None) -> dict[str, list[float]]:
    """``bench_ms`` of each of ``fns`` in turn, ``rounds`` times over: what drifts during a run (clocks, the host,
    another process) lands on every function alike, and the spread of the rounds shows the noise. ``around``: a
    context (e.g. ``nvfly.torch.routing``) entered around a function's ``bench_ms`` in each round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    around = around or {}
    for _ in range(rounds):
        for name, fn in fns.items():
            with around.get(name, contextlib.nullcontext)():
                times[name].append(bench_ms(fn, warmup_ms, rep_ms))
    return times


def captured_graph(fn: Callable[[], Any], calls: int) -> Optional[torch.cuda.CUDAGraph]:
    """One CUDA graph of ``calls`` back-to-back calls of ``fn`` (after three uncaptured warm-up calls: compiled, and
    any per-stream workspace made), replayed once; None when ``fn`` cannot be captured (what failed is printed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    except RuntimeError as e:
        print(f"graph_ms: capture failed: {e}")
        return None
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    """Milliseconds per call of one replay of ``graph`` (of ``calls`` calls)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def graph_ms(fn: Callable[[], Any], calls: int = 32, replays: int = 20) -> Optional[float]:
    """Milliseconds per call of ``fn`` replayed from one CUDA graph of ``calls`` back-to-back calls: no launch or
    event overhead per call and a warm L2, as ops run under torch.compile's CUDA graphs ("reduce-overhead"); the
    median over ``replays``. None when ``fn`` cannot be captured (what failed is printed)."""
    graph = captured_graph(fn, calls)
    return None if graph is None else statistics.median(replay_ms(graph, calls) for _ in range(replays))


def interleaved_graph_ms(fns: dict[str, Callable[[], Any]], calls: int = 8, replays: int = 30,
                         around: Optional[dict[str, Callable[[], ContextManager[Any]]]] = None
                         ) -> dict[str, Optional[float]]:
    """``graph_ms`` of each of ``fns`` (captured inside its ``around`` context, e.g. ``nvfly.torch.routing``), their
    replays taken in turn: drift during the run (clocks, power) lands on every graph alike; None where a capture
    failed."""
    around = around or {}
    graphs = {}
    for name, fn in fns.items():
        with around.get(name, contextlib.nullcontext)():
            graphs[name] = captured_graph(fn, calls)
    times: dict[str, list[float]] = {name: [] for name, graph in graphs.items() if graph is not None}
    for _ in range(replays):
        for name in times:
            times[name].append(replay_ms(graphs[name], calls))
    return {name: statistics.median(times[name]) if name in times else None for name in fns}


def time_impls(row: dict[str, Any], impls: dict[str, Callable[[], Any]], flop: float, nbytes: float) -> None:
    """Each implementation's median time into ``row`` (``<name>_ms``), with its TFLOP/s of ``flop`` and TB/s of
    ``nbytes`` (``<name>_tflops``, ``<name>_tbps``)."""
    for name, fn in impls.items():
        ms = bench_ms(fn)
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flop / ms / 1e9
        row[f"{name}_tbps"] = nbytes / ms / 1e9


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf if anything is NaN."""
    o, r = out.double(), ref.double()
    if torch.isnan(o).any():
        return math.inf
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def geomean(values: Sequence[float]) -> float:
    vals = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def write_results(suite: str, rows: list[dict[str, Any]], extra_meta: Optional[dict[str, Any]] = None,
                  out_dir: Optional[str] = None) -> str:
    out_dir = out_dir or os.environ.get("NVFLY_RESULTS_DIR") or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{suite}_h200.json")
    doc = {"meta": {**meta(), **(extra_meta or {})}, "rows": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def plot(suite: str, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str,
         out_dir: Optional[str] = None) -> str:
    """A grouped bar chart, one group per row label, one bar per series."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir = out_dir or os.environ.get("NVFLY_RESULTS_DIR") or RESULTS
    path = os.path.join(out_dir, f"{suite}_h200.png")
    n = len(series)
    width = 0.8 / max(1, n)
    # at most 40 inches wide: a whole-suite run (hundreds of rows) stays a readable, small file
    fig, ax = plt.subplots(figsize=(min(40, max(6, 0.6 * len(labels) * n)), 4.5))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (n - 1) / 2 for x in range(len(labels))])
    many = len(labels) > 100
    ax.set_xticklabels(labels, rotation=90 if many else 45, ha="right", fontsize=3 if many else 7)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{suite} on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

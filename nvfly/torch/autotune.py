"""nvfly's GEMM autotuner and its database, the candidate configs offered to Inductor, and the eager GEMM routes.

    nvfly.torch.autotune([(4096, 14336, 4096), (16, 4096, 4096)])   # on the GPU; a progress bar shows
    nvfly.torch.database().lookup(workload.key())                     # best config, its time, torch's time

The database is one JSON file per card name and nvfly version under the nvfly cache folder
(``<cache_dir>/autotune/gemm-<card>-nvfly-<version>.json``). It maps a workload's shape class
(``Workload.key()``: dtypes, power-of-two buckets of B, M, N, K, operand majors) to the best config string, the
time of every config tried and torch's time for the same shape; it is rewritten atomically under a file lock,
merging what other processes wrote. Inductor's candidates are the heuristic's ("auto") plus the database's best
plus a few variants of the heuristic's config; eager routing sends a GEMM to nvfly only where the database says
nvfly is faster than torch.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import fcntl
import functools
import json
import logging
import math
import os
import re
import statistics
import tempfile
import threading
from dataclasses import replace
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import Tensor

from nvfly import settings
from nvfly.ops import gemm
from nvfly.ops.common.opcall import OpCalls
from nvfly.ops.gemm import GemmConfig, api, plan
from nvfly.runtime.driver import sm_count
from nvfly.torch import routing
from nvfly.torch.routing import tensor_key
from nvfly.torch.gemm_ops import AUTO, Decision, Workload, analyze, bind_config, encode_config, nvfly_gemm, \
    precompile, record
from nvfly.version import __version__

log = logging.getLogger("nvfly")

TORCH = "torch"  # the name of torch's own kernel in an entry's times


# ---------------------------------------------------------------------------------------------- database
@dataclasses.dataclass(frozen=True)
class Entry:
    """The autotuning result of one shape class: the best nvfly config, every config's median time (ms), torch's
    time, and the shape (batches, m, n, k) that was measured."""
    key: str
    shape: tuple[int, int, int, int]
    best: str
    times_ms: dict[str, float]
    torch_ms: Optional[float]
    date: str

    @property
    def best_ms(self) -> float:
        return self.times_ms[self.best]

    @property
    def nvfly_faster(self) -> bool:
        return self.torch_ms is not None and self.best_ms < self.torch_ms

    def ranked(self) -> list[str]:
        """The configs tried, fastest first."""
        return sorted(self.times_ms, key=self.times_ms.__getitem__)


class Database:
    """The autotune database of one card (see the module docstring); thread-safe, shared between processes."""

    def __init__(self, path: str, card: str):
        self.path = path
        self.card = card
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = self._read()

    def __repr__(self) -> str:
        return f"<nvfly autotune database {self.path} ({len(self._entries)} entries)>"

    def lookup(self, key: str) -> Optional[Entry]:
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def update(self, entries: Iterable[Entry]) -> None:
        """Add or replace entries, here and on disk (merged with the file's current contents)."""
        new = {e.key: e for e in entries}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with self._lock, open(self.path + ".lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # other processes merge their entries in turn
            merged = {**self._read(), **new}
            doc = {"card": self.card, "nvfly": __version__,
                   "entries": {k: dataclasses.asdict(e) for k, e in sorted(merged.items())}}
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".autotune-")
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp, self.path)  # readers see the old file or the new one, never a partial one
            self._entries = merged
        _forget_eager_decisions()

    def _read(self) -> dict[str, Entry]:
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("nvfly: ignoring the unreadable autotune database %s: %s", self.path, exc)
            return {}
        return {k: Entry(**{**e, "shape": tuple(e["shape"])}) for k, e in doc.get("entries", {}).items()}


def database_path(card: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", card).strip("_") or "unknown"
    return os.path.join(settings.get("cache_dir"), "autotune", f"gemm-{slug}-nvfly-{__version__}.json")


@functools.lru_cache(maxsize=None)
def _database(path: str, card: str) -> Database:
    return Database(path, card)


def database(device: Optional[int] = None) -> Database:
    """The database of a CUDA device's card (the current device by default)."""
    card = torch.cuda.get_device_name(device)
    return _database(database_path(card), card)


# ---------------------------------------------------------------------------------------------- candidates
@dataclasses.dataclass(frozen=True)
class Candidate:
    config: str
    source: str  # "heuristic", "database" or "variant"


def _small_m(w: Workload) -> bool:
    # where nvfly's host swaps A and B on its own: small M becomes wgmma's N
    return w.m <= 64 < w.n


def _variants(w: Workload, sms: int) -> list[str]:
    """Configs near the heuristic's choice: other large tiles (or, for small M, other splits of K), which the
    heuristic's cost model ranks close."""
    if _small_m(w):
        base = plan.small_m_config(w.m, w.n, w.k, w.batches, w.itemsize, sms)
        splits = sorted({max(1, base.split_k // 2), base.split_k * 2} - {base.split_k})  # base itself is "auto"
        options = [replace(base, split_k=s) for s in splits]
        options.append(replace(base, bm=128, consumers=2) if base.bm == 64 else replace(base, bm=64, consumers=1))
        # the other tile height at the deepest ring that fits (128 rows hold fewer stages than 64)
        options = [plan.deepest_ring(c, w.itemsize, most=c.stages) for c in options]
        return [encode_config(c, swap=True) for c in options if c is not None]
    base = plan.default_config(w.m, w.n, w.k, w.batches, w.itemsize, sms)
    whole = base.split_k == 1  # ping-pong, the TMA-store epilogue and clusters need whole tiles
    # the heuristic's other large tiles as they are tuned (ping-pong or not, their epilogue), then 128x256 with
    # a 2-block cluster multicasting B (cuBLAS runs 2-block clusters on these shapes on the H200)
    tiles = [cfg for cfg, _ in plan.TILES[:3] if (cfg.bm, cfg.bn) != (base.bm, base.bn)]
    options = [replace(t, split_k=base.split_k, group_m=base.group_m, pingpong=t.pingpong and whole,
                       tma_store=t.tma_store and whole) for t in tiles]
    if whole:
        options.append(GemmConfig(128, 256, 4, 2, group_m=base.group_m, cluster_m=2, tma_store=True))
    options.append(replace(base, group_m=16 if base.group_m == 8 else 8))
    # each at the deepest ring of at most 7 stages that fits
    return [encode_config(c) for c in (plan.deepest_ring(c, w.itemsize, most=7) for c in options) if c is not None]


def candidates(w: Workload, entry: Optional[Entry] = None, limit: Optional[int] = 4,
               sms: int = 132) -> list[Candidate]:
    """A few configs worth benchmarking for a workload (not the whole space): nvfly's heuristic, the database's
    two fastest for its shape class, then variants of the heuristic's config; at most ``limit``."""
    found = [Candidate(AUTO, "heuristic")]
    if entry is not None:
        found += [Candidate(c, "database") for c in entry.ranked()[:2]]
    found += [Candidate(c, "variant") for c in _variants(w, sms)]
    unique: dict[str, Candidate] = {}
    for c in found:
        unique.setdefault(c.config, c)
    return list(unique.values())[:limit]


def search_space(w: Workload, space: str = "pruned", sms: int = 132) -> list[str]:
    """The configs the autotuner times for a workload: the candidates plus, from ``gemm.config_space``, every
    config ("full") or the deepest ring of every other kind of config ("pruned"); for small M on the swapped
    problem, with a tile that spans M."""
    if space not in ("pruned", "full"):
        raise ValueError(f"space: expected 'pruned' or 'full', got {space!r}")
    pool = gemm.config_space(w.dtype)
    if space == "pruned":
        deepest: dict[GemmConfig, GemmConfig] = {}
        for cfg in pool:
            kind = replace(cfg, stages=0)  # the config but its ring depth
            if cfg.group_m == 8 and (kind not in deepest or cfg.stages > deepest[kind].stages):
                deepest[kind] = cfg
        pool = list(deepest.values())
    if _small_m(w):
        span = plan.small_m_config(w.m, w.n, w.k, w.batches, w.itemsize, sms).bn
        extra = [encode_config(c, swap=True) for c in pool if c.bn == span]
    else:
        extra = [encode_config(c) for c in pool]
    return list(dict.fromkeys([c.config for c in candidates(w, None, None, sms)] + extra))


# ---------------------------------------------------------------------------------------------- autotuner
def _matrix(batches: int, rows: int, cols: int, dtype: torch.dtype, last_contiguous: bool,
            device: torch.device) -> Tensor:
    """A [(batches,) rows, cols] random matrix whose last dimension is contiguous, or whose rows are."""
    return api.dense_operand(batches, rows, cols, last_contiguous,
                             lambda shape: torch.randn(shape, device=device).to(dtype))


def make_operands(w: Workload, device: torch.device) -> tuple[Tensor, Tensor]:
    """Random A [(B,) M, K] and B [(B,) K, N] with the workload's majors."""
    return (_matrix(w.batches, w.m, w.k, w.dtype, w.a_major == "K", device),
            _matrix(w.batches, w.k, w.n, w.dtype, w.b_major == "MN", device))


class _Timer:
    """Median GPU time of a callable with CUDA events, L2 flushed before each timed call."""

    def __init__(self, device: torch.device, target_ms: float):
        self.flush = torch.empty(64 << 20, dtype=torch.int32, device=device)  # 256 MB, larger than L2
        self.target_ms = target_ms

    def __call__(self, fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        times = [self._once(fn) for _ in range(3)]
        for _ in range(int(min(100, max(0, self.target_ms / max(min(times), 1e-3) - 3)))):
            times.append(self._once(fn))
        return statistics.median(times)

    def _once(self, fn: Any) -> float:
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def autotune(shapes: Iterable[Sequence[int]], *, dtype: torch.dtype = torch.bfloat16,
             majors: Sequence[tuple[str, str]] = (("K", "K"),), space: str = "pruned",
             device: Optional[int] = None, db: Optional[Database] = None, progress: bool = True,
             target_ms: float = 50.0) -> list[Entry]:
    """Time nvfly configs and torch for each shape ((m, n, k) or (batches, m, n, k)) and operand majors
    (("K" or "MN" for A, same for B)), keep the winners in the database and return the new entries.

    Candidates are compiled in parallel first; configs that fail to compile or run are dropped."""
    from rich.progress import Progress

    device = torch.cuda.current_device() if device is None else device
    dev = torch.device("cuda", device)
    db = db or database(device)
    sms = sm_count(device)
    timer = _Timer(dev, target_ms)
    entries = []
    jobs = [((1, *s) if len(s) == 3 else tuple(s), m) for s in shapes for m in majors]
    with Progress(disable=not progress, transient=False) as bar:
        task = bar.add_task("nvfly autotune", total=len(jobs))
        for (batches, m, n, k), (a_major, b_major) in jobs:
            a, b = make_operands(Workload(batches, m, n, k, dtype, dtype, a_major, b_major), dev)
            w, reason = analyze(a, b)
            if w is None:
                record(Decision.of("autotune", "mm", a, b, reason=reason))
                bar.advance(task)
                continue
            bar.update(task, description=f"nvfly autotune {w}")
            try:
                entries.append(measure(w, a, b, search_space(w, space, sms), timer))
            except RuntimeError as exc:  # every config failed: nothing to store for this shape
                record(Decision.of("autotune", "mm", a, b, reason=str(exc)))
            bar.advance(task)
    db.update(entries)
    return entries


def measure(w: Workload, a: Tensor, b: Tensor, configs: Sequence[str], timer: Optional[_Timer] = None) -> Entry:
    """Compile ``configs`` for ``a @ b`` in parallel, then time each one and torch (an entry not yet stored);
    configs that fail to compile or run are left out."""
    timer = timer or _Timer(a.device, 50.0)
    out = torch.empty((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(configs))) as pool:
        compiled = dict(zip(configs, pool.map(lambda c: _try(precompile, a, b, config=c), configs)))
    times: dict[str, float] = {}

    def time_config(config: str) -> None:
        times[config] = timer(lambda: nvfly_gemm(a, b, out=out, config=config))

    for config, error in compiled.items():
        error = error or _try(time_config, config)
        if error:
            log.debug("nvfly: autotune %s: dropped %s: %s", w, config, error)
    with routing.routing(False):
        torch_ms = timer(lambda: torch.matmul(a, b, out=out))
    if not times:
        raise RuntimeError(f"nvfly autotune {w}: every config failed to compile or run")
    best = min(times, key=times.__getitem__)
    return Entry(w.key(), (w.batches, w.m, w.n, w.k), best, times, torch_ms,
                 datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _try(fn: Any, *args: Any, **kwargs: Any) -> Optional[str]:
    """None if ``fn`` ran, else the error it raised, as text."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------------------------------- eager routes
_EAGER: OpCalls[tuple[Optional[str], str]] = OpCalls()  # operand signature -> (why torch runs it, nvfly config)
_EAGER_CALLS: OpCalls[Any] = OpCalls()  # operand signature -> gemm.bind's launches of the decided config


# (batched or not, routing_min_gain_us) -> whether a database has an entry of that kind where nvfly wins by as much
_WINS: dict[tuple[bool, float], bool] = {}


def _forget_eager_decisions() -> None:
    """Drop the eager decisions (the routes' too) and, with them, the launches bound for their configs (never one
    without the other: a call bound for a config the database no longer picks would keep running it)."""
    _EAGER.clear()
    _EAGER_CALLS.clear()
    _WINS.clear()
    routing.forget_decisions()


def _nvfly_wins_somewhere(batched: bool) -> bool:
    """Whether the database of a visible card has an entry where nvfly beats torch, by routing_min_gain_us at least
    (not batched: one of a single matrix, what mm and addmm look up; batched: any, a bmm of one matrix looks up the
    former): without one every eager GEMM of that kind declines ("no autotune entry", "torch is faster", the gain
    too small), so its routes are not
    registered and GEMM calls cost what they cost without nvfly. Forgotten with the decisions (a database update).
    False before CUDA is initialized (reading the card names would initialize it; no CUDA GEMM can run before)."""
    if not torch.cuda.is_initialized():
        return False
    floor = settings.get("routing_min_gain_us")
    wins = _WINS.get((batched, floor))
    if wins is None:
        wins = _WINS[batched, floor] = any(_gains_enough(entry, floor) and (batched or entry.shape[0] == 1)
                                           for device in range(torch.cuda.device_count())
                                           for entry in database(device).entries())
    return wins


def _eager_key(a: Tensor, b: Tensor, c: Optional[Tensor], out: Optional[Tensor], beta: Any, alpha: Any) -> tuple:
    """What decides an eager GEMM: the operands' layouts (``routing.tensor_key``), the scalars' types and whether
    they are 0 and 1; the autotune database besides (a change forgets every decision)."""
    return (tensor_key(a), tensor_key(b), c is not None and tensor_key(c), out is not None and tensor_key(out),
            type(beta), type(alpha), beta != 0, alpha != 1)


def _eager(op: str, a: Tensor, b: Tensor, c: Optional[Tensor] = None, out: Optional[Tensor] = None,
           beta: Any = 1, alpha: Any = 1, key: Optional[tuple] = None) -> tuple[Optional[str], str]:
    """(None, config) when the database says nvfly beats torch on these operands (by routing_min_gain_us), else
    (why not, "")."""
    key = (key or _eager_key(a, b, c, out, beta, alpha), settings.get("routing_min_gain_us"))  # routes' misses only
    hit = _EAGER.get(key)
    if hit is None:
        config = ""
        w, reason = analyze(a, b, c)
        if w is not None:
            expected = (*a.shape[:-1], b.shape[-1])
            if isinstance(beta, complex) or isinstance(alpha, complex):
                reason = "complex alpha or beta"
            elif out is not None and (tuple(out.shape) != expected or out.dtype != a.dtype):
                reason = f"out= is a {out.dtype} tensor of shape {tuple(out.shape)} (torch resizes or casts it)"
            else:
                reason, config = _expected_faster(w, a.device.index)
        record(Decision.of("eager", op, a, b, reason=reason, candidates=(config,) if config else ()))
        hit = (reason, config)
        _EAGER.remember(key, hit)
    return hit


def _expected_faster(w: Workload, device: int) -> tuple[Optional[str], str]:
    entry = database(device).lookup(w.key())
    if entry is None:
        return f"no autotune entry for {w.key()} (run nvfly.torch.autotune on this shape)", ""
    if not entry.nvfly_faster:
        return (f"torch is faster for {w.key()}: {entry.torch_ms:.4f} ms vs nvfly {entry.best_ms:.4f} ms "
                f"({entry.best})"), ""
    floor = settings.get("routing_min_gain_us")
    if not _gains_enough(entry, floor):
        return (f"nvfly's gain for {w.key()}, {(entry.torch_ms - entry.best_ms) * 1e3:.1f} us a call "
                f"({entry.best_ms:.4f} vs torch {entry.torch_ms:.4f} ms), is under "
                f"NVFLY_ROUTING_MIN_GAIN_US={floor:g}: routing's host path would cost more than the kernel saves"), ""
    return None, entry.best


def _gains_enough(entry: Entry, floor_us: float) -> bool:
    """Whether nvfly beats torch on ``entry`` by at least ``floor_us`` a call (the routing_min_gain_us setting)."""
    return entry.nvfly_faster and (entry.torch_ms - entry.best_ms) * 1e3 >= floor_us


def _route(op: str, with_c: bool) -> tuple[Any, Any, Any, Any]:
    """(eligibility, run, signature, bind) of an aten GEMM overload; with_c: its first argument is the added
    matrix."""
    def split(args: tuple, kwargs: dict) -> tuple:
        c, a, b = args[:3] if with_c else (None, *args[:2])
        return c, a, b, kwargs.get("out"), kwargs.get("beta", 1), kwargs.get("alpha", 1)

    def eligibility(*args: Any, **kwargs: Any) -> Optional[str]:
        c, a, b, out, beta, alpha = split(args, kwargs)
        return _eager(op, a, b, c, out, beta, alpha)[0]

    # the route's signature, without split's frame (beta, alpha and out are keyword-only in every schema)
    if with_c:
        def signature(c: Tensor, a: Tensor, b: Tensor, *, beta: Any = 1, alpha: Any = 1,
                      out: Optional[Tensor] = None) -> tuple:
            return _eager_key(a, b, c, out, beta, alpha)
    else:
        def signature(a: Tensor, b: Tensor, *, out: Optional[Tensor] = None) -> tuple:  # type: ignore[misc]
            return _eager_key(a, b, None, out, 1, 1)

    def bind(*args: Any, **kwargs: Any) -> Any:
        """The runner of an accepted signature: its launches bound once (``_EAGER_CALLS``), the output's shape,
        strides, dtype and device read once (the signature holds them); a call reads addresses and alpha, beta."""
        c, a, b, out, beta, alpha = split(args, kwargs)
        key = _eager_key(a, b, c, out, beta, alpha)
        call = _EAGER_CALLS.get(key)
        if call is None:
            config = _eager(op, a, b, c, out, beta, alpha, key)[1]
            call = bind_config(a, b, c if beta != 0 else None, alpha=float(alpha), out=out, config=config)
            _EAGER_CALLS.remember(key, call)
        launch, shape, dtype, device = call.run, tuple(call.shape), call.out_dtype, a.device
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # row-major, as torch.empty's
        empty = torch.empty_strided  # a third cheaper than torch.empty(shape, dtype=, device=) on the host
        if with_c:
            uses_c = beta != 0  # in the signature

            def runs(c: Tensor, a: Tensor, b: Tensor, *, beta: Any = 1, alpha: Any = 1,
                     out: Optional[Tensor] = None) -> Tensor:
                result = empty(shape, strides, dtype=dtype, device=device) if out is None else out
                launch(a, b, c if uses_c else None, result, float(alpha), float(beta))
                return result
        else:
            def runs(a: Tensor, b: Tensor, *, out: Optional[Tensor] = None) -> Tensor:  # type: ignore[misc]
                result = empty(shape, strides, dtype=dtype, device=device) if out is None else out
                launch(a, b, None, result, 1.0, 1.0)
                return result
        return runs

    def run(*args: Any, **kwargs: Any) -> Tensor:
        return bind(*args, **kwargs)(*args, **kwargs)

    return eligibility, run, signature, bind


def register_routes() -> None:
    """Register (again) the GEMM routes with nvfly.torch.routing: mm, bmm, addmm, baddbmm and their out= forms,
    wanted while a database has an entry they may look up where nvfly wins (``_nvfly_wins_somewhere``)."""
    for op, with_c in (("mm", False), ("bmm", False), ("addmm", True), ("baddbmm", True)):
        batched = op in ("bmm", "baddbmm")
        for overload in (op, f"{op}.out"):
            eligibility, run, signature, bind = _route(op, with_c)
            routing.register_route(f"aten::{overload}", eligibility, run, signature=signature, bind=bind,
                                   wanted=lambda batched=batched: _nvfly_wins_somewhere(batched))


# GEMM adds its routes when this module is imported (nvfly.torch imports it), so routing needs no import of it;
# like every route they take effect at install_routing
register_routes()

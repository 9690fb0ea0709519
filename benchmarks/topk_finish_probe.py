"""Where the row-threshold TopK's time goes: the current ``topk.row`` against a baseline copy of the module, and
the phases of the one-launch kernel from ``%globaltimer`` stamps.

Per shape (bf16 unless ``--dtype``): each variant is checked against the documented order (a stable sort), then
timed with ``bench_ms`` (do_bench, L2 flushed), ``graph_ms`` (CUDA graph replay, warm L2) and the torch profiler's
kernel durations (``--kernels``). Variants: the row plan ("current"); where it has the exact finish, the same
plan without it ("list"); the row plan with blocks of THREADS_VARIANTS, with and without the exact finish.
``--base FILE``: a copy of an older ``nvfly/ops/topk_row.py`` (e.g.
``git show c86307c:nvfly/ops/topk_row.py > tmp_device/topk_row_base.py``) timed beside the current one.
``--stamps``: a copy of the one-launch kernel's list path (the one-launch plan is the default where a row's
blocks fit one an SM, e.g. M = 1) that writes ``%globaltimer`` (ns) at the phase ends of every block to a debug
tensor; printed as microseconds from the first block's start (the median block's and the last block's),
medians over ``--repeat`` launches. The production kernel is not touched: the stamped copy lives here and calls
the same helpers.

Usage: python -m benchmarks.topk_finish_probe [--base tmp_device/topk_row_base.py] [--stamps] [--shapes M,N,K ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nvfly  # noqa: E402
from benchmarks.common import bench_ms, graph_ms  # noqa: E402
from benchmarks.device_time import kernel_times  # noqa: E402
from benchmarks.topk import allocating_call  # noqa: E402
from nvfly.arch.ptx import asm  # noqa: E402
from nvfly.frontend.language import syncthreads_or  # noqa: E402
from nvfly.ops import topk  # noqa: E402
from nvfly.ops.topk import api as topk_api, plans as topk_plans  # noqa: E402
from nvfly.ops.topk.plans import COPIES, HIST, HIST_BITS  # noqa: E402
from nvfly.ops.topk.primitives import atom_add_relaxed_u32  # noqa: E402
from nvfly.ops.topk.row import (block_slice, bucket_starts, clean_row, count_fine_buckets, count_slice,  # noqa: E402
                                fine_shift_of, finish_alone, load_list, locate_row_bucket, one_launch_counts_offset,
                                publish_candidates, scatter_kept, stage_candidates, wait_for_count, wait_for_row,
                                write_ranked)
from nvfly.ops.topk.select import highest_index_bit, select_top, shared_state  # noqa: E402
from nvfly.ops.topk.sort import write_sorted  # noqa: E402
from nvfly.runtime.driver import plan_sm_count  # noqa: E402
from nvfly.runtime.torch_args import vector_width  # noqa: E402

SHAPES = [(1, 151936, 1024), (1, 151936, 50), (1, 128256, 1024), (64, 151936, 1024), (64, 151936, 50)]
THREADS_VARIANTS = (256, 512)  # the row plan with blocks of these threads too, where it differs (one launch only)
PHASES = ["start", "counted", "row complete", "located", "staged", "published", "all appended", "list loaded",
          "fine counts", "starts", "scattered / selected", "written", "cleaned"]
SLOTS = 16


def globaltimer() -> Any:
    return asm("mov.u64 $0, %globaltimer;", [], nvfly.i64)


@nvfly.func
def stamp(stamps, row, part, slot, tid):
    """Thread 0's ``%globaltimer`` at ``stamps[row, part, slot]`` once the block is here (a barrier first)."""
    nvfly.syncthreads()
    if tid == 0:
        stamps[row, part * SLOTS + slot] = globaltimer()


@nvfly.kernel
def stamped_one_launch_kernel(x: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor, hist: nvfly.Tensor,
                              counters: nvfly.Tensor, candidates: nvfly.Tensor, stamps: nvfly.Tensor, k: nvfly.i32,
                              slice_len: nvfly.i32, VEC: nvfly.Constexpr, UNROLL: nvfly.Constexpr,
                              THREADS: nvfly.Constexpr, CAP: nvfly.Constexpr, ROW_CAP: nvfly.Constexpr,
                              K_POW2: nvfly.Constexpr, LARGEST: nvfly.Constexpr, SHARED: nvfly.Constexpr):
    """``topk_row.topk_row_one_launch_kernel`` with a stamp at the end of each of PHASES in every block (the last
    one only in the block that cleans up): ``select_and_finish`` and ``finish_list`` inlined. Not ``SHARED``, and
    rows whose list overflows (the whole-row stream): the last block's finish is not stamped."""
    nvfly.cooperative()
    nvfly.min_blocks_per_sm(1)
    row, tid, lane, warp, start, stop = block_slice(x, slice_len)
    part = nvfly.block_idx.y
    parts = nvfly.grid_dim.y
    if tid == 0:
        stamps[row, part * SLOTS] = globaltimer()
    smem = shared_state(CAP, K_POW2, THREADS, tid)
    buf, kept_buf, row_hist, lane_sums, warp_sums, warp_lows, state = smem
    counts = nvfly.dynamic_shared_tensor(nvfly.i32, (HIST * COPIES,), one_launch_counts_offset(CAP, K_POW2, THREADS))
    first_loads = count_slice(x, hist, counts, row, start, stop, tid, VEC, UNROLL, THREADS, LARGEST)
    stamp(stamps, row, part, 1, tid)
    wait_for_row(counters, row, tid, nvfly.grid_dim.y)
    stamp(stamps, row, part, 2, tid)
    bucket, above, count = locate_row_bucket(hist, row_hist, lane_sums, warp_sums, row, k, tid, lane, warp, THREADS,
                                             True)
    stamp(stamps, row, part, 3, tid)
    lowest = bucket.bitcast(nvfly.u32) << ((32 if x.dtype == nvfly.f32 else 16) - HIST_BITS)
    if count <= ROW_CAP:
        stage_candidates(x, row, start, stop, lowest, buf, state, tid, lane, VEC, UNROLL, THREADS, LARGEST, None,
                         first_loads)
    stamp(stamps, row, part, 4, tid)
    last = 2 * parts - 1
    is_last = publish_candidates(candidates, counters, row_hist, buf, state, row, tid, THREADS, last)
    if tid == 0:
        stamps[row, part * SLOTS + 5] = globaltimer()
    if not SHARED:
        if is_last:
            finish_alone(x, values, indices, hist, counters, candidates, smem, count, lowest, k, row, tid, lane, warp,
                         VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST)
    elif count <= ROW_CAP:
        wait_for_count(counters, row, tid, last + 1, nvfly.select(is_last, last + 1, 0))
        leaving = nvfly.i32(0)
        if tid == 0:
            leaving = atom_add_relaxed_u32(counters.address(2 * row), 1)
        stamp(stamps, row, part, 6, tid)
        key_high = load_list(candidates, buf, warp_sums, row, count, tid, lane, warp, THREADS)
        stamp(stamps, row, part, 7, tid)
        fine_shift = fine_shift_of(lowest, key_high, x.dtype)
        count_fine_buckets(buf, row_hist, count, lowest, fine_shift, tid, THREADS)
        stamp(stamps, row, part, 8, tid)
        crowded = syncthreads_or(bucket_starts(row_hist, warp_sums, state, k, tid, lane, warp, THREADS))
        placed = state[1]
        stamp(stamps, row, part, 9, tid)
        if crowded | (count + placed > CAP):
            if is_last:
                for j in nvfly.static_range(2 * HIST // THREADS):
                    row_hist[j * THREADS + tid] = 0
                if tid == 0:
                    state[0] = count
                nvfly.syncthreads()
                select_top(*smem, k, highest_index_bit(x), tid, lane, warp, THREADS)
                stamp(stamps, row, part, 10, tid)
                write_sorted(x, values, indices, buf, kept_buf, state[0], k, row, tid, lane, K_POW2, THREADS)
        else:
            scatter_kept(buf, row_hist, count, k, lowest, fine_shift, tid, THREADS)
            stamp(stamps, row, part, 10, tid)
            write_ranked(x, values, indices, buf, row_hist, count, placed, k, lowest, fine_shift, row, part, parts,
                         tid, THREADS, LARGEST)
        stamp(stamps, row, part, 11, tid)
        if syncthreads_or(leaving == last + parts):
            clean_row(hist, counters, row, tid, THREADS)
            stamp(stamps, row, part, 12, tid)
    elif is_last:
        finish_alone(x, values, indices, hist, counters, candidates, smem, count, lowest, k, row, tid, lane, warp,
                     VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST)


def us(ms: Any) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def row_plan(x: torch.Tensor, k: int) -> topk.TopkPlan:
    m, n = x.shape
    vec = vector_width(n, (x,), x.element_size())
    return topk.plan(n, k, m, vec, x.element_size(), plan_sm_count(x.get_device()), row_threshold=True)


def load_base(path: str) -> Any:
    """The baseline copy of topk_row as a module of its own (its kernels compile apart from the current ones)."""
    spec = importlib.util.spec_from_file_location("topk_row_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(x: torch.Tensor, k: int, base: Any) -> dict[str, Callable[[], Any]]:
    m, n = x.shape
    p = row_plan(x, k)
    runs = {"current": topk_api.row_runner(p, m, k, True)}
    if p.exact_stride:  # the same kernel without its exact finish: the list path
        runs["list"] = topk_api.row_runner(dataclasses.replace(p, exact_stride=0), m, k, True)
    for threads in THREADS_VARIANTS:
        for exact in (None, False):
            other = topk_plans.row_plan(n, k, m, p.vec, x.element_size(), plan_sm_count(x.get_device()),
                                        threads=threads, exact=exact)
            listed = exact is False and (threads == p.threads or not p.exact_stride)  # (timed as "list" already)
            if other != p and other.one_launch and not listed:
                runs[f"{threads} threads{', list' if exact is False else ''}"] = topk_api.row_runner(other, m, k, True)
    if base is not None:
        runs["base"] = base.runner(p, m, k, True)
    return {name: allocating_call(run, x, k) for name, run in runs.items()}


def stamped(x: torch.Tensor, k: int, repeat: int) -> None:
    """Phase times of the stamped one-launch kernel (plans whose blocks fit one an SM), medians over ``repeat``."""
    m, n = x.shape
    p = row_plan(x, k)
    if not p.one_launch:
        print(f"  stamps of {m}x{n} k={k}: not a one-launch plan ({m} rows x {p.parts} slices), skipped")
        return
    launch = stamped_one_launch_kernel.prepared((m, p.parts, 1), p.threads)
    stamps = torch.zeros((m, p.parts * SLOTS), dtype=torch.int64, device=x.device)
    values = torch.empty((m, k), dtype=x.dtype, device=x.device)
    indices = torch.empty((m, k), dtype=torch.int64, device=x.device)
    expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    phases: dict[str, list[float]] = {}
    for i in range(repeat + 3):
        hist, counters, candidates, _, _ = topk_api.workspace(x.device, m)
        stamps.zero_()
        launch.launch(x, values, indices, hist, counters, candidates, stamps, k, p.slice_len, p.vec, p.unroll,
                      p.threads, p.cap, p.row_cap, p.k_pow2, True, p.shared_finish)
        torch.cuda.synchronize()
        assert torch.equal(indices, expected), "stamped kernel: wrong indices"
        if i < 3:
            continue
        s = stamps[0].view(p.parts, SLOTS).cpu().double()  # row 0
        t0 = float(s[:, 0].min())
        for j, name in enumerate(PHASES):
            stamped_blocks = s[:, j][s[:, j] > 0]
            if len(stamped_blocks):
                phases.setdefault(name + " (median block)", []).append((float(stamped_blocks.median()) - t0) / 1e3)
                phases.setdefault(name + " (last block)", []).append((float(stamped_blocks.max()) - t0) / 1e3)
    print(f"  stamps of {m}x{n} k={k} ({p.parts} blocks of {p.threads}; us from the first block's start):")
    for name, t in phases.items():
        print(f"    {name:<40} {statistics.median(t):7.2f}")


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=None, help="M,N,K triples")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--base", default=None, help="a copy of an older nvfly/ops/topk_row.py to time beside")
    parser.add_argument("--stamps", action="store_true", help="phase stamps of the one-launch kernel")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--kernels", action="store_true",
                        help="kernel durations from the torch profiler (CUDA graphs replayed after it in the same "
                             "process measured ~0.5 us a launch slower: give it a run of its own)")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    dtype = getattr(torch, args.dtype)
    base = load_base(args.base) if args.base else None
    ok = True
    for m, n, k in shapes:
        x = torch.randn(m, n, device="cuda").to(dtype)
        expected = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
        line = [f"{m}x{n} k={k} {args.dtype}: torch {bench_ms(lambda: torch.topk(x, k)) * 1e3:.1f} us "
                f"(graph {us(graph_ms(lambda: torch.topk(x, k)))})"]
        for name, call in variants(x, k, base).items():
            values, indices = call()
            correct = bool(torch.equal(indices, expected) and torch.equal(values, x.gather(1, expected)))
            ok &= correct
            timed = f"{name}{'' if correct else ' MISMATCH'} {bench_ms(call) * 1e3:.1f} us (graph {us(graph_ms(call))}"
            if args.kernels:
                timed += "; kernels: " + ", ".join(f"{kname[:40]} {t:.1f}" for kname, t in
                                                   kernel_times(call, calls=50).items() if "topk" in kname)
            line.append(timed + ")")
        print(" | ".join(line), flush=True)
        if args.stamps:
            stamped(x, k, args.repeat)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

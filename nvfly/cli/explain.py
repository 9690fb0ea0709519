"""``nvfly explain M N K``: for one GEMM shape, whether nvfly can run it, what its heuristic runs, the
candidates Inductor would benchmark, their times, the winner and why (``nvfly.torch.explain``). Without a GPU
nothing is timed; ``--benchmark`` times the candidates and torch now, on a CUDA GPU. ``--groups E``: a grouped GEMM
(MoE experts) of E groups instead, M the routed rows in all (``--layout``, ``--fuse``):
``nvfly.torch.grouped_ops.explain_grouped``; with ``--scaled row|block`` the grouped FP8 GEMM
(``nvfly.torch.scaled_grouped_ops.explain_scaled_grouped``). ``--scaled RECIPE`` without ``--groups``: an FP8
scaled GEMM (``torch._scaled_mm``) instead: the plan nvfly runs, what routing does, and the candidates nvfly adds to
max-autotune (``scaled_ops.explain_scaled``).

``nvfly explain --sdpa B,HQ,HKV,SQ,SKV,D[,DV] [--causal] [--grad] [--mask KIND] [--dropout P]``: what eager routing does with
``F.scaled_dot_product_attention`` on that shape: nvfly's decode or prefill, or torch's SDPA and why
(``nvfly.torch.explain_sdpa``); ``--benchmark`` times both. ``nvfly explain --flex B,HQ,HKV,SQ,SKV,D[,DV]
[--mods softcap,window]``: the same for ``flex_attention``, eager and compiled (``nvfly.torch.explain_flex``)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console

from nvfly.cli.usage import UsageError, help_text, positive_int

DTYPES = ("bf16", "fp16")
SCALINGS = ("tensor", "row", "block", "block1x128", "mxfp8", "mxfp4")
MAJORS = ("K", "MN")


def _majors(text: str) -> tuple[str, str]:
    """An argparse type: ``A,B`` with each of K or MN."""
    majors = tuple(text.upper().split(","))
    if len(majors) != 2 or any(m not in MAJORS for m in majors):
        raise argparse.ArgumentTypeError(f"expected two of K/MN separated by a comma (e.g. K,K), got {text!r}")
    return majors  # type: ignore[return-value]


def _device(text: str) -> int:
    """An argparse type: a CUDA device index."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a device index (0, 1, ...), got {text!r}")
    return int(text)


def _sdpa_shape(text: str) -> tuple[int, ...]:
    """An argparse type: B,HQ,HKV,SQ,SKV,D[,DV], positive integers."""
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) not in (6, 7) or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected B,HQ,HKV,SQ,SKV,D[,DV] (positive integers), got {text!r}")
    return dims


def _flex_mods(text: str) -> tuple[str, ...]:
    from nvfly.torch.explain import FLEX_MODS
    names = tuple(name for name in text.split(",") if name)
    unknown = [name for name in names if name not in FLEX_MODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"expected names among {', '.join(FLEX_MODS)}, got {', '.join(unknown)}")
    return names


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("explain", description=help_text(__doc__),
                                 help="how a GEMM (or, with --sdpa / --flex, an attention) shape is served, and why")
    for dim, meaning in (("m", "rows of A and of the output"), ("n", "columns of B and of the output"),
                         ("k", "the reduced dimension")):
        parser.add_argument(dim, type=positive_int, metavar=dim.upper(), nargs="?", help=meaning + " (a GEMM)")
    parser.add_argument("--batches", type=positive_int, default=1, help="batch count (bmm); default 1")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--majors", type=_majors, default=None,
                        help="A and B majors, each K or MN (default K,K: x @ W^T of a Linear layer; with --groups "
                             "--layout kgrouped MN,MN: the weight gradient's x^T and dy)")
    parser.add_argument("--benchmark", action="store_true",
                        help="time the candidates and torch now (needs a CUDA GPU)")
    parser.add_argument("--device", type=_device, default=None, help="CUDA device index (default: current)")
    parser.add_argument("--sdpa", type=_sdpa_shape, metavar="B,HQ,HKV,SQ,SKV,D[,DV]",
                        help="explain F.scaled_dot_product_attention on q (B, HQ, SQ, D), k/v (B, HKV, SKV, D|DV) "
                             "instead of a GEMM")
    parser.add_argument("--flex", type=_sdpa_shape, metavar="B,HQ,HKV,SQ,SKV,D[,DV]",
                        help="explain flex_attention on q (B,HQ,SQ,D), k/v (B,HKV,SKV,D|DV) instead: eager routing "
                             "and the compiled backend")
    parser.add_argument("--mods", type=_flex_mods, default=(), metavar="NAME[,NAME]",
                        help="with --flex: mods among softcap (score_mod), causal and window (masks)")
    parser.add_argument("--causal", action="store_true", help="with --sdpa: is_causal=True")
    parser.add_argument("--grad", action="store_true", help="with --sdpa: the inputs require grad (training)")
    parser.add_argument("--mask", choices=("padding", "bool", "additive"), default=None,
                        help="with --sdpa: an attn_mask, (B, 1, 1, SKV) boolean padding, (B, 1, SQ, SKV) boolean or "
                             "(B, 1, SQ, SKV) additive")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="P", help="with --sdpa: dropout_p")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a report")
    parser.add_argument("--groups", type=positive_int, default=None,
                        help="explain a grouped GEMM of this many groups (MoE experts) instead")
    parser.add_argument("--layout", choices=("contiguous", "masked", "kgrouped"), default="contiguous",
                        help="with --groups: tokens sorted by expert with offsets (default), a fixed capacity M "
                             "per expert, or groups along K (the weight gradient)")
    parser.add_argument("--fuse", choices=("none", "silu_mul"), default="none",
                        help="with --groups: the fused gate/up projection (N = I outputs of 2I weight columns)")
    parser.add_argument("--scaled", choices=SCALINGS, default=None,
                        help="an FP8 scaled GEMM (torch._scaled_mm) with these scales instead: what nvfly.ops.scaled "
                             "runs (tensor, row, 1x128 x 128x128 or 1x128 x 1x128 block scales), what routing "
                             "does, and nvfly's max-autotune candidates")
    parser.add_argument("--fast-accum", action="store_true", help="with --scaled: use_fast_accum=True")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    dims = [("M", args.m), ("N", args.n), ("K", args.k)]
    if args.flex is not None:
        if args.sdpa is not None or any(value is not None for _, value in dims):
            args.parser.error("give --flex alone: not with M N K or --sdpa")
        return _run_flex(args)
    if args.mods:
        args.parser.error("--mods goes with --flex")
    if args.sdpa is None:
        missing = [name for name, value in dims if value is None]
        if missing:
            args.parser.error(f"the following arguments are required: {', '.join(missing)}")
    elif any(value is not None for _, value in dims):
        args.parser.error("give M N K (a GEMM) or --sdpa (attention), not both")
    if args.scaled and args.groups is not None:
        from nvfly.torch.scaled_grouped_ops import explain_scaled_grouped
        if args.scaled not in ("row", "block", "mxfp8", "mxfp4") or args.layout == "kgrouped":
            args.parser.error("--groups with --scaled: row, block, mxfp8 or mxfp4 scales, contiguous or masked layout")
        print(explain_scaled_grouped(args.groups, args.m, args.n, args.k, layout=args.layout, scaling=args.scaled,
                                     use_fast_accum=args.fast_accum), end="")
        return 0
    if args.scaled:
        return _run_scaled(args)
    console = Console(stderr=True, highlight=False)
    with console.status("loading torch and nvfly"):
        import torch

        from nvfly.torch.explain import explain
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.benchmark and not gpus:
        raise UsageError("nvfly explain", "--benchmark times the candidates and torch on a CUDA GPU, and torch "
                                          "sees none here (leave it out to explain without timing)")
    if args.device is not None and args.device >= gpus:
        raise UsageError("nvfly explain", f"--device {args.device}: torch sees {gpus} CUDA device(s)")
    if args.groups is not None:
        from nvfly.torch.grouped_ops import explain_grouped
        majors = args.majors or (("MN", "MN") if args.layout == "kgrouped" else ("K", "K"))
        print(explain_grouped(args.groups, args.m, args.n, args.k, layout=args.layout, fuse=args.fuse,
                              b_major=majors[1]), end="")
        return 0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    with console.status("timing the candidates and torch" if args.benchmark else "planning"):
        if args.sdpa is not None:
            from nvfly.torch.explain import explain_sdpa
            result = explain_sdpa(*args.sdpa, is_causal=args.causal, dtype=dtype, requires_grad=args.grad,
                                  attn_mask=args.mask, dropout_p=args.dropout, benchmark=args.benchmark,
                                  device=args.device)
        else:
            result = explain(args.m, args.n, args.k, batches=args.batches, dtype=dtype,
                             majors=args.majors or ("K", "K"), benchmark=args.benchmark, device=args.device)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=str))
    else:
        print(result, end="")  # the report ends with its own newline
    return 0


def _run_flex(args: argparse.Namespace) -> int:
    """``--flex``: eager routing and the compiled backend for a flex_attention shape (``explain_flex``)."""
    import torch

    from nvfly.torch.explain import explain_flex
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        result = explain_flex(*args.flex, mods=args.mods, dtype=dtype)
    except ValueError as exc:
        raise UsageError("nvfly explain", str(exc)) from None
    print(json.dumps(result.to_dict(), indent=1, default=str) if args.json else result, end="\n" if args.json else "")
    return 0


def _run_scaled(args: argparse.Namespace) -> int:
    """``--scaled``: the FP8 scaled GEMM's plan for the shape, what routing does with it, and the candidates nvfly
    adds to max-autotune's scaled-mm tuning (``nvfly.torch.scaled_ops.explain_scaled``)."""
    from nvfly.torch.scaled_ops import explain_scaled
    report = explain_scaled(args.m, args.n, args.k, scaling=args.scaled, use_fast_accum=args.fast_accum)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    lines = [f"FP8 scaled GEMM {args.m} x {args.n} x {args.k}, {args.scaled} scales"
             f"{', fast accumulation' if args.fast_accum else ''}", f"  nvfly: {report['nvfly']}",
             f"  routing: {report['routing']}"]
    if isinstance(report["inductor"], str):
        lines.append(f"  max-autotune: declined: {report['inductor']}")
    else:
        lines.append("  max-autotune (after nvfly.torch.install()), beside cuBLAS and Triton (nvfly::scaled_mm_out):")
        lines += [f"    {c['config']}: {c['plan']}" for c in report["inductor"]]
    if report["decisions"]:
        lines.append("  decisions in this process:")
        lines += [f"    {d}" for d in report["decisions"]]
    print("\n".join(lines))
    return 0

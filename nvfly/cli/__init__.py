"""The ``nvfly`` command: ``demo`` compiles (and, with a GPU, runs and checks) the kernel library and examples and
says what their SASS proves; ``bench`` lists and runs the benchmark suites; ``explain M N K`` shows how a GEMM
shape is served. A user's mistake ends in one line on stderr and exit code 2, never a traceback."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from nvfly.cli import bench, demo, explain
from nvfly.cli.usage import USAGE_ERROR, Parser, UsageError, help_text
from nvfly.errors import ToolchainError
from nvfly.version import __version__


def build_parser() -> Parser:
    parser = Parser(prog="nvfly", description=help_text(__doc__))
    parser.add_argument("--version", action="version", version=f"nvfly {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(commands)
    bench.add_parser(commands)
    explain.add_parser(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``nvfly`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except UsageError as exc:
        print(f"{exc}", file=sys.stderr)
        return USAGE_ERROR
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        print("nvfly: error: this command runs on torch tensors: pip install torch (the CPU build is enough)",
              file=sys.stderr)
        return USAGE_ERROR
    except ToolchainError as exc:  # a missing ptxas or cuobjdump: the message says how to get it
        print(f"nvfly: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("nvfly: interrupted", file=sys.stderr)
        return 130

"""`pagefleet bench NAME`: run one of the repository's benchmark scripts.

The scripts live in `benchmarks/` of a source checkout (they are not part of
the installed package); each prints a table with ratios against a peer that
runs in the same process.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import Any


def _benchmarks_dir() -> Path | None:
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = base / "benchmarks"
        if candidate.is_dir():
            return candidate
    return None


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="run a benchmark script from benchmarks/",
        description="Run benchmarks/NAME.py from a source checkout; arguments after NAME "
        "are passed through (most take --smoke for a seconds-long run).",
    )
    parser.add_argument("name", nargs="?", help="benchmark name; omit to list them")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from pagefleet.cli import CommandError

    directory = _benchmarks_dir()
    if directory is None:
        raise CommandError("no benchmarks/ directory: run from a pagefleet source checkout")
    available = sorted(p.stem for p in directory.glob("*.py") if not p.stem.startswith("_"))
    if not args.name:
        print("\n".join(available))
        return 0
    if args.name not in available:
        raise CommandError(f"unknown benchmark {args.name!r}; available: {', '.join(available)}")
    script = directory / f"{args.name}.py"
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args.args]
    # As `python benchmarks/NAME.py` would: the script's folder first on the path, so
    # its shared helpers (`_engine_bench`, sibling scripts) import.
    sys.path.insert(0, str(directory))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    finally:
        sys.argv = old_argv
        sys.path[:] = old_path
    return 0

"""The `pagefleet` command line: one subcommand per module in `pagefleet.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand name -> module under pagefleet.commands. Each module defines
# `register(subparsers) -> argparse.ArgumentParser` and sets `func` on its parser;
# `func(args) -> int` is the exit code. Modules are imported lazily so that
# `pagefleet plan` does not pay for importing Ray.
COMMANDS = {
    "plan": "plan",
    "generate": "generate",
    "serve": "serve",
    "status": "status",
    "bench": "bench",
}


class CommandError(Exception):
    """A user error: printed as one line, exit code 2."""


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagefleet",
        description="Serve LLMs from a Ray cluster with a paged KV cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, module in COMMANDS.items():
        if wanted is not None and wanted != name:
            sub.add_parser(name)  # listed in --help, loaded only when chosen
            continue
        try:
            mod = importlib.import_module(f"pagefleet.commands.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"pagefleet.commands.{module}":
                raise
            sub.add_parser(name, help="(not available in this build)")
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pagefleet` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except CommandError as exc:
        print(f"pagefleet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

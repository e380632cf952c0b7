"""The `pagefleet` command line: one subcommand per module in `pagefleet.commands`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any

from pagefleet import __version__

# Subcommand name -> module under pagefleet.commands. Each module defines
# `register(subparsers) -> argparse.ArgumentParser` and sets `func` on its parser;
# `func(args) -> int` is the exit code. Modules are imported lazily so that
# `pagefleet plan` does not pay for importing Ray.
COMMANDS = {
    "plan": "plan",
    "generate": "generate",
    "serve": "serve",
    "status": "status",
    "scale": "scale",
    "bench": "bench",
}


class CommandError(Exception):
    """A user error: printed as one line, exit code 2."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, [], "", argparse.SUPPRESS)
            or action.option_strings == []
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults (used for every subcommand)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = Parser(
        prog="pagefleet",
        description="Serve LLMs from a Ray cluster with a paged KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"pagefleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
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


def quiet_when_not_a_terminal() -> None:
    """Plain logs when stderr is not a terminal: no ANSI colours, no progress bars.

    Set in the environment, so that the Ray processes this command starts (whose
    logs Ray forwards to this stderr) inherit it.
    """
    if sys.stderr.isatty():
        return
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray's coloured "(pid=...)" prefixes
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("NO_COLOR", "1")


def quiet_ray_driver_logs() -> None:
    """Hide driver-side chatter that reads like a problem on a clean start.

    Serve's INFO lines ("Connecting to existing Serve app") and Ray's notice that
    token auth is enabled; other warnings and errors still show.
    """
    # A filter, not a level: Serve resets its logger's level when it starts.
    logging.getLogger("ray.serve").addFilter(_warnings_and_above)
    # Every local start warns that Ray's token auth is on, its safe default; a
    # warning that auth is *off* still shows.
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        lambda record: not record.getMessage().startswith("Token authentication is enabled")
    )


def _warnings_and_above(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pagefleet` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_when_not_a_terminal()
    quiet_ray_driver_logs()
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

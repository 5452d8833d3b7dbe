"""`moekit` entry point. Each command lives in moekit/cli/<command>.py and provides
`add_parser(subparsers)` (which sets `func`)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import List, Optional

COMMANDS = ("info", "demo", "bench", "tune", "eplb")


def installed(module: str) -> bool:
    """Whether an optional package imports here (the commands name its extra when it does not)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


class UsageError(ValueError):
    """A command's option that cannot be used as given: `main` prints
    `moekit COMMAND: error: MESSAGE` on stderr and exits with status 2, as argparse does."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moekit", description="Mixture-of-Experts inference layers for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the oracle's choices")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"moekit.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"moekit.cli.{name}":
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        print(f"{parser.prog} {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

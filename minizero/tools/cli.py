"""What every ``python -m minizero COMMAND`` parser shares: one-line errors, positive numbers."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: what is wrong and where to read more."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise SystemExit(status)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return n


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return x


def add_nprocs(p: argparse.ArgumentParser) -> None:
    """The ``--nprocs`` option every multi-rank command shares."""
    p.add_argument(
        "--nprocs",
        type=positive_int,
        default=None,
        help="ranks (default: one per GPU with 2 or more GPUs, else 2 on the CPU)",
    )

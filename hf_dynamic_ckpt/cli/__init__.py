"""`hf-dynamic-ckpt`: inspect, check, manage and export a checkpoint store from the shell.

    hf-dynamic-ckpt ls ROOT [--task T] [--all] [--json]
    hf-dynamic-ckpt show ROOT REF [--task T] [--json]
    hf-dynamic-ckpt verify ROOT [REF | --all] [--task T]
    hf-dynamic-ckpt pin|unpin ROOT REF [--task T]
    hf-dynamic-ckpt rm ROOT REF... [--task T] [--force]
    hf-dynamic-ckpt gc ROOT [--task T] [--dry-run] [--json]
    hf-dynamic-ckpt export ROOT REF OUT [--format peft|hf|merged] [--base PATH]
    hf-dynamic-ckpt reindex ROOT
    hf-dynamic-ckpt plot ROOT [--task T] [--output PNG]

ROOT is the store directory (the one holding `catalog.db`) or the training `output_dir`
(its `smart_ckpt/` is used); REF is ``step:N``, ``N``, ``auto``/``best``/``fastest`` or a
checkpoint directory. Exit codes: 0 success, 1 problems found (`verify`), 2 bad usage, a
path that holds no store, or a reference that names nothing. Commands that only look
write nothing (no catalog is ever created by them).

Adding a subcommand: write ``_add_<name>(subparsers)`` that registers its parser with
``set_defaults(func=...)`` (the function takes the parsed args and returns the exit code)
and append it to `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from ..errors import DynamicCkptError
from . import inspect, manage
from ._common import UsageError, human_size, usage_error

__all__ = ["SUBCOMMANDS", "build_parser", "human_size", "main"]

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    *inspect.COMMANDS,
    *manage.COMMANDS,
]
"""Functions that register one subcommand each; append to add a command."""


def build_parser() -> argparse.ArgumentParser:
    """The `hf-dynamic-ckpt` argument parser with every registered subcommand."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("hf_dynamic_ckpt")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
        v = "unknown"
    parser = argparse.ArgumentParser(prog="hf-dynamic-ckpt",
                                     description="Inspect, check, manage and export an hf_dynamic_ckpt store.")
    parser.add_argument("--version", action="version", version=f"hf-dynamic-ckpt {v}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-dynamic-ckpt`; returns the exit code.

    Example:
        ```bash
        hf-dynamic-ckpt ls out/smart_ckpt
        hf-dynamic-ckpt verify out --all          # the training output_dir works too
        ```
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SystemExit as e:
        return int(e.code or 0)
    except (UsageError, DynamicCkptError) as e:
        return usage_error(str(e))
    except BrokenPipeError:  # `hf-dynamic-ckpt ls ROOT | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

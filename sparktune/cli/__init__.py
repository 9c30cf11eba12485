"""The ``sparktune`` command line.

Each subcommand is a module ``sparktune.cli.<name>`` with ``add_parser(subparsers)``, which
adds its parser and sets ``func`` on it: ``func(args) -> int`` is the exit code. A subcommand
whose module cannot be imported (a missing optional dependency) still appears, and running it
prints the import error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS: tuple[str, ...] = ("info", "tune", "db", "bench")


def _broken(name: str, error: str):
    def run(args: argparse.Namespace) -> int:
        print(f"sparktune {name}: unavailable: {error}", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="sparktune", description="Autotuned fused attention kernels for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"sparktune {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except Exception as exc:  # noqa: BLE001 - reported when the subcommand runs
            error = f"{type(exc).__name__}: {exc}"
            sub = subparsers.add_parser(name, help=f"(unavailable: {error})")
            sub.set_defaults(func=_broken(name, error), accepts_any_arguments=True)
            continue
        module.add_parser(subparsers)
    return parser


#: torch's notice when autograd's GPU thread makes its first cuBLAS call: PyTorch then uses
#: the device's primary context, as it should; the commands' output stays the results'
_QUIET = ("Attempting to run cuBLAS, but there was no current CUDA context",)


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    for text in _QUIET:
        warnings.filterwarnings("ignore", message=text, category=UserWarning)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)

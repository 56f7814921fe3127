"""Command line: ``python -m msprobe_core <command>`` (also the ``msprobe-core`` console script).

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; they are
imported only when their command runs, so ``--help`` and unrelated commands stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from msprobe_core.errors import MsprobeError

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "recover": ("msprobe_core.dump.recover", "rebuild dump.json/stack.json/construct.json of steps a crash left unfinished"),
    "compare": ("msprobe_core.compare.cli", "compare two dumps and name the first record where they diverge"),
    "anomalies": ("msprobe_core.monitor.anomaly_cli", "list the monitor's anomalies in order and name the first"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m msprobe_core",
                                     description="msprobe-compatible precision debugging and training monitoring tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        _load(module).add_arguments(p)
    return parser


def _load(module: str):
    return importlib.import_module(module)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(_load(args._module).run(args) or 0)
    except MsprobeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def compare_main() -> int:
    """Console script ``msprobe-compare``: the same as ``python -m msprobe_core compare``."""
    return main(["compare", *sys.argv[1:]])

"""Command line: ``python -m msprobe_core <command>`` (also the ``msprobe-core`` console script).

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; they are
imported only when their command runs, so ``--help`` and unrelated commands stay fast.

``-f/--framework {pytorch,mindspore}`` may come before the command, as msprobe writes it
(``msprobe -f pytorch config_check -c A.zip B.zip``), or after it where the command has the option. Commands
that take the framework from their input accept it before the command and have no use for it.
"""

from __future__ import annotations

import argparse
import codecs
import importlib
import logging
import sys
from typing import Sequence

from msprobe_core.errors import MsprobeError

FRAMEWORKS = ("pytorch", "mindspore")
FRAMEWORK_FLAGS = ("-f", "--framework")

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "recover": ("msprobe_core.dump.recover", "rebuild dump.json/stack.json/construct.json of steps a crash left unfinished"),
    "compare": ("msprobe_core.compare.cli", "compare two dumps and name the first record where they diverge"),
    "anomalies": ("msprobe_core.monitor.anomaly_cli", "list the monitor's anomalies in order and name the first"),
    "config_check": ("msprobe_core.config_check.cli", "collect/compare training configurations; compare checkpoints"),
    "acc_check": ("msprobe_core.acc_check.cli", "replay a dump's API calls against a float64 CPU benchmark (pre-check)"),
    "multi_acc_check": ("msprobe_core.acc_check.multi_cli", "acc_check with the API calls split over worker processes"),
    "nan_analyze": ("msprobe_core.nan_analyze.cli", "find the first call that made NaN/Inf across ranks and how it spread"),
    "parse": ("msprobe_core.parse.cli", "show one record's statistics, stack and parent chain"),
    "report": ("msprobe_core.report.cli", "write one self-contained HTML report of a dump, compare or monitor output"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m msprobe_core",
                                     description="msprobe-compatible precision debugging and training monitoring tools")
    parser.add_argument(*FRAMEWORK_FLAGS, dest="framework_first", choices=FRAMEWORKS, default=None,
                        help="the training framework, msprobe's way: before the command (the same as the command's "
                             "own -f where it has one)")
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
    _printable_output()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    _framework_first(parser, args, argv)
    try:
        status = int(_load(args._module).run(args) or 0)
        if getattr(args, "report", False):  # compare / nan_analyze --report: the report package renders their result
            from msprobe_core.report.build import report_after

            print(f"report: {report_after(args.command, args)}")
        return status
    except MsprobeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _printable_output() -> None:
    """Printing a non-ASCII record name or path never fails, whatever the locale: an ASCII stream (the C or
    POSIX locale) writes UTF-8, the bytes of undecodable arguments as they came; another non-UTF-8 stream
    escapes what it cannot encode."""
    for stream in (sys.stdout, sys.stderr):
        encoding = codecs.lookup(getattr(stream, "encoding", None) or "utf-8").name
        if encoding == "utf-8" or not hasattr(stream, "reconfigure"):
            continue
        if encoding == "ascii":
            stream.reconfigure(encoding="utf-8", errors="surrogateescape")
        else:
            stream.reconfigure(errors="backslashreplace")


def _framework_first(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> None:
    """``-f`` before the command sets the command's ``framework``; given on both sides, they must agree."""
    first = vars(args).pop("framework_first", None)
    if first is None or not hasattr(args, "framework"):
        return
    after = argv[argv.index(args.command) + 1:]
    if args.framework != first and any(a in FRAMEWORK_FLAGS or a.startswith("--framework=") for a in after):
        parser.error(f"-f {first} before {args.command} and -f {args.framework} after it disagree")
    args.framework = first


def compare_main() -> int:
    """Console script ``msprobe-compare``: the same as ``python -m msprobe_core compare``."""
    return main(["compare", *sys.argv[1:]])

"""The launch flags, added the Megatron way: through ``extra_args_provider``."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

ArgsProvider = Callable[[argparse.ArgumentParser], Any]

FLAGS = ("--msprobe-config", "--msprobe-monitor-config", "--msprobe-monitor-output-dir", "--msprobe-no-hparams",
         "--msprobe-config-check")


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds the ``msprobe`` argument group and returns the parser.

    ``--msprobe-config PATH`` (the dump's config.json), ``--msprobe-monitor-config PATH`` (the monitor's
    config), ``--msprobe-monitor-output-dir DIR`` (default: ``MONITOR_OUTPUT_DIR`` or
    ``./monitor_output``), ``--msprobe-no-hparams`` (do not write ``hyperparameters.json``) and
    ``--msprobe-config-check PACK.zip`` (write msprobe's config_check pack, Megatron's arguments included). Adding
    them twice (the launcher and the script's own provider) is harmless.
    """
    if "--msprobe-config" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(title="msprobe", description="precision dump and training monitor "
                                      "(msprobe_integrations.megatron)")
    group.add_argument("--msprobe-config", type=str, default=None, metavar="PATH",
                       help="dump config.json: dump every configured iteration (all micro-batches) into step{N}")
    group.add_argument("--msprobe-monitor-config", type=str, default=None, metavar="PATH",
                       help="training monitor config (msprobe monitor format): statistics per iteration")
    group.add_argument("--msprobe-monitor-output-dir", type=str, default=None, metavar="DIR",
                       help="where the monitor writes (default: $MONITOR_OUTPUT_DIR or ./monitor_output)")
    group.add_argument("--msprobe-no-hparams", action="store_true", default=False,
                       help="do not write hyperparameters.json next to the dump and monitor output")
    group.add_argument("--msprobe-config-check", type=str, default=None, metavar="PACK.zip",
                       help="write msprobe's config_check pack (environment, packages, Megatron arguments, first "
                            "micro-steps' weights and batches, random-number call sites) for config_check -c")
    return parser


def compose(*providers: Optional[ArgsProvider]) -> ArgsProvider:
    """One ``extra_args_provider`` that runs ``providers`` in order (None entries skipped); each gets the
    parser the previous one returned (or the same parser when it returned None). Use it to combine
    ``add_args`` with your own provider: ``extra_args_provider=compose(my_provider, add_args)``."""
    chain = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chain:
            result = p(parser)
            if isinstance(result, argparse.ArgumentParser):
                parser = result
        return parser

    provider.__name__ = "msprobe_composed_args_provider"
    return provider


def with_msprobe_args(user_provider: Optional[ArgsProvider] = None) -> ArgsProvider:
    """The user's ``extra_args_provider`` (or none) followed by ``add_args``."""
    return compose(user_provider, add_args)


def parse_known(argv: list[str]) -> argparse.Namespace:
    """Only the msprobe flags of a Megatron command line (everything else is left to Megatron)."""
    parser = add_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    known, _ = parser.parse_known_args(argv)
    return known

"""Zero-edit launcher: run a Megatron-LM (or MindSpeed) training script with msprobe hooks installed.

    torchrun --nproc-per-node 8 -m msprobe_integrations.megatron pretrain_gpt.py <megatron args> \\
        --msprobe-config dump.json --msprobe-monitor-config monitor.json

Before the script runs, ``megatron.training.training.train_step`` and ``setup_model_and_optimizer`` are
wrapped and ``add_args`` is composed into the ``extra_args_provider`` of Megatron's ``parse_args`` (so the
flags stay in Megatron's args namespace and in ``hyperparameters.json``), whichever way the script reaches it:
``pretrain(..., extra_args_provider=...)`` of older Megatron-LM, or ``parse_and_validate_args`` before
``pretrain(cfg_container, ...)`` (megatron-core 0.19's ``megatron.training``). When ``mindspeed`` is importable
the wrappers are registered with MindSpeed's patch manager instead, so they sit on top of MindSpeed's own
patches.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from typing import Optional, Sequence

from msprobe_core.errors import ConfigFileError, MsprobeError

USAGE = """usage: python -m msprobe_integrations.megatron SCRIPT [SCRIPT ARGS ...]
       torchrun [torchrun args] -m msprobe_integrations.megatron SCRIPT [SCRIPT ARGS ...]

Runs SCRIPT (a Megatron-LM / MindSpeed training script such as pretrain_gpt.py) with msprobe's dump and
training monitor installed. The msprobe flags go among the script's own arguments:

  --msprobe-config PATH             dump config.json: dump each configured iteration (all micro-batches)
                                    into DUMP_PATH/step{N}/rank{R} (N = Megatron's iteration number)
  --msprobe-monitor-config PATH     training monitor config: statistics of activations, gradients after
                                    reduction, fp32 main weights and Adam moments per iteration
  --msprobe-monitor-output-dir DIR  monitor output (default: $MONITOR_OUTPUT_DIR or ./monitor_output)
  --msprobe-no-hparams              do not write hyperparameters.json
  --msprobe-config-check PACK.zip   write msprobe's config_check pack (environment, packages, Megatron's
                                    arguments, the first micro-steps' weights and batches, random-number
                                    call sites) for `python -m msprobe_core config_check -c A.zip B.zip`

The launcher wraps megatron.training.training.train_step (dump around each iteration, monitor at the
optimizer step) and setup_model_and_optimizer (attach once model and optimizer are built), and adds the
flags to Megatron's parser (megatron.training.arguments.parse_args, which both pretrain() signatures and
parse_and_validate_args go through). megatron.training comes with megatron-core 0.17 and later, and with a
Megatron-LM checkout; without it (megatron-core 0.16 and older alone) use
msprobe_integrations.megatron.MegatronProbe in your own loop instead.
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (the script's own ``SystemExit`` code passes through)."""
    from msprobe_integrations.megatron import mindspeed
    from msprobe_integrations.megatron.args import parse_known
    from msprobe_integrations.megatron.hooks import MegatronHooks, install

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"msprobe_integrations.megatron: training script '{script}' does not exist\n\n{USAGE}", file=sys.stderr)
        return 2
    flags = parse_known(script_args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("msprobe_core.megatron")
    log.setLevel(logging.INFO)
    try:
        for path in (flags.msprobe_config, flags.msprobe_monitor_config):
            if path is not None and not os.path.isfile(path):
                raise ConfigFileError(path, "no such file")
        if flags.msprobe_config is None and flags.msprobe_monitor_config is None and flags.msprobe_config_check is None:
            log.warning("none of --msprobe-config, --msprobe-monitor-config, --msprobe-config-check given: "
                        "nothing is dumped, monitored or checked")
        settings = dict(config_path=flags.msprobe_config, monitor_config_path=flags.msprobe_monitor_config,
                        monitor_output_dir=flags.msprobe_monitor_output_dir,
                        capture_hyperparameters=not flags.msprobe_no_hparams,
                        config_check_path=flags.msprobe_config_check)
        if mindspeed.available():
            hooks = MegatronHooks(**settings, args_getter=_global_args)
            mindspeed.register(hooks)
            log.info("msprobe hooks registered with MindSpeed's patch manager")
        else:
            hooks = install(**settings)
            log.info("msprobe hooks installed in megatron.training.training")
    except MsprobeError as exc:
        print(f"msprobe_integrations.megatron: {exc}", file=sys.stderr)
        return 2
    sys.argv = [script] + script_args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        code = code if isinstance(code, int) else (0 if code is None else 1)
    else:
        code = 0
    finally:
        hooks.close()
    if code == 0:
        _finish_run()
    return code


def _finish_run() -> None:
    """The script ended well and its model is out of scope: megatron-core drops its parallel groups and
    ``finish_distributed`` destroys them, so the process exits 0 (Megatron-LM's ``pretrain`` leaves them
    alive, and a group torn down at interpreter exit can abort it; see ``msprobe_core.pytorch.shutdown``).
    Nothing to do when the script destroyed them itself."""
    from msprobe_core.session import finish_distributed

    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    finish_distributed()


def _global_args():
    from megatron.training.global_vars import get_args

    return get_args()


if __name__ == "__main__":
    sys.exit(main())

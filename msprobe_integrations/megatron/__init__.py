"""Megatron (megatron-core, Megatron-LM, MindSpeed): dump and monitor behind launch flags.

Megatron users add flags instead of editing the training loop::

    torchrun ... -m msprobe_integrations.megatron pretrain_gpt.py <megatron args> \\
        --msprobe-config dump.json --msprobe-monitor-config monitor.json

The launcher (``__main__``) wraps Megatron-LM's ``megatron.training.training.train_step`` (the dump
covers each iteration, every micro-batch, named by Megatron's iteration number), attaches the monitor
once ``setup_model_and_optimizer`` built model and optimizer, and composes ``add_args`` into the
``extra_args_provider`` of Megatron's ``parse_args``. That is where both of Megatron-LM's ``pretrain``
signatures parse their arguments: the older ``pretrain(train_valid_test_dataset_provider, model_provider,
model_type, forward_step_func, extra_args_provider=..., args_defaults=...)`` itself, and the config-container
one of megatron-core 0.19 (``pretrain(cfg_container, train_valid_test_dataset_provider, model_type,
forward_step_func, model_provider=None, ...)``) through ``parse_and_validate_args(extra_args_provider=...)``,
which the script calls first. A script can do the same itself:

    from msprobe_integrations.megatron import add_args, compose
    provider = compose(my_provider, add_args)                  # flags in Megatron's args
    pretrain(..., extra_args_provider=provider)                 # older Megatron-LM, or:
    args = parse_and_validate_args(extra_args_provider=provider) # megatron-core 0.19's megatron.training
    install()                                                   # wrap train_step & setup

With megatron-core alone (no ``megatron.training``), drive ``MegatronProbe`` from your loop:
``probe.setup(model, optimizer, scheduler, args)``, ``probe.begin_iteration(n)`` before the
forward-backward schedule, ``probe.end_iteration()`` after the optimizer step (see
``recipes/megatron_core_gpt.py``). Under MindSpeed the same wrappers go through its patch manager
(``msprobe_integrations.megatron.mindspeed``).

Gradients, fp32 main parameters and Adam moments are read where Megatron's optimizers keep them
(``MegatronStateReader``: ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer`` shards, ``ChainedOptimizer``). Everything here is glue over
``msprobe_core.session.ProbeSession``.
"""

from msprobe_core.errors import require_installed

require_installed("megatron.core", "megatron", "msprobe_integrations.megatron")

from msprobe_integrations.megatron.args import FLAGS, add_args, compose, parse_known, with_msprobe_args  # noqa: E402
from msprobe_integrations.megatron.hooks import MegatronHooks, MegatronIntegrationError, install  # noqa: E402
from msprobe_integrations.megatron.probe import (MegatronProbe, capture_hyperparameters,  # noqa: E402,F401
                                                 num_microbatches, unwrap_chunks)
from msprobe_integrations.megatron.state_reader import MegatronStateReader, leaf_optimizers  # noqa: E402,F401

__all__ = ["add_args", "compose", "with_msprobe_args", "install", "MegatronHooks", "MegatronProbe",
           "MegatronIntegrationError"]

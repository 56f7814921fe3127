"""DeepSpeed integration: dump and monitor a ``DeepSpeedEngine`` under ZeRO stage 0, 1, 2 and 3 with one call.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    from msprobe_integrations.deepspeed import patch_engine
    engine = patch_engine(engine, config_path="dump.json", monitor_config_path="monitor.json")
    ...  # train as usual: engine(x), engine.backward(loss), engine.step()
    unpatch(engine)  # optional: original methods back, outputs flushed

or, as a drop-in for ``deepspeed.initialize``,
``engine, optimizer, _, _ = msprobe_integrations.deepspeed.initialize(model=..., config=..., config_path=...,
monitor_config_path=...)``.

- Dump: one dump step per optimizer step, named by ``engine.global_steps`` as it is while the step's
  micro-batches run (``step0`` holds the first accumulation window, as DeepSpeed counts). Every micro-batch
  of a gradient-accumulation window lands in that step: the window opens at the first ``engine(...)``
  (forward of ``engine.module``) and closes after ``engine.step()`` at the accumulation boundary
  (``engine.is_gradient_accumulation_boundary()``), so backward passes are inside it.
- Monitor: driven at the engine's optimizer step (``_take_model_step``, only called at the boundary):
  weights and gradients are read before the update (before gradient clipping, which ZeRO does inside its
  optimizer step and stage 0 just before it), optimizer states after it. They are read where the engine
  keeps them (``make_state_reader``): ``param.grad`` and ``optimizer.state[param]`` at stage 0; this rank's
  fragments of the fp32 master weights, the reduced gradient partitions and the partitioned Adam states at
  stage 1-2 (``param._hp_mapping``); the ``ds_tensor`` partitions (fp32 master, gradient and state
  partitions, padding cut off) at stage 3, where ``param.numel()`` is 0 outside gather windows. The
  monitor computes partial statistics of each rank's shards and all-reduces scalars over the data-parallel
  group (``msprobe_core.monitor.shard_stats``); nothing is gathered. Gradients the engine keeps multiplied by the
  fp16 loss scale are divided by it; with DeepSpeed's stage-0 fp16/bf16 optimizers weights and states are
  those of the fp32 master copies. Monitor steps are labelled with ``engine.global_steps`` like the dump.
- Collectives: every rank reaches the engine's optimizer step. When the monitor might collect on some ranks
  and not others (``module_ranks`` leaving out ranks of the group, ``dynamic_on``), the core's monitor has
  the ranks agree and lets a rank that does not collect contribute its shards
  (``msprobe_core.monitor.shard_agreement``), so no rank waits for another forever.
- Hyperparameters: the ds_config, zero stage, micro batch, accumulation, precision, optimizer and scheduler
  through ``msprobe_core.hparams.capture`` into ``hyperparameters.json`` (and TensorBoard).
- ``patch_engine`` is idempotent (a second call returns the engine unchanged) and ``unpatch`` reverses it.

For the Hugging Face Trainer (which steps the engine inside ``backward()``), this package provides the
``deepspeed`` engine follower (``trainer_bridge``) that ``ProbeSession.follow_engine`` loads. Modules:
``engine_patch`` (the entry points), ``engine`` (what the engine keeps where), ``zero_readers`` (stages 0-2),
``zero3_reader`` (ZeRO-3 partitions), ``hyperparameters``, ``trainer_bridge``. This package is glue:
statistics, files and rules live in ``msprobe_core``.
"""

from msprobe_core.errors import require_installed

require_installed("deepspeed", "deepspeed", "msprobe_integrations.deepspeed")

from msprobe_integrations.deepspeed.engine import DeepSpeedIntegrationError  # noqa: E402
from msprobe_integrations.deepspeed.engine_patch import get_patch, initialize, patch_engine, unpatch  # noqa: E402

__all__ = ["patch_engine", "unpatch", "initialize", "get_patch", "DeepSpeedIntegrationError"]

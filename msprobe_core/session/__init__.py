"""The integration API: ``ProbeSession`` is the one door every framework integration goes through.

An integration (the Hugging Face ``TrainerCallback``, the DeepSpeed engine patch, the Megatron flags, the
vLLM workers, or your own training loop) knows *when* things happen in its framework and *where* the
model, the optimizer and its states are; the session knows what to do then: run the dump
(``PrecisionDebugger``) over whole optimizer steps, drive the monitor (``TrainerMon``), keep the ranks of a
sharded group in the same collectives, and write the captured hyperparameters next to both outputs. It is
the extension point for a new framework, as ``transformers.TrainerCallback`` is for the Trainer: the
integration maps the framework's events onto the session's, and touches nothing else of the core.

Lifecycle (one process; the events of each optimizer step in this order)::

    session = ProbeSession(config_path="dump.json", monitor_config_path="monitor.json")
    session.attach(model, optimizer, grad_acc_steps=4, state_reader=reader)    # attach
    session.write_hyperparameters(doc)                                           # optional
    for step in steps:
        session.begin_step(step)              # step begin: dump every micro-batch into step{step}
        ...                                   # forward and backward of every micro-batch
        session.gradients_ready()             # gradients ready: reduced, not yet clipped (optional)
        session.before_optimizer_step()       # just before the update: weights, gradients
        optimizer.step()
        session.after_optimizer_step(step, skipped=overflowed)  # after it: states; the step is written, checked
        folder = session.end_step()           # step end: the step's dump files; the rank folder written
    session.close()                           # close: undo every patch, flush every file, let go of the model
    del model, optimizer                      # a multi-process run: release the framework's wrappers, then
    finish_distributed()                      # destroy the process groups (msprobe_core.pytorch.shutdown)

Events (methods of ``ProbeSession``):

- ``attach(model, optimizer=None, grad_acc_steps=1, state_reader=None, dp_group=None, start_iteration=0,
  *, patch_optimizer=False, step_label=None, step_skipped=None, rank_id=None)``: once the model (or its chunks) and the
  optimizer exist. Nothing before it records anything.
- ``begin_step(step=None, *, token_range=None)``: a dump step begins (all micro-batches of an optimizer
  step, or the generation steps of ``token_range``).
- ``gradients_ready(grads=None)``: the step's gradients are final; call it before gradient clipping to see
  them unclipped. Optional: ``before_optimizer_step`` reads them otherwise.
- ``before_optimizer_step()``: right before the optimizer update.
- ``after_optimizer_step(step=None, skipped=None)``: right after the update; returns the step's metrics
  (``api`` format). ``skipped=True``: the framework's loss scaler skipped the update (fp16 overflow); the
  monitor reports a skipped step (``TrainerMon.skipped_steps``, the database's ``skipped_steps`` table)
  instead of NaN/Inf anomalies of its gradients. Pass what the framework knows; None: not known.
- ``end_step() -> Path | None``: the dump step ends; its files are written.
- ``close()``: the end of training (or of the integration): idempotent.

Every rank calls the optimizer-step events at the same points, even a rank that monitors nothing: with a
sharded state reader they hold the collectives (``msprobe_core.monitor.shard_agreement``).

Options, for what the frameworks need:

- configs: a path, a dict of the file's content, or None (``ConfigLike``);

- process groups: ``ProbeSession(process_group=...)`` (pipeline stage of anomalies),
  ``attach(dp_group=...)`` / ``state_reader.group`` (where shard statistics are combined);
- ``ProbeSession(params_have_main_grad=...)``: read ``param.main_grad`` (Megatron) before ``param.grad``;
- optimizer patching: ``attach(patch_optimizer=True, step_label=..., step_skipped=...)`` wraps
  ``optimizer.step`` to run the three optimizer-step events itself (Megatron, plain loops);
- a state reader: ``attach(state_reader=...)`` or later ``set_state_reader(reader, dp_group)``
  (``StateReader``, below: DeepSpeed ZeRO, Megatron's optimizers);
- the folders it wrote: ``end_step()``, ``output_folders()``, ``dump_path``, ``dump_step``;
- another integration's engine: ``follow_engine(kind, current_step)``, and
  ``register_engine_follower(kind, follower)`` for a follower of one's own (``engine_followers``);
- evidence on alert: the monitor config's ``"on_anomaly": {"dump": {...}}`` makes the monitor of each rank
  that alerts at step s dump step s+1, scoped to the alerted module, under ``<monitor output>/captures/``
  (``msprobe_core.monitor.capture``); it follows the optimizer-step events, so every integration has it;
- ``ProbeSession(dump_path=...)`` overrides the dump config's ``dump_path``; ``attach(rank_id=...)`` names
  the dump's rank folder; ``on_anomaly(callback)``; ``write_hyperparameters(doc)``.

- the framework's own arguments for the config_check pack: ``record_framework_arguments(section, args)``
  (nothing without a config_check path).

To patch a framework's function or method, use ``msprobe_core.common.patch`` (``wrap`` / ``patch``): the
undo handle and the "never break training" guard come with it.

Building blocks (the only names of the core an integration uses besides ``msprobe_core.common.patch``,
``msprobe_core.errors``, ``msprobe_core.log`` and ``msprobe_core.hparams``; ``tests/msprobe_core/
test_import_direction.py`` holds every integration to it):

- optimizer states: ``StateReader`` (the abstract reader a framework's optimizer implements: which
  parameters, which states, a sharded group), ``TorchStateReader`` (``torch.optim``'s per-parameter
  ``state``), ``STATE_KINDS`` (optimizer state key -> monitor kind), ``EXP_AVG`` / ``EXP_AVG_SQ`` (the
  monitor's kinds of Adam's two moments);
- ranks, every one safe without an initialised ``torch.distributed``: ``dist_ready()``, ``current_rank()``
  (None when not distributed), ``rank_in(group)``, ``group_size(group)`` (``None``: the world);
- the dump config: ``load_dump_config(config, **overrides)`` (validated, nothing written; its
  ``dump_path``, ``rank`` list...), ``validate_token_range(token_range)`` (``TokenRangeError``);
- anomalies: ``NAN_RULE``, the ``rule`` of an anomaly record for a NaN/Inf value (``on_anomaly(callback)``);
- process end: ``close_at_exit(close)`` / ``cancel_close_at_exit(close)``: ``close`` runs at interpreter
  exit or at ``finish_distributed()``, whichever comes first.
"""

from msprobe_core.common.exit_close import cancel_close_at_exit, close_at_exit
from msprobe_core.dump.config import load_dump_config, validate_token_range
from msprobe_core.monitor.anomaly import NAN_RULE
from msprobe_core.monitor.records import EXP_AVG, EXP_AVG_SQ
from msprobe_core.monitor.state_readers import STATE_KINDS, StateReader, TorchStateReader
from msprobe_core.pytorch.ranks import current_rank, dist_ready, group_size, rank_in
from msprobe_core.pytorch.shutdown import finish_distributed
from msprobe_core.session.engine_followers import register_engine_follower
from msprobe_core.session.probe_session import ConfigLike, ProbeSession

__all__ = [
    "ConfigLike", "ProbeSession", "finish_distributed", "register_engine_follower",
    # building blocks for integrations
    "EXP_AVG", "EXP_AVG_SQ", "NAN_RULE", "STATE_KINDS", "StateReader", "TorchStateReader",
    "cancel_close_at_exit", "close_at_exit", "current_rank", "dist_ready", "group_size", "load_dump_config",
    "rank_in", "validate_token_range",
]

"""The training monitor (msprobe's ``monitor``): ``TrainerMon`` and its parts.

- ``trainer_mon``: ``TrainerMon``, the orchestrator (msprobe's user entry point, also
  ``msprobe_core.pytorch.TrainerMon``).
- Steps: ``step_state`` (the step in progress), ``step_triggers`` (the optimizer patches and hooks that
  begin and end steps), ``skipped_updates`` (an update a loss scaler skipped).
- Config and schedule: ``config`` (keys, validation), ``schedule`` (which steps, ``dynamic_on``).
- What is monitored: ``selection`` (targets), ``module_hooks`` (activations), ``state_recorder`` (the
  monitored parameters' weights, gradients and moments), ``state_readers`` (where gradients, weights and
  optimizer states live).
- Statistics: ``stats`` (batched device statistics, the kernel's host rows), ``collector`` (one host copy
  per step), ``gc_pause`` (the garbage collector held off while rows are made),
  ``shard_stats`` (sharded tensors, combined over a group), ``shard_agreement`` (which ranks of a sharded
  group take part in a step's collectives).
- Output: ``records`` (rows, kinds, stages), ``writers/`` (TensorBoard, CSV, in-memory), ``step_output``
  (a rank's writers).
- Alerts: ``rules/`` (NaN/Inf, turbulence, learning rate), ``detector`` (runs them over a step),
  ``events`` (one event per fault), ``anomaly`` (the event record and its order), ``alerts`` (log,
  callbacks, ``anomalies.json`` via ``anomaly_store``, the SQLite ``alert.inform`` via ``alert_db``),
  ``anomaly_cli`` (the ``anomalies`` command).

Framework-free pieces (importable without torch): ``config``, ``records``, ``anomaly``, ``anomaly_store``,
``anomaly_cli``, ``rules``, ``detector``, ``events``, ``alerts``, ``alert_db``, ``schedule``, ``writers``.

Output layout (``MONITOR_OUTPUT_DIR``, default ``./monitor_output``)::

    rank{R}/events.out.tfevents.*        format "tensorboard": tags {name}/{kind}_{op}, step = optimizer step
    rank{R}/{kind}_{first}-{last}.csv    format "csv": name,step,[micro_step,]<ops...>
    rank{R}/anomalies.json               alert.dump: true (one object per fault: origin, reached, last_step)
    rank{R}/module_struct.json           print_struct: true

Kinds: ``actv`` / ``actv_grad`` (module inputs and outputs, forward / their gradients; per micro-batch),
``grad`` (weight gradients), ``exp_avg`` / ``exp_avg_sq`` (optimizer moments; SGD's momentum buffer is
``exp_avg``), ``param`` (weights before the update).
"""

from msprobe_core.monitor.config import MonitorConfig, load_monitor_config

__all__ = ["MonitorConfig", "load_monitor_config"]

"""The training monitor core (msprobe's ``monitor``): config, statistics collection, writers, anomaly rules.

Framework-free pieces (importable without torch): ``config``, ``records``, ``anomaly``,
``anomaly_store``, ``anomaly_cli``, ``schedule``, ``writers``. Torch pieces: ``stats`` (batched device
statistics and the shard combine helper), ``collector``, ``module_hooks``, ``state_readers``,
``selection``, ``optimizer_patch``. The user entry point is ``msprobe_core.pytorch.monitor.TrainerMon``.

Output layout (``MONITOR_OUTPUT_DIR``, default ``./monitor_output``)::

    rank{R}/events.out.tfevents.*        format "tensorboard": tags {name}/{kind}_{op}, step = optimizer step
    rank{R}/{kind}_{first}-{last}.csv    format "csv": name,step,[micro_step,]<ops...>
    rank{R}/anomalies.json               alert.dump: true
    rank{R}/module_struct.json           print_struct: true

Kinds: ``actv`` / ``actv_grad`` (module inputs and outputs, forward / their gradients; per micro-batch),
``grad`` (weight gradients), ``exp_avg`` / ``exp_avg_sq`` (optimizer moments; SGD's momentum buffer is
``exp_avg``), ``param`` (weights before the update).
"""

from msprobe_core.monitor.config import MonitorConfig, load_monitor_config

__all__ = ["MonitorConfig", "load_monitor_config"]

"""Mixture-of-experts support of the training monitor.

* ``config`` (no torch): the ``moe`` config section and the MoE alert rules' arguments.
* ``experts``: per-expert statistics of fused expert tensors (HF transformers ``experts.gate_up_proj`` /
  ``experts.down_proj``, megatron-core ``GroupedMLP`` ``weight1``/``weight2``), all experts of a tensor in
  one set of reductions, and expert-indexed names for per-expert modules (megatron-core ``SequentialMLP``,
  ``TEGroupedMLP``, older HF ``experts.N``).
* ``routers``: router discovery and router health per MoE layer and step from the router's own outputs.
* ``router_writer``: the router series in CSV and TensorBoard.
* ``monitor``: ``MoEMonitor``, the one object ``TrainerMon`` talks to.

The alert rules are ``msprobe_core.monitor.rules.moe``; the report section is
``msprobe_core.report.moe_section``. This package's ``__init__`` imports nothing (``config`` is read by
the torch-free ``msprobe_core.monitor.config``).
"""

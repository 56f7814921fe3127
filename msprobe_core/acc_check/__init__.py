"""API accuracy pre-check (seed 002): replay every API call of an L1/mix dump on the tested device and
dtype, compare against a float64 CPU benchmark, and list the APIs that lose accuracy.

``python -m msprobe_core acc_check -api_info dump.json -o OUT`` (and ``multi_acc_check ... -d 0 1``); from
Python::

    from msprobe_core.acc_check import acc_check, multi_acc_check
    summary = acc_check("dump/step0/rank0/dump.json", "out")
    print(summary.failed)

Framework-neutral core: ``records`` (dump.json -> calls), ``inputs`` (seeded random inputs),
``standards`` (pass rules, documented there), ``results`` (the CSV files and resuming), ``runner``
(one process), ``workers`` (multi_acc_check) and ``fork_server`` (where its workers start from),
``progress``, ``replay_common`` (what every backend decides alike). Per framework, a replay backend chosen
by dump.json's "framework" field (``replay.BACKENDS``):
``pytorch_replay`` (pytorch) and ``mindspore_replay`` (mindspore, and mindtorch through MindSpore's
PyTorch-style ``mint`` API), each a module exposing ``make_backend(device_index, workers)`` whose backend has
``unreplayable(call)`` and ``replay(call, keep_data)``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["acc_check", "multi_acc_check"]


def __getattr__(name: str) -> Any:
    if name == "acc_check":
        from msprobe_core.acc_check.runner import acc_check
        return acc_check
    if name == "multi_acc_check":
        from msprobe_core.acc_check.workers import multi_acc_check
        return multi_acc_check
    raise AttributeError(name)

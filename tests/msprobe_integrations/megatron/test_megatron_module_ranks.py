"""Megatron's distributed optimizer with ``module_ranks`` naming part of the data-parallel group: two gloo
ranks run ``recipes/megatron_core_gpt.py`` with ``--use-distributed-optimizer`` and ``module_ranks: [0]``.

Rank 1 monitors nothing but holds half of every gradient, weight and moment shard: it must still take part
in the statistics all-reduces (``msprobe_core.monitor.shard_agreement``), or rank 0 waits for it forever
(before the agreement moved into the core, this run never finished its first iteration). Rank 0's
statistics are those of the full tensors: the same as when every rank monitors; rank 1 writes nothing."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from dist_run import torchrun  # noqa: E402
from megatron_support import ROOT, lm_losses  # noqa: E402

MONITOR = {"targets": {}, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
           "ops": ["min", "max", "norm", "mean", "nans"], "format": ["csv"]}


def _run(tmp_path: Path, name: str, config: dict) -> tuple[Path, list[str]]:
    """The recipe as two ranks with the distributed optimizer and the monitor ``config``; a rank waiting for
    the other in the monitor's statistics all-reduce fails the test after 240 s."""
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps(config))
    out = tmp_path / name
    stdout = torchrun(Path(ROOT) / "recipes" / "megatron_core_gpt.py", "--train-iters", "2",
                      "--use-distributed-optimizer", "--msprobe-monitor-config", str(cfg),
                      "--msprobe-monitor-output-dir", str(out), timeout=240, cwd=ROOT, env={"PYTHONWARNINGS": "ignore"})
    return out, lm_losses(stdout)


def _rows(path: Path) -> dict[str, dict[str, str]]:
    return {r["name"]: r for r in csv.DictReader(open(path))}


@pytest.mark.slow
@pytest.mark.distributed
def test_module_ranks_naming_part_of_the_data_parallel_group_does_not_hang(tmp_path):
    every, every_losses = _run(tmp_path, "every_rank", MONITOR)
    part, part_losses = _run(tmp_path, "rank0_only", dict(MONITOR, module_ranks=[0]))
    assert part_losses == every_losses and len(part_losses) == 2
    assert not (part / "rank1").exists()
    for step in (1, 2):
        for kind in ("grad", "param", "exp_avg", "exp_avg_sq"):
            name = f"{kind}_{step}-{step}.csv"
            assert _rows(part / "rank0" / name) == _rows(every / "rank0" / name), name

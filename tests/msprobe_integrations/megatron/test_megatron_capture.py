"""On-anomaly capture through the Megatron launch flags: ``--msprobe-monitor-config`` (a monitor config with
``on_anomaly.dump``) and ``--msprobe-monitor-output-dir`` make the probe; a NaN put into a weight of a real
megatron-core GPT (CPU, one rank) is alerted, the next iteration of its module is dumped, the capture opens
with the compare reader, and the losses equal those of the same run without the capture."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_support as ms  # noqa: E402

from msprobe_core.dumpdir.rank_dump import load_rank_dump  # noqa: E402
from msprobe_integrations.megatron import MegatronProbe, parse_known  # noqa: E402

MONITOR = {"xy_distribution": True, "ops": ["min", "max", "norm", "nans"], "format": ["csv"],
           "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}
PARAM = "decoder.layers.1.mlp.linear_fc1.weight"
FAULT_ITERATION = 2


def _train(probe: MegatronProbe, iterations: int = 4) -> list[str]:
    """Megatron's schedule and optimizer; a NaN in ``PARAM`` before iteration ``FAULT_ITERATION``."""
    from types import SimpleNamespace

    model = ms.wrap_ddp(ms.gpt_chunks(ms.transformer_config(), seed=0))
    optimizer = ms.megatron_optimizer(model, ms.optimizer_config())
    ms.set_schedule_hooks(model, optimizer)
    args = SimpleNamespace(num_layers=2, hidden_size=32, num_attention_heads=4, micro_batch_size=4,
                           global_batch_size=8, lr=1e-2, clip_grad=1.0, train_iters=iterations, bf16=False,
                           seq_length=ms.SEQ, iteration=0, use_distributed_optimizer=False)
    probe.setup(model, optimizer, None, args)
    param = dict(model[0].module.named_parameters())[PARAM]
    data = ms.batches(4, seed=1)
    losses = []
    try:
        for i in range(1, iterations + 1):
            if i == FAULT_ITERATION:
                with torch.no_grad():
                    param.view(-1)[7] = math.nan
            probe.begin_iteration(i)
            reduced = ms.forward_backward(model, optimizer, data)
            optimizer.step()
            probe.end_iteration()
            losses.append(repr(ms.reported_loss(reduced)))
    finally:
        probe.close()
    return losses


def _probe(tmp_path: Path, name: str, config: dict) -> MegatronProbe:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    args = parse_known(["--msprobe-monitor-config", str(path), "--msprobe-monitor-output-dir", str(tmp_path / name)])
    return MegatronProbe.from_args(args)  # what the launch flags make


@pytest.mark.slow
def test_the_megatron_flags_capture_the_next_iteration_of_the_alerted_module(megatron_cpu, tmp_path):
    ref = _probe(tmp_path, "ref", MONITOR)
    ref_losses = _train(ref)
    probe = _probe(tmp_path, "cap", dict(MONITOR, on_anomaly={"dump": {}}))
    losses = _train(probe)
    assert losses == ref_losses  # NaN from the fault on in both: repr keeps them comparable
    assert ref.session.monitor.anomalies[0].capture is None and not (tmp_path / "ref" / "captures").exists()

    alert = probe.session.monitor.anomalies[0]
    assert alert.step == FAULT_ITERATION and alert.module == "decoder.layers.1.mlp.linear_fc1"
    folder = Path(alert.capture)
    assert folder == (tmp_path / "cap" / "captures" / f"step{FAULT_ITERATION}_decoder.layers.1.mlp.linear_fc1" /
                      f"step{FAULT_ITERATION + 1}" / "rank0")
    dump = load_rank_dump(folder)  # the compare reader
    assert (dump.task, dump.level) == ("statistics", "L1") and dump.data
    norms = [arg["Norm"] for rec in dump.data.values() for args in rec.values() if isinstance(args, list)
             for arg in args if isinstance(arg, dict) and "Norm" in arg]
    assert any(math.isnan(n) for n in norms if isinstance(n, float))  # the NaN weight's work, seen in the capture
    record = json.loads((tmp_path / "cap" / "rank0" / "anomalies.json").read_text())[0]
    assert record["capture"] == str(folder)


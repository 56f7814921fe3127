"""The monitor under PyTorch's own sharding (FSDP2, FSDP1 with and without ``use_orig_params``, DTensor tensor
parallel) on two real gloo ranks: every rank writes the single-device statistics of each original parameter's
weight, gradient and Adam moments (rtol 1e-5), under the unwrapped name, and the losses are bit-identical
with the monitor on and off."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from dist_run import run_two_ranks
from native_sharding import FSDP2

WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from msprobe_core.session import finish_distributed
    from native_sharding import make_model, reference, shard, train
    from msprobe_core.monitor.trainer_mon import TrainerMon

    tmp, setup = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plain = train(shard(make_model(), setup), setup)
    model = shard(make_model(), setup)
    mon = TrainerMon(f"{tmp}/config.json", output_dir=f"{tmp}/out")
    got = []
    losses = train(model, setup, attach=lambda opt: mon.set_monitor(model, 1, opt),
                   after_step=lambda step: got.append(mon.get_metrics().get("metrics", {})))
    mon.close()
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump({"plain": plain, "losses": losses, "got": got, "want": reference()}, f)
    finish_distributed()
""")

KINDS = ("param", "grad", "exp_avg", "exp_avg_sq")
NAMES = {"0.weight", "0.bias", "2.weight", "2.bias"}


def run_setup(tmp_path: Path, setup: str) -> list[dict]:
    (tmp_path / "config.json").write_text(json.dumps({
        "xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
        "ops": ["min", "max", "norm", "mean"], "format": ["api", "csv"]}))
    run_two_ranks(WORKER, tmp_path, str(tmp_path), setup, timeout=240, name="worker.py")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def assert_single_device_statistics(result: dict) -> None:
    assert result["losses"] == result["plain"]  # bit-identical with the monitor on and off
    for got, want in zip(result["got"], result["want"]):
        for kind in KINDS:
            assert set(got[kind]) == NAMES, (kind, sorted(got[kind]))
            for name in NAMES:
                for op, value in want[kind][name].items():
                    assert got[kind][name][op] == pytest.approx(value, rel=1e-5, abs=1e-7), (kind, name, op)
        assert got["actv"], "activations are monitored as well"


@pytest.mark.distributed
@pytest.mark.parametrize("setup", [FSDP2, "tp", "fsdp1_orig", "fsdp1_flat"])
def test_monitor_gives_single_device_statistics(tmp_path, setup):
    results = run_setup(tmp_path, setup)
    for result in results:
        assert_single_device_statistics(result)
    assert results[0]["got"][-1]["grad"] == results[1]["got"][-1]["grad"]
    assert any((tmp_path / "out" / "rank1").glob("grad*.csv"))


PARTIAL_WORKER = textwrap.dedent("""
    import json, logging, sys
    import torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial
    from msprobe_core.session import finish_distributed
    from native_sharding import make_model, shard
    from msprobe_core.monitor.trainer_mon import TrainerMon

    tmp = sys.argv[1]
    dist.init_process_group("gloo")
    model = shard(make_model(), "tp")
    warnings = []
    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger("msprobe_core.monitor").addHandler(Keep())
    mon = TrainerMon({"wg_distribution": True, "format": ["api"]}, output_dir=f"{tmp}/out").set_monitor(model)
    got = []
    for _ in range(2):
        model.zero_grad()
        model(torch.ones(2, 16)).sum().backward()
        bias = model[2].bias  # a pending sum cannot be read from its pieces
        bias.grad = DTensor.from_local(bias.grad.to_local(), bias.device_mesh, [Partial()])
        got.append(mon.step())
    mon.close()
    with open(f"{tmp}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({"got": [sorted(g["metrics"]["grad"]) for g in got],
                   "warnings": [w for w in warnings if "Partial" in w]}, f)
    finish_distributed()
""")


@pytest.mark.distributed
def test_a_tensor_the_monitor_cannot_read_is_reported_once_and_skipped(tmp_path):
    run_two_ranks(PARTIAL_WORKER, tmp_path, str(tmp_path), timeout=240, name="worker.py")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["got"] == [["0.bias", "0.weight", "2.weight"]] * 2
        assert len(result["warnings"]) == 1 and "2.bias" in result["warnings"][0]

"""Sharded optimizer state (DeepSpeed ZeRO style): two gloo ranks each hold half of every gradient and
moment; the monitor combines per-shard scalars over the group, so both ranks write the statistics of the
full tensors. With ``module_ranks`` naming only rank 0, rank 1 still contributes its shards to the
all-reduces (``msprobe_core.monitor.shard_agreement``) and writes nothing, and neither rank waits forever."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from dist_run import run_two_ranks

WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from msprobe_core.session import finish_distributed
    from msprobe_core.monitor.state_readers import StateReader
    from msprobe_core.monitor.trainer_mon import TrainerMon

    tmp, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def shard(t):  # this rank's piece of the flattened tensor (rank 1 of a 1-element tensor gets nothing)
        return t.detach().flatten().tensor_split(world)[rank]

    class HalfReader(StateReader):
        sharded = True
        def grads(self, params):
            return {n: shard(p.grad) for n, p in params.items() if p.grad is not None}
        def weights(self, params):
            return {n: shard(p) for n, p in params.items()}
        def optimizer_states(self, optimizer, params):
            out = {}
            for n, p in params.items():
                for key in ("exp_avg", "exp_avg_sq"):
                    out.setdefault(key, {})[n] = shard(optimizer.state[p][key])
            return out

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = TrainerMon(f"{tmp}/config.json", output_dir=f"{tmp}/out", state_reader=HalfReader())
    mon.set_monitor(model, 1, opt, dp_group=None)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))

    def ref(t):
        t = t.double()
        return {"min": t.min().item(), "max": t.max().item(), "norm": t.norm().item(), "mean": t.mean().item()}

    results = []
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        full = {n: p.grad.clone() for n, p in model.named_parameters()}
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        moments = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in model.named_parameters()}
        results.append({"got": mon.get_metrics().get("metrics", {}), "grad": {n: ref(t) for n, t in full.items()},
                        "param": {n: ref(t) for n, t in weights.items()},
                        "exp_avg_sq": {n: ref(t) for n, t in moments.items()}})
    mon.close()
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    finish_distributed()
""")


KINDS = ("grad", "param", "exp_avg_sq")


def run_workers(tmp_path: Path, steps: int, **config) -> list[list[dict]]:
    """Both ranks' results per step; a hang (a rank waiting for the other) fails instead of blocking."""
    (tmp_path / "config.json").write_text(json.dumps({
        "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
        "ops": ["min", "max", "norm", "mean"], "format": ["api", "csv"], **config}))
    run_two_ranks(WORKER, tmp_path, str(tmp_path), str(steps), timeout=180, name="worker.py")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def assert_full_tensor_statistics(step: dict) -> None:
    for kind in KINDS:
        assert set(step["got"][kind]) == set(step[kind]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for name, want in step[kind].items():
            for op, value in want.items():
                assert step["got"][kind][name][op] == pytest.approx(value, rel=1e-5, abs=1e-8), (kind, name, op)


@pytest.mark.distributed
def test_sharded_reader_statistics_are_combined_across_ranks(tmp_path):
    results = run_workers(tmp_path, steps=1)
    for res in results:
        assert_full_tensor_statistics(res[0])
    assert results[0][0]["got"] == results[1][0]["got"]
    assert (tmp_path / "out" / "rank1" / "grad_0-0.csv").exists()


@pytest.mark.distributed
def test_a_rank_left_out_by_module_ranks_contributes_its_shards(tmp_path):
    rank0, rank1 = run_workers(tmp_path, steps=3, module_ranks=[0])
    for step in rank0:
        assert_full_tensor_statistics(step)
    assert [step["got"] for step in rank1] == [{}, {}, {}]
    assert (tmp_path / "out" / "rank0" / "grad_2-2.csv").exists() and not (tmp_path / "out" / "rank1").exists()

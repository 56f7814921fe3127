"""DeepSpeed MoE (``deepspeed.moe.layer.MoE``, ``TopKGate`` top-2 with a capacity, 4 experts) with real
``deepspeed.initialize`` on the CPU (gloo), through ``msprobe_integrations.deepspeed.initialize``:

* the gate is found by itself; its router health per step equals what plain hooks saw it compute (its routes:
  load and dropped routes; its input times its weight: the softmax entropy), and the losses are bit-identical;
* the experts' parameters, gradients and Adam states are written per expert under global indices, under
  ZeRO 0 and (sharded) ZeRO-2 alike;
* expert parallelism: ep_size 2 on two ranks (ZeRO-2; experts 0-1 on rank 0, 2-3 on rank 1) writes, on every
  rank, every expert's series equal (rtol 1e-5) to a one-process ep_size-1 run whose two micro-batches per
  step are the two ranks' batches; the router's load is summed over the expert-parallel group and equals that
  run's (each rank routes its own tokens).

The runs happen in subprocesses (``ds_moe_run.py``), once per module."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from dist_run import free_port, torchrun  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_moe_run  # noqa: E402
import ds_support  # noqa: E402

pytestmark = pytest.mark.slow
GATE = "moe.deepspeed_moe.gate"
EXPERT_PARAMS = [f"moe.deepspeed_moe.experts.{p}" for p in ("0.weight", "0.bias", "2.weight", "2.bias")]
KINDS = ("param", "grad", "exp_avg", "exp_avg_sq")
OPS = ("min", "max", "norm", "mean")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_moe") / "out.json"
    return ds_support.run_single("single", out, free_port(), script=ds_moe_run.__file__)


def _two_ranks(tmp_path_factory, scenario: str) -> list[dict]:
    """Both ranks' results of ``ds_moe_run.py`` ``scenario`` under torchrun."""
    out = tmp_path_factory.mktemp(f"ds_moe_{scenario}") / "out.json"
    torchrun(ds_moe_run.__file__, scenario, str(out), timeout=420, cwd=ds_support.ROOT,
             env={"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"})
    return [json.loads(out.with_name(f"out.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def ep(tmp_path_factory):
    return _two_ranks(tmp_path_factory, "ep")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-8)


@pytest.mark.parametrize("stage", [0, 2])
def test_gate_found_router_health_equals_its_outputs_losses_unchanged(single, stage):
    run = single[f"z{stage}"]
    assert run["losses"] == run["ref_losses"]
    assert len(run["metrics"]) == ds_moe_run.STEPS == len(run["spy"])
    for metrics, seen in zip(run["metrics"], run["spy"]):
        router = metrics["metrics"]["router"][GATE]
        assert [router[f"load.{e}"] for e in range(ds_moe_run.EXPERTS)] == seen["load"]
        assert router["dropped_tokens"] == seen["dropped"]
        assert sum(seen["load"]) + seen["dropped"] == 2 * seen["tokens"]  # top-2: every route is kept or dropped
        assert router["entropy"] == pytest.approx(seen["entropy_sum"] / seen["tokens"], rel=1e-5)
        assert {"imbalance_max_mean", "imbalance_cv", "router_cos_max", "router_cos_mean"} <= set(router)


@pytest.mark.parametrize("stage", [0, 2])
def test_experts_written_per_expert_with_global_indices(single, stage):
    run = single[f"z{stage}"]
    last = run["metrics"][-1]["metrics"]
    for kind in KINDS:
        names = set(last[kind])
        assert {f"{p}.{e}" for p in EXPERT_PARAMS for e in range(ds_moe_run.EXPERTS)} <= names, kind
        assert not any("deepspeed_experts" in n for n in names)
    assert run["optimizer"] == ("DeepSpeedZeroOptimizer" if stage else "AdamW")


def test_zero2_sharded_per_expert_optimizer_states_equal_zero0(single):
    for z0, z2 in zip(single["z0"]["metrics"], single["z2"]["metrics"]):
        for kind in KINDS:
            for name, row in z0["metrics"][kind].items():
                if ".experts." in name:
                    assert all(_close(z2["metrics"][kind][name][op], row[op]) for op in OPS), (kind, name)


def test_expert_parallel_two_ranks_equal_the_one_process_run(single, ep):
    ref = single["ep_ref"]["metrics"]
    expert_rows = 0
    for rank in ep:
        assert len(rank["metrics"]) == len(ref) == ds_moe_run.STEPS
        for mine, want in zip(rank["metrics"], ref):
            mine, want = mine["metrics"], want["metrics"]
            # the router: each rank routes its own tokens; the loads are summed over the expert-parallel group
            assert mine["router"][GATE]["entropy"] == pytest.approx(want["router"][GATE]["entropy"], rel=1e-5)
            for key, value in want["router"][GATE].items():
                if key.startswith("load.") or key == "dropped_tokens":
                    assert mine["router"][GATE][key] == value, key
            for kind in KINDS:
                names = {n for n in want[kind] if ".experts." in n}
                assert names == {n for n in mine[kind] if ".experts." in n}  # every expert, on every rank
                for name in names:
                    expert_rows += 1
                    assert all(_close(mine[kind][name][op], want[kind][name][op]) for op in OPS), (kind, name)
    assert expert_rows == 2 * ds_moe_run.STEPS * len(KINDS) * len(EXPERT_PARAMS) * ds_moe_run.EXPERTS


@pytest.mark.parametrize("sparse", [True, False])
def test_gate_routes_read_from_either_output_form(tmp_path, sparse):
    """DeepSpeed's ``TopKGate`` returns sparse routes (``indices [k, T]``, -1 = dropped; what ``MOELayer`` asks
    for) or, with ``sparse_routes=False`` (older DeepSpeed's only form), a dense ``dispatch_mask [T, E, C]``:
    both give the same load and dropped routes, equal to the routes the gate returned; the gate itself is
    unchanged by the tap (same outputs with and without it)."""
    import torch
    from deepspeed.moe.sharded_moe import TopKGate

    from msprobe_core.monitor.trainer_mon import TrainerMon

    torch.manual_seed(0)
    gate = TopKGate(16, 4, k=2, capacity_factor=1.0, min_capacity=2, top2_2nd_expert_sampling=False)
    x = torch.randn(24, 16)
    plain = gate(x, None, sparse)
    mon = TrainerMon({"format": "api"}, output_dir=tmp_path)
    mon.set_monitor(gate, optimizer=torch.optim.SGD(gate.parameters(), lr=0.0))
    out = gate(x, None, sparse)
    mon.step()
    got = mon.get_metrics()["metrics"]["router"]["model"]
    mon.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, out) if isinstance(a, torch.Tensor))
    routes = gate(x, None, True)[3].long().reshape(-1)
    assert [got[f"load.{e}"] for e in range(4)] == torch.bincount(routes[routes >= 0], minlength=4).tolist()
    assert got["dropped_tokens"] == int((routes < 0).sum()) > 0
    p = torch.softmax(torch.nn.functional.linear(x, gate.wg.weight.detach()), -1)
    assert got["entropy"] == pytest.approx(float(torch.special.entr(p).sum(-1).mean()), rel=1e-5)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return _two_ranks(tmp_path_factory, "fused")


@pytest.mark.parametrize("stage", [2, 3])
def test_fused_experts_split_from_zero_shards_equal_zero0(fused, stage):
    """A fused expert tensor (transformers 5 layout, ``[5, 7, 9]``) under ZeRO-2 (flat fragments) and ZeRO-3
    (partitions) on two ranks, whose pieces cut it inside an expert: each expert's weight, gradient and Adam rows,
    split from the pieces and combined over the ranks, equal ZeRO 0's (full tensors) on both ranks, every step."""
    experts = {"experts.down_proj"} | {f"experts.down_proj.{e}" for e in range(5)}
    _assert_experts_equal_zero0(fused, stage, experts)


def _assert_experts_equal_zero0(results: list[dict], stage: int, experts: set[str]) -> None:
    want_optimizer = {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}[stage]
    for rank in results:
        sharded = rank[f"z{stage}"]
        assert sharded["optimizer"] == want_optimizer and rank["z0"]["losses"] == sharded["losses"]
        assert len(sharded["metrics"]) == ds_moe_run.STEPS
        for z0, zs in zip(rank["z0"]["metrics"], sharded["metrics"]):
            for kind in KINDS:
                assert experts <= set(z0["metrics"][kind]) and experts <= set(zs["metrics"][kind]), kind
                for name in experts:
                    want, got = z0["metrics"][kind][name], zs["metrics"][kind][name]
                    assert all(_close(got[op], want[op]) for op in OPS), (rank["rank"], kind, name)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return _two_ranks(tmp_path_factory, "hf")


def test_hf_qwen3_moe_experts_under_zero3_equal_zero0(hf):
    """A tiny HF Qwen3-MoE (fused ``experts.gate_up_proj`` ``[5, 16, 16]``, ``experts.down_proj`` ``[5, 16, 8]``)
    under ZeRO-3 on two ranks (each partition ends inside an expert): every expert's weight, gradient and Adam
    rows equal ZeRO 0's on both ranks, every step, and the losses are the same."""
    head = "model.layers.0.mlp.experts"
    experts = {f"{head}.{p}" for p in ("gate_up_proj", "down_proj")}
    _assert_experts_equal_zero0(hf, 3, experts | {f"{n}.{e}" for n in experts for e in range(5)})

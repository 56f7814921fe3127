"""megatron-core ``MoELayer`` (8 experts, top-2, ``SequentialMLP`` experts, ``TopKRouter`` with a capacity)
monitored through the recipe's Megatron launch flags on the CPU: expert-indexed names of the per-expert
modules, router health per layer with dropped tokens, no MoE alert in 40 healthy iterations, losses unchanged.

megatron-core's ``GroupedMLP`` (fused experts) cannot run here (its forward needs the CUDA ``grouped_gemm``
package): it is built (its weights only) and its per-expert rows are checked against the expert views its
forward takes. The ``alltoall`` dispatcher needs a CUDA stream (``recipes/megatron_cpu.py``)."""

from __future__ import annotations

import csv
import json
import math
import os
import sys

import pytest

pytest.importorskip("megatron.core")
import megatron_support as ms  # noqa: E402
from dist_run import torchrun  # noqa: E402

ITERS = 40
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-expert-capacity-factor", "1.5", "--lr", "1e-3",
       "--micro-batch-size", "4", "--global-batch-size", "4"]
MONITOR = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "format": ["csv"],
           "alert": {"rules": [{"rule_name": "ExpertStarvation"}, {"rule_name": "ImbalanceJump"},
                               {"rule_name": "EntropyCollapse"}], "dump": True}}


@pytest.mark.slow
def test_megatron_moe_router_health_expert_names_no_false_alert_losses_unchanged(tmp_path):
    cmd = [sys.executable, "recipes/megatron_core_gpt.py", "--train-iters", str(ITERS)] + MOE
    plain = ms.run_child(cmd)
    assert plain.returncode == 0, plain.stderr[-3000:]
    cfg = tmp_path / "monitor.json"
    cfg.write_text(json.dumps(MONITOR))
    mon = tmp_path / "mon"
    probed = ms.run_child(cmd + ["--msprobe-monitor-config", str(cfg), "--msprobe-monitor-output-dir", str(mon)])
    assert probed.returncode == 0, probed.stderr[-3000:]
    assert ms.lm_losses(probed.stdout) == ms.lm_losses(plain.stdout) and len(ms.lm_losses(plain.stdout)) == ITERS
    rank = mon / "rank0"
    assert not list(rank.glob("anomalies*.json")), "an MoE alert on a healthy run"
    with open(rank / "moe_router.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for layer in ("decoder.layers.0.mlp.router", "decoder.layers.1.mlp.router"):
        mine = [r for r in rows if r["name"] == layer]
        assert [int(r["step"]) for r in mine if r["metric"] == "entropy"] == list(range(1, ITERS + 1))
        first = {r["metric"]: float(r["value"]) for r in mine if r["step"] == "1"}
        routed = sum(first[f"load.{e}"] for e in range(8))
        # one micro-batch of 4 sequences x 16 tokens, top-2: each assignment is routed or dropped over capacity
        assert routed + first["dropped_tokens"] == 4 * 16 * 2 and first["dropped_tokens"] >= 0
        assert {"imbalance_max_mean", "imbalance_cv", "router_cos_max", "router_cos_mean"} <= set(first)
    with open(next(rank.glob(f"grad_{ITERS}-*.csv")), newline="") as f:
        names = {r["name"] for r in csv.DictReader(f)}
    assert {f"decoder.layers.1.mlp.experts.linear_fc1.weight.{e}" for e in range(8)} <= names
    assert not any(".local_experts." in n for n in names)


@pytest.fixture
def megatron_cpu(monkeypatch):
    # megatron-core 0.19 dropped GroupedMLP (and grouped_gemm_util) for TEGroupedMLP, which needs Transformer
    # Engine: this test runs where GroupedMLP exists (megatron-core 0.16.1 in `make test`)
    gg = pytest.importorskip("megatron.core.transformer.moe.grouped_gemm_util",
                             reason="GroupedMLP is gone from this megatron-core (0.19 has only TEGroupedMLP)")

    # GroupedMLP's forward needs the CUDA grouped_gemm package; building it (its weights) does not
    monkeypatch.setattr(gg, "assert_grouped_gemm_is_available", lambda: None)
    with ms.megatron_on_cpu():
        yield


def test_grouped_mlp_weights_split_as_its_forward_reads_them(megatron_cpu, tmp_path):
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import GroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from msprobe_core.monitor.trainer_mon import TrainerMon

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24,
                            use_cpu_initialization=True, num_moe_experts=4, moe_grouped_gemm=True, add_bias_linear=False)
    experts = GroupedMLP(4, cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    mon = TrainerMon({"param_distribution": True, "format": "api", "ops": ["min", "max", "norm", "mean"]},
                     output_dir=tmp_path)
    mon.set_monitor(experts, optimizer=torch.optim.SGD(experts.parameters(), lr=0.1))
    mon.step()
    rows = mon.get_metrics()["metrics"]["param"]
    mon.close()
    # megatron-core's GroupedMLP.forward: w1 = weight1.view(E, hidden, -1), w2 = weight2.view(E, -1, hidden)
    views = {"weight1": experts.weight1.view(4, 16, -1), "weight2": experts.weight2.view(4, -1, 16)}
    for name, w in views.items():
        for e in range(4):
            got = rows[f"{name}.{e}"]
            assert got["norm"] == pytest.approx(float(w[e].norm()), rel=1e-5)
            assert (got["min"], got["max"]) == (float(w[e].min()), float(w[e].max()))
            assert got["mean"] == pytest.approx(float(w[e].mean()), rel=1e-4, abs=1e-7)


@pytest.fixture
def megatron_router():
    with ms.megatron_on_cpu():
        yield


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_entropy_uses_the_routers_score_function(megatron_router, tmp_path, score):
    """megatron-core ``TopKRouter`` with ``moe_router_score_function`` softmax or sigmoid (DeepSeek-V3 style): the
    entropy is that of the router's own probabilities (sigmoid scores normalised over the experts)."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from msprobe_core.monitor.module_hooks import ROOT_NAME
    from msprobe_core.monitor.trainer_mon import TrainerMon

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24,
                            use_cpu_initialization=True, num_moe_experts=8, moe_router_topk=2,
                            moe_router_score_function=score, moe_router_load_balancing_type="none")
    torch.manual_seed(0)
    router = TopKRouter(cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    mon = TrainerMon({"format": "api"}, output_dir=tmp_path)
    mon.set_monitor(router, optimizer=torch.optim.SGD(router.parameters(), lr=0.0))
    x = torch.randn(12, 2, 16)  # [sequence, batch, hidden]
    probs, routing_map = router(x)
    mon.step()
    got = mon.get_metrics()["metrics"]["router"][ROOT_NAME]
    mon.close()
    logits = router.gating(x).detach().reshape(-1, 8).double()
    p = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, True)
    assert got["entropy"] == pytest.approx(float(torch.special.entr(p).sum(-1).mean()), rel=1e-5)
    assert [got[f"load.{e}"] for e in range(8)] == routing_map.reshape(-1, 8).sum(0).tolist()


def _rows(path) -> dict[str, dict[str, float]]:
    with open(path, newline="") as f:
        return {r["name"]: {k: float(v) for k, v in r.items() if k not in ("name", "step")} for r in csv.DictReader(f)}


@pytest.mark.slow
@pytest.mark.distributed
def test_per_expert_optimizer_states_under_the_distributed_optimizer_equal_the_full_ones(tmp_path):
    """Two data-parallel ranks, MoE (4 ``SequentialMLP`` experts, top-2): with the distributed optimizer each
    expert's weights, gradients and Adam states are shards combined over the ranks; their per-expert rows equal
    the non-distributed optimizer's, on both ranks. A router's weight is not split into per-expert rows."""
    cfg = tmp_path / "monitor.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
                               "ops": ["min", "max", "norm", "mean"], "format": ["csv"]}))
    for name, extra in (("full", []), ("sharded", ["--use-distributed-optimizer"])):
        torchrun(os.path.join(ms.ROOT, "recipes", "megatron_core_gpt.py"), "--train-iters", "2", "--num-experts", "4",
                 "--moe-router-topk", "2", "--msprobe-monitor-config", str(cfg), "--msprobe-monitor-output-dir",
                 str(tmp_path / name), *extra, timeout=300, cwd=ms.ROOT, env={"PYTHONWARNINGS": "ignore"})
    for kind in ("grad", "param", "exp_avg", "exp_avg_sq"):
        full = _rows(tmp_path / "full" / "rank0" / f"{kind}_2-2.csv")
        experts = {f"decoder.layers.{n}.mlp.experts.linear_fc{fc}.weight.{e}" for n in (0, 1) for fc in (1, 2)
                   for e in range(4)}
        assert experts <= full.keys() and not any(".router.weight." in n for n in full), kind
        for rank in (0, 1):
            sharded = _rows(tmp_path / "sharded" / f"rank{rank}" / f"{kind}_2-2.csv")
            assert sharded.keys() == full.keys()
            for name in experts:
                for op, v in full[name].items():
                    assert math.isclose(sharded[name][op], v, rel_tol=2e-5, abs_tol=1e-9), (kind, name, op)


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_two_ranks_equal_the_one_rank_run(tmp_path):
    """megatron-core ``expert_model_parallel_size=2`` on two gloo ranks (4 ``SequentialMLP`` experts, top-2,
    ``allgather`` dispatcher; ``megatron_ep_run.py``) against one rank with ``expert_model_parallel_size=1`` whose
    two micro-batches per iteration are the two ranks' batches (same initial weights). Each rank writes its own
    experts under their global indices, equal to the one-rank run's (rtol 1e-5; abs 1e-7 for gradients of about
    1e-3 whose float32 sums run in another order); every rank writes every router's load summed over the
    expert-parallel group (each rank routes its own tokens), equal to the one-rank run's."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_ep_run.py")
    env = {"PYTHONWARNINGS": "ignore"}
    torchrun(script, "ref", str(tmp_path), nproc=1, timeout=300, cwd=ms.ROOT, env=env)
    torchrun(script, "ep", str(tmp_path), nproc=2, timeout=300, cwd=ms.ROOT, env=env)
    ref = json.loads((tmp_path / "ref.rank0.json").read_text())["metrics"]
    ranks = [json.loads((tmp_path / f"ep.rank{r}.json").read_text())["metrics"] for r in (0, 1)]
    experts = {r: {f"decoder.layers.{n}.mlp.experts.linear_fc{fc}.weight.{e}" for n in (0, 1) for fc in (1, 2)
                   for e in (2 * r, 2 * r + 1)} for r in (0, 1)}
    for step, want in enumerate(ref):
        want = want["metrics"]
        for r in (0, 1):
            mine = ranks[r][step]["metrics"]
            for layer, health in want["router"].items():
                got = mine["router"][layer]
                assert [got[f"load.{e}"] for e in range(4)] == [health[f"load.{e}"] for e in range(4)]
                assert got["entropy"] == pytest.approx(health["entropy"], rel=1e-5)
            for kind in ("param", "grad", "exp_avg", "exp_avg_sq"):
                assert {n for n in mine[kind] if ".experts." in n} == experts[r], (kind, r)
                for name in experts[r]:
                    for op, v in want[kind][name].items():
                        assert math.isclose(mine[kind][name][op], v, rel_tol=1e-5, abs_tol=1e-7), (step, kind, name, op)


GROUPED = [f"decoder.layers.{n}.mlp.experts.weight{w}" for n in (0, 1) for w in (1, 2)]
"""The fused ``GroupedMLP`` weights of ``megatron_ep_run.py``'s ``g*`` modes (4 experts each)."""


def _ep_run(tmp_path, mode: str, nproc: int = 2) -> list[dict]:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_ep_run.py")
    torchrun(script, mode, str(tmp_path), nproc=nproc, timeout=300, cwd=ms.ROOT, env={"PYTHONWARNINGS": "ignore"})
    return [json.loads((tmp_path / f"{mode}.rank{r}.json").read_text()) for r in range(nproc)]


def _assert_rows_equal(got: dict, want: dict, names, where) -> None:
    for kind in ("param", "grad", "exp_avg", "exp_avg_sq"):
        for name in names:
            for op, v in want[kind][name].items():
                assert math.isclose(got[kind][name][op], v, rel_tol=1e-5, abs_tol=1e-7), (where, kind, name, op)


@pytest.fixture(scope="module")
def grouped_ref(tmp_path_factory):
    """The one-rank GroupedMLP run (``gref``) and its folder, where the two-rank runs find its initial weights."""
    pytest.importorskip("megatron.core.transformer.moe.grouped_gemm_util",
                        reason="GroupedMLP is gone from this megatron-core (0.19 has only TEGroupedMLP)")
    tmp = tmp_path_factory.mktemp("grouped")
    return tmp, _ep_run(tmp, "gref", nproc=1)[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_grouped_mlp_under_the_distributed_optimizer_equals_the_one_rank_run(grouped_ref):
    """Fused ``GroupedMLP`` experts (``weight1`` ``[h, 4*f]``, ``weight2`` ``[4*f, h]``) with the distributed optimizer
    on two data-parallel ranks, whose ranges cut ``decoder.layers.0.mlp.experts.weight2`` inside expert 0: every
    expert's weight, gradient and Adam rows (and the whole tensors'), on both ranks and every iteration, equal
    those of the one-rank run whose two micro-batches are the two ranks' batches (rtol 1e-5)."""
    tmp, ref = grouped_ref
    ranks = _ep_run(tmp, "gdo")
    per = 32 * 64  # elements of one expert (hidden 32, ffn 64)
    starts = [p[0] for result in ranks for p in result["pieces"].values() if p[1] > p[0]]
    assert any(s % per for s in starts), ranks[1]["pieces"]  # a rank's range starts inside an expert
    names = GROUPED + [f"{n}.{e}" for n in GROUPED for e in range(4)]
    for r, result in enumerate(ranks):
        for step, (got, want) in enumerate(zip(result["metrics"], ref["metrics"])):
            _assert_rows_equal(got["metrics"], want["metrics"], names, (r, step))


@pytest.mark.slow
@pytest.mark.distributed
def test_grouped_mlp_expert_parallel_with_the_distributed_optimizer(grouped_ref):
    """Fused ``GroupedMLP`` experts, ``expert_model_parallel_size=2`` (experts 0-1 on rank 0, 2-3 on rank 1) and the
    distributed optimizer (its expert part shards over the expert data-parallel group, the rest over both
    ranks): every rank writes every expert's rows. At the first iteration (the same weights as the one-rank run)
    they equal the one-rank run's, and so do the whole tensors' (all four experts). At every iteration they equal
    those of the same expert-parallel run with the Megatron optimizer (whole tensors, combined over the
    expert-parallel group), which computes the same numbers; the one-rank run's later iterations differ by the
    float32 order of the expert-parallel gradient sums (up to ~3e-5)."""
    tmp, ref = grouped_ref
    sharded, plain = _ep_run(tmp, "gepdo"), _ep_run(tmp, "gep")
    experts = [f"{n}.{e}" for n in GROUPED for e in range(4)]
    for r in (0, 1):
        assert sharded[r]["losses"] == plain[r]["losses"]
        _assert_rows_equal(sharded[r]["metrics"][0]["metrics"], ref["metrics"][0]["metrics"], experts + GROUPED, r)
        for step, (got, want) in enumerate(zip(sharded[r]["metrics"], plain[r]["metrics"])):
            _assert_rows_equal(got["metrics"], want["metrics"], experts, (r, step))


@pytest.mark.slow
@pytest.mark.distributed
def test_recipe_expert_parallel_flag_with_the_distributed_optimizer(tmp_path):
    """The recipe's ``--expert-model-parallel-size 2`` on two gloo ranks (4 ``SequentialMLP`` experts, the distributed
    optimizer): the losses are bit-identical with the monitor on and off, every rank writes every expert's weight,
    gradient and Adam rows (the same numbers on both ranks: each expert's shards combined over the ranks), and the
    router loads count every rank's routes (per rank: 2 micro-batches of 4 sequences x 16 tokens, top-2)."""
    cfg = tmp_path / "monitor.json"
    cfg.write_text(json.dumps({"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
                               "ops": ["min", "max", "norm", "mean"], "format": ["csv"]}))
    cmd = [os.path.join(ms.ROOT, "recipes", "megatron_core_gpt.py"), "--train-iters", "2", "--num-experts", "4",
           "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    env = {"PYTHONWARNINGS": "ignore"}
    plain = torchrun(*cmd, timeout=300, cwd=ms.ROOT, env=env)
    mon = tmp_path / "mon"
    probed = torchrun(*cmd, "--msprobe-monitor-config", str(cfg), "--msprobe-monitor-output-dir", str(mon),
                      timeout=300, cwd=ms.ROOT, env=env)
    assert ms.lm_losses(probed) == ms.lm_losses(plain) and len(ms.lm_losses(plain)) == 2
    experts = {f"decoder.layers.{n}.mlp.experts.linear_fc{fc}.weight.{e}" for n in (0, 1) for fc in (1, 2)
               for e in range(4)}
    for kind in ("grad", "param", "exp_avg", "exp_avg_sq"):
        rows = [_rows(mon / f"rank{r}" / f"{kind}_2-2.csv") for r in (0, 1)]
        assert experts <= rows[0].keys() and experts <= rows[1].keys(), kind
        for name in experts:
            assert rows[0][name] == pytest.approx(rows[1][name], rel=1e-6), (kind, name)
    with open(mon / "rank1" / "moe_router.csv", newline="") as f:
        load = [float(r["value"]) for r in csv.DictReader(f)
                if r["name"] == "decoder.layers.0.mlp.router" and r["step"] == "1" and r["metric"].startswith("load.")]
    assert len(load) == 4 and sum(load) == 2 * 2 * 4 * 16 * 2  # ranks x micro-batches x sequences x tokens x top-k

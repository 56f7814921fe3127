"""The monitor's mixture-of-experts parts on their own: per-expert statistics of fused expert tensors against
each expert's slice, expert-parallel partials, expert-indexed names, routers named by the config, the MoE
config's validation and the MoE alert rules."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from msprobe_core.errors import ConfigError, UnknownKeyError
from msprobe_core.monitor.config import parse_monitor_config
from msprobe_core.monitor.moe.config import MoERuleConfig
from msprobe_core.monitor.moe.experts import ExpertPlan, FusedExperts, expert_partials
from msprobe_core.monitor.moe.routers import RouterStep
from msprobe_core.monitor.rules.moe import MoERules
from msprobe_core.monitor.shard_stats import combine_partials, partials_to_ops
from msprobe_core.monitor.trainer_mon import TrainerMon

OPS = ("min", "max", "norm", "mean", "zeros", "nans")


def _direct(t: torch.Tensor) -> list[float]:
    t = t.double()
    finite = t[~torch.isnan(t)]
    return [float(t.min()), float(t.max()), float(t.norm()), float(t.mean()), float((t.abs() <= 1e-8).double().mean()),
            float(torch.isnan(t).sum())] if finite.numel() == t.numel() else [math.nan] * 2 + [
            float(t.norm()), float(t.mean()), float((t.abs() <= 1e-8).double().mean()), float(torch.isnan(t).sum())]


def _close(a, b):
    return all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-5, abs=1e-7) for x, y in zip(a, b))


def test_fused_hf_experts_rows_equal_each_experts_slice_and_a_nan_stays_in_its_expert(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    block = nn.Module()
    block.experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8))
    for p in block.experts.parameters():
        nn.init.normal_(p)
    with torch.no_grad():
        block.experts.down_proj[2, 0, :3] = 0.0
        block.experts.down_proj[6, 1, 1] = float("nan")
    mon = TrainerMon({"param_distribution": True, "ops": list(OPS), "format": "api"}, output_dir=tmp_path)
    mon.set_monitor(block, optimizer=torch.optim.SGD(block.parameters(), lr=0.1))
    mon.step()
    rows = mon.get_metrics()["metrics"]["param"]
    mon.close()
    for name, tensor in (("experts.down_proj", block.experts.down_proj), ("experts.gate_up_proj", block.experts.gate_up_proj)):
        assert name in rows  # the whole tensor's row stays
        for e in range(8):
            got = [rows[f"{name}.{e}"][op] for op in OPS]
            assert _close(got, _direct(tensor[e].detach())), (name, e, got)
    assert rows["experts.down_proj.6"]["nans"] == 1 and all(rows[f"experts.down_proj.{e}"]["nans"] == 0
                                                             for e in range(8) if e != 6)
    assert rows["experts.down_proj.2"]["zeros"] == pytest.approx(3 / (16 * 8))


def test_expert_parallel_partials_combine_to_every_experts_statistics():
    torch.manual_seed(1)
    full = torch.randn(8, 5, 3)
    blocks = []
    for rank in range(2):  # two expert-parallel ranks holding experts 0-3 and 4-7
        spec = FusedExperts("w", "m", 4, (4, 5, 3), offset=4 * rank, total=8)
        blocks.append(expert_partials(spec, full[4 * rank:4 * rank + 4], OPS, 1e-8))
    assert torch.isinf(blocks[0][4:, 5]).all() and (blocks[0][4:, 4] == 0).all()  # experts held elsewhere: empty
    got = partials_to_ops(combine_partials(blocks), OPS)
    for e in range(8):
        assert _close(got[e].tolist(), _direct(full[e]))


def test_per_expert_modules_get_names_ending_in_the_expert_index():
    class Block(nn.Module):  # older HF layout: one module per expert
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    model = nn.Sequential(Block())
    params = dict(model.named_parameters())
    plan = ExpertPlan.build([model], params)
    assert not plan.fused
    assert plan.renames["0.experts.2.weight"] == "0.experts.weight.2"
    assert set(plan.rename({"0.experts.1.bias": torch.zeros(1)})) == {"0.experts.bias.1"}


class CustomRouter(nn.Module):
    """A user's own router: returns (logits, top-k indices)."""

    def __init__(self, hidden=8, experts=4, k=2):
        super().__init__()
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.k = k

    def forward(self, x):
        logits = self.proj(x)
        return logits, logits.topk(self.k, dim=-1).indices


class CustomMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.route = CustomRouter()
        self.experts = nn.Parameter(torch.randn(4, 8, 8) * 0.1)

    def forward(self, x):
        logits, idx = self.route(x)
        w = torch.softmax(logits, -1)
        out = torch.einsum("te,eho,th->to", w, self.experts, x)
        return out, idx


def test_a_router_named_in_the_config_is_measured_and_bad_names_are_clear_errors(tmp_path):
    torch.manual_seed(0)
    model = CustomMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "format": "api", "moe": {"routers": ["rou?e"]}}
    mon = TrainerMon(cfg, output_dir=tmp_path).set_monitor(model, optimizer=opt)
    x = torch.randn(10, 8)
    out, idx = model(x)
    with torch.no_grad():
        p = torch.softmax(model.route.proj(x), -1)
    out.sum().backward()
    opt.step()
    router = mon.get_metrics()["metrics"]["router"]["route"]
    counts = torch.bincount(idx.flatten(), minlength=4)
    assert [router[f"load.{e}"] for e in range(4)] == counts.tolist()
    assert router["entropy"] == pytest.approx(float(torch.special.entr(p).sum(-1).mean()), rel=1e-5)
    assert router["imbalance_max_mean"] == pytest.approx(float(counts.max() / counts.double().mean()))
    mon.close()
    hooks = len(model.route._forward_hooks)
    with pytest.raises(ConfigError, match="moe.routers"):
        TrainerMon({"moe": {"routers": ["no.such.module"]}}, output_dir=tmp_path).set_monitor(model, optimizer=opt)
    assert "step" not in vars(opt) and len(model.route._forward_hooks) == hooks  # nothing left installed


@pytest.mark.parametrize("moe, field", [
    ({"routers": "a", "per_expert": "yes"}, "moe.per_expert"),
    ({"routers": [3]}, "moe.routers"),
    ([], "moe"),
])
def test_moe_config_values_are_validated(moe, field):
    with pytest.raises(ConfigError) as e:
        parse_monitor_config({"moe": moe})
    assert e.value.field == field


@pytest.mark.parametrize("rule, args, field", [
    ("ExpertStarvation", {"share": 0}, "share"),
    ("ExpertStarvation", {"steps": 0}, "steps"),
    ("ImbalanceJump", {"threshold": -1}, "threshold"),
    ("EntropyCollapse", {"ratio": 1.5}, "ratio"),
    ("EntropyCollapse", {"window": 2}, "window"),
])
def test_moe_rule_args_are_validated(rule, args, field):
    with pytest.raises(ConfigError) as e:
        parse_monitor_config({"alert": {"rules": [{"rule_name": rule, "args": args}]}})
    assert e.value.field == f"alert.rules[0].args.{field}"
    with pytest.raises(UnknownKeyError):
        parse_monitor_config({"alert": {"rules": [{"rule_name": rule, "args": {"treshold": 1}}]}})
    with pytest.raises(UnknownKeyError):
        parse_monitor_config({"moe": {"router": []}})


def _step(load, entropy=2.0):
    return RouterStep("layer.gate", tuple(float(v) for v in load), int(sum(load)) // 2, entropy, None, 0.1, 0.0)


def test_rules_starvation_imbalance_and_entropy_name_layer_and_expert():
    rules = MoERules([MoERuleConfig("ExpertStarvation", share=0.1, steps=3), MoERuleConfig("ImbalanceJump"),
                      MoERuleConfig("EntropyCollapse")])
    g = torch.Generator().manual_seed(0)
    found = []
    for step in range(30):  # healthy: noisy but balanced
        load = (16 + torch.randint(-6, 7, (8,), generator=g)).tolist()
        found += rules.judge(0, step, [_step(load, 2.0 + 0.02 * (step % 3))])
    assert found == []
    for step in range(30, 34):  # expert 3 starves from step 30: reported once, at the third step
        found += rules.judge(0, step, [_step([18, 18, 18, 0, 18, 18, 18, 20])])
    assert [(a.rule, a.name, a.step, a.value) for a in found] == [("ExpertStarvation", "layer.gate.3", 32, 0.0)]
    jump = rules.judge(0, 34, [_step([100, 4, 4, 4, 4, 4, 4, 4], 0.5)])
    assert [(a.rule, a.name, a.module) for a in jump] == [("ImbalanceJump", "layer.gate.0", "layer.gate"),
                                                          ("EntropyCollapse", "layer.gate.0", "layer.gate")]
    assert "below" in jump[1].describe() and "above" in jump[0].describe()


def test_flat_shards_cut_mid_expert_combine_to_every_experts_statistics():
    """ZeRO-style flat fragments of a fused expert tensor, cut anywhere (here 3 ranks' pieces of 8 experts of
    15 elements, one rank with no piece): the per-expert partials of the pieces combine to each expert's own."""
    from msprobe_core.monitor.moe.experts import shard_expert_partials

    torch.manual_seed(2)
    full = torch.randn(8, 3, 5)
    full[5, 1, 2] = float("nan")
    spec = FusedExperts("w", "m", 8, (8, 3, 5), total=8)
    flat = full.reshape(-1)
    cuts = [(0, 37), (37, 37), (37, 120)]  # the middle rank holds nothing
    blocks = [shard_expert_partials(spec, flat[a:b], a, 1e-8) for a, b in cuts]
    got = partials_to_ops(combine_partials(blocks), OPS)
    for e in range(8):
        assert _close(got[e].tolist(), _direct(full[e])), e

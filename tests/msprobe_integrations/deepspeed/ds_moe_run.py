"""DeepSpeed MoE (``deepspeed.moe.layer.MoE``: ``TopKGate`` top-2 with a capacity, 4 experts) on the CPU for
``test_deepspeed_moe.py``, run in subprocesses (``python ds_moe_run.py MODE OUT.json``; ``ep`` under torchrun).

Modes:
* ``single`` (one process): for ZeRO 0 and 2, the same model and data trained without the tool (plain hooks
  capture what the gate computed: its input and its routes) and with ``msprobe_integrations.deepspeed.initialize``
  (monitor on): losses, the monitor's metrics per step, the captured routes and entropies. Then the reference of
  ``ep``: ep_size 1, ZeRO-2, one process whose two micro-batches per step are the two ranks' batches.
* ``ep`` (two ranks): ep_size 2 (experts 0-1 on rank 0, 2-3 on rank 1), ZeRO-2, each rank its own batch.
* ``fused`` (two ranks): a model whose experts are one fused tensor (HF transformers 5 style: a module with
  ``num_experts`` and a ``[num_experts, ...]`` parameter, odd sizes so that ZeRO's partitions cut experts in
  the middle), under ZeRO 0, ZeRO-2 and ZeRO-3, each rank its own batch.
* ``hf`` (two ranks): a tiny HF Qwen3-MoE (fused ``experts.gate_up_proj`` / ``down_proj``, 5 experts) under ZeRO 0
  and ZeRO-3, each rank its own batch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ds_support  # noqa: E402

HIDDEN = 16
EXPERTS = 4
STEPS = 4
TOKENS = (4, 6)
"""A micro-batch: 4 sequences of 6 tokens (24 tokens per gate call)."""
MONITOR = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
           "ops": ["min", "max", "norm", "mean"], "format": ["api", "csv"],
           "alert": {"rules": [{"rule_name": "ExpertStarvation"}, {"rule_name": "ImbalanceJump"},
                               {"rule_name": "EntropyCollapse"}]}}


def make_model(ep: int, sampling: bool):
    import torch
    from deepspeed.moe.layer import MoE

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, HIDDEN)
            expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 24), torch.nn.GELU(), torch.nn.Linear(24, HIDDEN))
            self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, k=2, capacity_factor=1.0, min_capacity=2,
                           top2_2nd_expert_sampling=sampling)
            self.out = torch.nn.Linear(HIDDEN, 3)

        def forward(self, x):
            h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
            return self.out(h), l_aux

    torch.manual_seed(0)
    model = Net()
    if ep > 1:  # the same initial experts as ep_size 1: this rank's experts are experts rank*2 .. rank*2+1
        ref = dict(make_model(1, sampling).named_parameters())
        rank = int(os.environ["RANK"])
        local = EXPERTS // ep
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".deepspeed_experts." in name:
                    head, _, tail = name.partition(".deepspeed_experts.")
                    idx, _, rest = tail.partition(".")
                    src = f"{head}.deepspeed_experts.{rank * local + int(idx)}.{rest}"
                else:
                    src = name
                p.copy_(ref[src])
    return model


def make_engine(stage: int, ep: int = 1, gas: int = 1, sampling: bool = True, monitor_dir: str | None = None):
    import deepspeed
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from msprobe_integrations import deepspeed as msds

    model = make_model(ep, sampling)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    opt = torch.optim.AdamW(groups, lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": TOKENS[0], "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}
    if monitor_dir is None:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    else:
        engine, _, _, _ = msds.initialize(model=model, optimizer=opt, config=config, monitor_config_path=MONITOR,
                                          monitor_output_dir=monitor_dir)
    return engine


def batches(n: int, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*TOKENS, 8, generator=g), torch.randn(*TOKENS, 3, generator=g)) for _ in range(n)]


class GateSpy:
    """Plain hooks (no msprobe) on the gate: its input and its routes, per forward."""

    def __init__(self, gate):
        self.calls: list[dict[str, Any]] = []
        self._x = None
        gate.register_forward_pre_hook(lambda m, args: setattr(self, "_x", args[0].detach().clone()))
        gate.register_forward_hook(self._after)
        self.gate = gate

    def _after(self, module, args, output):
        import torch

        logits = torch.nn.functional.linear(self._x.float(), module.wg.weight.detach().float())
        p = torch.softmax(logits, dim=-1)
        idx = output[3].long().reshape(-1)
        self.calls.append({"load": torch.bincount(idx[idx >= 0], minlength=EXPERTS).tolist(),
                           "dropped": int((idx < 0).sum()), "entropy_sum": float(torch.special.entr(p).sum()),
                           "tokens": int(self._x.shape[0])})


def train(engine, data: list, monitored: bool) -> tuple[list[str], list[Any]]:
    import torch

    from msprobe_integrations.deepspeed import get_patch

    losses, metrics = [], []
    for x, y in data:
        out, l_aux = engine(x)
        loss = torch.nn.functional.mse_loss(out, y) + 0.01 * l_aux
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(float(loss.item()).hex())
        if boundary and monitored:
            metrics.append(get_patch(engine).session.monitor.get_metrics())
    return losses, metrics


def run_single(out: Path) -> dict:
    from msprobe_integrations.deepspeed import unpatch

    ds_support.init_distributed()
    work = out.parent
    data = batches(STEPS, seed=1)
    result: dict[str, Any] = {}
    for stage in (0, 2):
        plain = make_engine(stage)
        spy = GateSpy(plain.module.moe.deepspeed_moe.gate)
        ref_losses, _ = train(plain, data, False)
        engine = make_engine(stage, monitor_dir=str(work / f"mon_z{stage}"))
        losses, metrics = train(engine, data, True)
        unpatch(engine)
        result[f"z{stage}"] = {"ref_losses": ref_losses, "losses": losses, "metrics": metrics, "spy": spy.calls,
                               "optimizer": type(engine.optimizer).__name__}
    # the reference of the two-rank expert-parallel run: its two ranks' batches as two micro-batches
    ranks = [batches(STEPS, seed=10 + r) for r in range(2)]
    interleaved = [b for step in zip(*ranks) for b in step]
    engine = make_engine(2, gas=2, sampling=False, monitor_dir=str(work / "mon_ref_ep"))
    losses, metrics = train(engine, interleaved, True)
    unpatch(engine)
    result["ep_ref"] = {"losses": losses, "metrics": metrics}
    return result


def run_ep(out: Path) -> dict:
    import torch

    from msprobe_integrations.deepspeed import unpatch

    ds_support.init_distributed()
    rank = torch.distributed.get_rank()
    engine = make_engine(2, ep=2, sampling=False, monitor_dir=str(out.parent / "mon_ep"))
    losses, metrics = train(engine, batches(STEPS, seed=10 + rank), True)
    unpatch(engine)
    return {"rank": rank, "losses": losses, "metrics": metrics, "optimizer": type(engine.optimizer).__name__}


def fused_model():
    import torch

    class FusedExperts(torch.nn.Module):  # the layout of transformers 5's Qwen3MoeExperts, dense routing
        def __init__(self):
            super().__init__()
            self.num_experts = 5
            self.down_proj = torch.nn.Parameter(torch.randn(5, 7, 9) * 0.3)

        def forward(self, h, weights):
            return torch.einsum("te,eoi,ti->to", weights, self.down_proj, h)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 9)
            self.gate = torch.nn.Linear(9, 5, bias=False)
            self.experts = FusedExperts()
            self.out = torch.nn.Linear(7, 3)

        def forward(self, x):
            h = torch.tanh(self.inp(x)).reshape(-1, 9)
            return self.out(self.experts(h, torch.softmax(self.gate(h), -1))).reshape(*x.shape[:-1], 3)

    torch.manual_seed(0)
    return Net()


def hf_model():
    """A tiny HF transformers 5 Qwen3-MoE (fused ``experts.gate_up_proj`` ``[5, 16, 16]`` / ``down_proj`` ``[5, 16, 8]``)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_experts=5, num_experts_per_tok=2,
        max_position_embeddings=16, decoder_sparse_step=1, norm_topk_prob=True))


def _fused_loss(engine, batch):
    import torch

    x, y = batch
    return torch.nn.functional.mse_loss(engine(x), y)


def _hf_loss(engine, ids):
    return engine(input_ids=ids, labels=ids).loss


def _hf_batches(n: int, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (2, 8), generator=g) for _ in range(n)]


FUSED_CASES = {"fused": (fused_model, _fused_loss, batches, (0, 2, 3)),
               "hf": (hf_model, _hf_loss, _hf_batches, (0, 3))}
"""Scenario -> (model, loss of a batch, batches(n, seed), ZeRO stages)."""


def run_fused(out: Path, scenario: str) -> dict:
    import torch

    from msprobe_integrations import deepspeed as msds
    from msprobe_integrations.deepspeed import get_patch, unpatch

    ds_support.init_distributed()
    rank = torch.distributed.get_rank()
    result: dict[str, Any] = {"rank": rank}
    make, loss_of, data, stages = FUSED_CASES[scenario]
    for stage in stages:
        model = make()
        config = {"train_micro_batch_size_per_gpu": TOKENS[0], "zero_optimization": {"stage": stage},
                  "steps_per_print": 10 ** 9}
        engine, _, _, _ = msds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                          config=config, monitor_config_path=MONITOR,
                                          monitor_output_dir=str(out.parent / f"mon_{scenario}_z{stage}"))
        losses, metrics = [], []
        for batch in data(STEPS, 20 + rank):
            loss = loss_of(engine, batch)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.item()).hex())
            metrics.append(get_patch(engine).session.monitor.get_metrics())
        unpatch(engine)
        result[f"z{stage}"] = {"losses": losses, "metrics": metrics, "optimizer": type(engine.optimizer).__name__}
        del engine
    return result


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "single":
        result = run_single(out)
    else:
        out = out.with_suffix(f".rank{os.environ['RANK']}.json")
        result = run_ep(out) if mode == "ep" else run_fused(out, mode)
    out.write_text(json.dumps(result))
    if mode != "single":
        from msprobe_core.session import finish_distributed

        finish_distributed()  # the engines were local to the runs: released, then the groups go (clean exit)


if __name__ == "__main__":
    main()

"""Per-expert rows of fused expert tensors under PyTorch's own sharding, on two real gloo ranks: a tiny HF
Qwen3-MoE (transformers 5 fused ``experts.gate_up_proj`` ``[5, 2f, h]`` / ``experts.down_proj`` ``[5, h, f]``)
under FSDP2 ``fully_shard`` (dim 0 sharded unevenly: experts 0-2 on rank 0, 3-4 on rank 1) and FSDP1 with and
without ``use_orig_params`` (the experts module its own unit, whose flat parameter the two ranks cut inside
expert 3 of ``gate_up_proj``). On both ranks, every expert's weight, gradient, ``exp_avg`` and ``exp_avg_sq``
row equals that expert's slice in a single-process run over the global batch (rtol 1e-5), every step, and so
does the router-weight cosine similarity between experts (the router named without the FSDP1 wrappers; taken from
the whole weight as the router's forward held it, a piece outside the forward); the losses are bit-identical with
the monitor on and off. The per-expert rows add no collective: a monitored run makes as many all-reduces with
them as without (``moe.per_expert`` false). All three setups run in one two-rank job."""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("transformers")
from dist_run import run_two_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SETUPS = ("fsdp2", "fsdp1_orig", "fsdp1_flat")
EXPERTS = 5
FUSED = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
KINDS = ("param", "grad", "exp_avg", "exp_avg_sq")

WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeExperts
    from msprobe_core.session import finish_distributed
    from msprobe_core.monitor.trainer_mon import TrainerMon

    tmp = sys.argv[1]
    STEPS, EXPERTS = 3, 5
    FUSED = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
    MONITOR = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
               "ops": ["min", "max", "norm", "mean"], "format": ["api"]}

    def make_model():
        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                             num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=16,
                             decoder_sparse_step=1, norm_topk_prob=True)
        return Qwen3MoeForCausalLM(cfg)

    def global_batch(step):
        return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(100 + step))

    def stats(t):
        t = t.detach().double()
        return {"min": t.min().item(), "max": t.max().item(), "norm": t.norm().item(), "mean": t.mean().item()}

    def reference():
        model = make_model()
        params = dict(model.named_parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for step in range(STEPS):
            ids = global_batch(step)
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            w = torch.nn.functional.normalize(params["model.layers.0.mlp.gate.weight"].detach().double(), dim=1)
            sim = (w @ w.T)[~torch.eye(EXPERTS, dtype=torch.bool)]
            rec = {"param": {}, "grad": {}, "router": {"router_cos_max": sim.max().item(),
                                                       "router_cos_mean": sim.mean().item()}}
            for name in FUSED:
                for e in range(EXPERTS):
                    rec["param"][f"{name}.{e}"] = stats(params[name][e])
                    rec["grad"][f"{name}.{e}"] = stats(params[name].grad[e])
            opt.step()
            for kind in ("exp_avg", "exp_avg_sq"):
                rec[kind] = {f"{n}.{e}": stats(opt.state[params[n]][kind][e]) for n in FUSED for e in range(EXPERTS)}
            out.append(rec)
        return out

    def shard(model, setup):
        if setup == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for layer in model.model.layers:
                fully_shard(layer)
            return fully_shard(model)
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FullyShardedDataParallel(model, use_orig_params=setup == "fsdp1_orig", device_id=torch.device("cpu"),
                                        auto_wrap_policy=ModuleWrapPolicy({Qwen3MoeExperts}))

    def train(setup, mon=None):
        model = shard(make_model(), setup)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if mon is not None:
            mon.set_monitor(model, 1, opt)
        rank, world = dist.get_rank(), dist.get_world_size()
        losses, got = [], []
        for step in range(STEPS):
            ids = global_batch(step).chunk(world)[rank]
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()).hex())
            if mon is not None:
                got.append(mon.get_metrics().get("metrics", {}))
        return losses, got

    ALL_REDUCES = [0]
    _all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        ALL_REDUCES[0] += 1
        return _all_reduce(*args, **kwargs)

    dist.all_reduce = counted

    def monitored(setup, config, name):
        mon = TrainerMon(config, output_dir=f"{tmp}/out_{name}")
        ALL_REDUCES[0] = 0
        losses, got = train(setup, mon)
        mon.close()
        return losses, got, ALL_REDUCES[0]

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"want": reference()}
    for setup in sys.argv[2:]:
        plain, _ = train(setup)
        losses, got, all_reduces = monitored(setup, MONITOR, setup)
        _, _, without = monitored(setup, {**MONITOR, "moe": {"per_expert": False}}, setup + "_whole")
        keep = [{**{k: {n: v for n, v in m.get(k, {}).items() if ".experts." in n} for k in
                    ("param", "grad", "exp_avg", "exp_avg_sq")},
                 "router": m.get("router", {}).get("model.layers.0.mlp.gate", {})} for m in got]
        result[setup] = {"plain": plain, "losses": losses, "got": keep, "all_reduces": [all_reduces, without]}
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    finish_distributed()
""")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_fsdp")
    run_two_ranks(WORKER, tmp, str(tmp), *SETUPS, timeout=420, name="worker.py")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("setup", SETUPS)
def test_fused_experts_rows_equal_the_single_process_slices(results, setup):
    rows = {f"{n}.{e}" for n in FUSED for e in range(EXPERTS)}
    for result in results:
        mine = result[setup]
        assert mine["losses"] == mine["plain"]  # bit-identical with the monitor on and off
        assert len(mine["got"]) == len(result["want"]) == 3
        with_rows, without = mine["all_reduces"]  # the per-expert rows ride in the whole tensors' all-reduces
        assert with_rows == without > 0, mine["all_reduces"]
        for step, (got, want) in enumerate(zip(mine["got"], result["want"])):
            for kind in KINDS:
                assert rows <= set(got[kind]) and set(FUSED) <= set(got[kind]), (setup, kind, sorted(got[kind]))
                for name in rows:
                    for op, value in want[kind][name].items():
                        assert got[kind][name][op] == pytest.approx(value, rel=1e-5, abs=1e-8), \
                            (setup, step, kind, name, op)
            for metric, value in want["router"].items():  # from the whole router weight its forward used
                assert got["router"][metric] == pytest.approx(value, rel=1e-5), (setup, step, metric)

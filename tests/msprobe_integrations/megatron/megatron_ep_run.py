"""megatron-core MoE with expert parallelism on the CPU, for ``test_megatron_moe.py`` (run by torchrun):
``python megatron_ep_run.py MODE OUT_DIR``.

* ``ref`` (one rank, expert_model_parallel_size 1): a GPTModel with 4 ``SequentialMLP`` experts (top-2,
  ``allgather`` dispatcher) in megatron-core's DDP with the Megatron optimizer and ``MegatronProbe`` (monitor
  on), 3 iterations of two micro-batches: the two ranks' batches of ``ep``. Saves its initial weights.
* ``ep`` (two ranks, expert_model_parallel_size 2: experts 0-1 on rank 0, 2-3 on rank 1): the same initial
  weights, each rank one micro-batch per iteration (its own batch).

Each rank writes ``OUT_DIR/MODE.rank{R}.json``: the reported losses and the monitor's metrics per iteration.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
import megatron_support as ms  # noqa: E402

EXPERTS = 4
STEPS = 3
MICRO = 4
MONITOR = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
           "ops": ["min", "max", "norm", "mean"], "format": ["api"]}
_LOCAL = re.compile(r"^(?P<head>.*\.local_experts\.)(?P<idx>\d+)(?P<rest>\..+)$")


def build(ep: int, rank: int, init: Path):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=EXPERTS, moe_router_topk=2,
                            moe_token_dispatcher_type="allgather", add_bias_linear=False,
                            expert_model_parallel_size=ep)
    torch.manual_seed(0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS),
                   vocab_size=ms.VOCAB, max_sequence_length=ms.SEQ, share_embeddings_and_output_weights=False)
    if ep == 1:
        torch.save({n: p.detach().clone() for n, p in gpt.named_parameters()}, init)
    else:  # this rank's experts are the reference's experts rank * local ...
        ref = torch.load(init)
        local = EXPERTS // ep
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                m = _LOCAL.match(name)
                src = f"{m['head']}{rank * local + int(m['idx'])}{m['rest']}" if m else name
                p.copy_(ref[src])
    return gpt


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from msprobe_integrations.megatron import MegatronProbe

    mode, out = sys.argv[1], Path(sys.argv[2])
    ep = 2 if mode == "ep" else 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    patches = ms.CpuPatches().install()
    # megatron-core's autograd backward (tensor_parallel/mappings.py) allocates with
    # device=torch.cuda.current_device(), where the recipe's CudaOnCpuMode is not in effect: name the CPU
    patches.replace(torch.cuda, "current_device", lambda _original: (lambda: torch.device("cpu")))
    try:
        ms.init_distributed(rank=rank, world_size=world)
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
        model = ms.wrap_ddp([build(ep, rank, out / "init.pt")])
        optimizer = ms.megatron_optimizer(model, ms.optimizer_config(clip_grad=0.0))
        ms.set_schedule_hooks(model, optimizer)
        probe = MegatronProbe(monitor_config_path=MONITOR, monitor_output_dir=str(out / f"mon_{mode}"),
                              capture_hyperparameters=False)
        probe.setup(model, optimizer, None, SimpleNamespace(micro_batch_size=MICRO, global_batch_size=2 * MICRO,
                                                            iteration=0, train_iters=STEPS))
        streams = [ms.batches(MICRO, seed=10 + r) for r in range(2)]
        if ep == 1:  # the two ranks' batches, one after the other, as the two micro-batches of an iteration
            data = (next(s) for _ in iter(int, 1) for s in streams)
            micro = 2
        else:
            data, micro = streams[rank], 1
        step_fn = get_forward_backward_func()
        losses, metrics = [], []
        for i in range(1, STEPS + 1):
            probe.begin_iteration(i)
            for m in model:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            reduced = step_fn(forward_step_func=ms.forward_step, data_iterator=data, model=model,
                              num_microbatches=micro, seq_length=ms.SEQ, micro_batch_size=MICRO, forward_only=False)
            optimizer.step()
            probe.end_iteration()
            metrics.append(probe.session.monitor.get_metrics())
            losses.append(ms.reported_loss(reduced))
        probe.close()
        (out / f"{mode}.rank{rank}.json").write_text(json.dumps({"losses": losses, "metrics": metrics}))
        del model, optimizer
    finally:
        ms.destroy()
        patches.remove()


if __name__ == "__main__":
    main()

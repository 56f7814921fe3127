"""megatron-core MoE with expert parallelism on the CPU, for ``test_megatron_moe.py`` (run by torchrun):
``python megatron_ep_run.py MODE OUT_DIR``.

* ``ref`` (one rank, expert_model_parallel_size 1): a GPTModel with 4 ``SequentialMLP`` experts (top-2,
  ``allgather`` dispatcher) in megatron-core's DDP with the Megatron optimizer and ``MegatronProbe`` (monitor
  on), 3 iterations of two micro-batches: the two ranks' batches of ``ep``. Saves its initial weights.
* ``ep`` (two ranks, expert_model_parallel_size 2: experts 0-1 on rank 0, 2-3 on rank 1): the same initial
  weights, each rank one micro-batch per iteration (its own batch).

* ``gref`` / ``gdo`` / ``gep`` / ``gepdo``: the same with fused ``GroupedMLP`` experts (``weight1`` ``[h, E*f]``,
  ``weight2`` ``[E*f, h]``): ``gref`` one rank (the reference), ``gdo`` two data-parallel ranks with the
  distributed optimizer, ``gep`` two ranks with ``expert_model_parallel_size`` 2 (the Megatron optimizer) and
  ``gepdo`` the same with the distributed optimizer. GroupedMLP's
  forward calls the CUDA ``grouped_gemm`` package: here its ``gmm`` is a few lines of torch (each expert's tokens
  times its weight, ``_torch_gmm``), and its bf16-only assertion is answered with a config copy that says bf16
  (the model stays float32). Everything else is megatron-core's own.

Each rank writes ``OUT_DIR/MODE.rank{R}.json``: the reported losses and the monitor's metrics per iteration.
"""

from __future__ import annotations

import copy
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


def _torch_gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """grouped_gemm's ``gmm`` in torch: rows of ``a`` split by ``batch_sizes``, each times its expert's ``b[e]``."""
    parts = a.split([int(n) for n in batch_sizes.tolist()])
    return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(parts, b)])


def grouped_on_cpu(patches) -> None:
    """GroupedMLP on the CPU: grouped_gemm's ``gmm`` in torch (see the module docstring)."""
    from types import SimpleNamespace as NS

    import megatron.core.transformer.moe.experts as experts
    import megatron.core.transformer.moe.grouped_gemm_util as gg

    patches.replace(gg, "assert_grouped_gemm_is_available", lambda _original: (lambda: None))
    patches.replace(gg, "ops", lambda _original: NS(gmm=_torch_gmm))
    patches.replace(experts.GroupedMLP, "forward", lambda original: _bf16_said(original))


def _bf16_said(forward):
    def run(self, *args, **kwargs):
        if not self.config.bf16:
            self.config = copy.copy(self.config)
            self.config.bf16 = True  # only GroupedMLP's assertion reads it: the weights and activations stay float32
        return forward(self, *args, **kwargs)
    return run


def build(ep: int, rank: int, init: Path, grouped: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=EXPERTS, moe_router_topk=2,
                            moe_token_dispatcher_type="allgather", add_bias_linear=False,
                            expert_model_parallel_size=ep, moe_grouped_gemm=grouped)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=ms.VOCAB, max_sequence_length=ms.SEQ,
                   share_embeddings_and_output_weights=False)
    if ep == 1:
        if rank == 0:
            torch.save({n: p.detach().clone() for n, p in gpt.named_parameters()}, init)
    else:  # this rank's experts are the reference's experts rank * local ...
        ref = torch.load(init)
        local = EXPERTS // ep
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                m = _LOCAL.match(name)
                if m:
                    p.copy_(ref[f"{m['head']}{rank * local + int(m['idx'])}{m['rest']}"])
                elif name.endswith((".experts.weight1", ".experts.weight2")):  # expert e: the e-th chunk of memory
                    p.copy_(ref[name].reshape(-1).chunk(ep)[rank].view_as(p))
                else:
                    p.copy_(ref[name])
    return gpt


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from msprobe_integrations.megatron import MegatronProbe

    mode, out = sys.argv[1], Path(sys.argv[2])
    ep = 2 if mode in ("ep", "gep", "gepdo") else 1
    grouped = mode.startswith("g")
    distributed = mode.endswith("do")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    patches = ms.CpuPatches().install().for_expert_parallel()  # (needed with ep > 1, harmless without)
    if grouped:
        grouped_on_cpu(patches)
    try:
        ms.init_distributed(rank=rank, world_size=world)
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
        init = out / ("ginit.pt" if grouped else "init.pt")
        model = ms.wrap_ddp([build(ep, rank, init, grouped)], use_distributed_optimizer=distributed)
        optimizer = ms.megatron_optimizer(model, ms.optimizer_config(clip_grad=0.0,
                                                                     use_distributed_optimizer=distributed))
        ms.set_schedule_hooks(model, optimizer)
        probe = MegatronProbe(monitor_config_path=MONITOR, monitor_output_dir=str(out / f"mon_{mode}"),
                              capture_hyperparameters=False)
        probe.setup(model, optimizer, None, SimpleNamespace(micro_batch_size=MICRO, global_batch_size=2 * MICRO,
                                                            iteration=0, train_iters=STEPS))
        streams = [ms.batches(MICRO, seed=10 + r) for r in range(2)]
        if world == 1:  # the two ranks' batches, one after the other, as the two micro-batches of an iteration
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
        reader = probe.session.monitor.reader
        params = {n: p for n, p in reader.named_parameters(model).items() if n.endswith(("weight1", "weight2"))}
        weights = reader.weights(params)  # where this rank's piece of each fused tensor lies: [start, end)
        pieces = {n: [reader.shard_start(n, p), reader.shard_start(n, p) + weights[n].numel()] for n, p in params.items()}
        probe.close()
        (out / f"{mode}.rank{rank}.json").write_text(json.dumps({"losses": losses, "metrics": metrics,
                                                                 "pieces": pieces}))
        del model, optimizer
    finally:
        ms.destroy()
        patches.remove()


if __name__ == "__main__":
    main()

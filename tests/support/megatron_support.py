"""Test support for real megatron-core on a machine without CUDA: tiny models, the megatron-core DDP
wrapper, the Megatron optimizer, a Megatron-LM-shaped ``forward_step``/``train_step``, and ``run_child`` /
``lm_losses`` for the tests that run a recipe in a child process.

The CPU stand-ins for megatron-core's CUDA-only pieces (``CpuPatches``) and the gloo process group
(``init_distributed``, ended by ``finish_megatron``) are the recipe's (``recipes/megatron_cpu.py``),
re-exported here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from typing import Any, Iterator, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RECIPES = os.path.join(ROOT, "recipes")
STANDIN = os.path.join(ROOT, "tests", "standins", "megatron_lm")
"""The test stand-in of Megatron-LM's ``megatron.training`` (``EXTRA_PATH`` of ``run_child``)."""
if _RECIPES not in sys.path:
    sys.path.insert(0, _RECIPES)

from megatron_cpu import CpuPatches, chunk_stage, finish_megatron, init_distributed  # noqa: E402,F401  (re-exported)


def initialize_model_parallel(tp: int = 1, pp: int = 1, vpp: Optional[int] = None) -> None:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)


def destroy() -> None:
    """The end of a megatron-core run (the caller released its model chunks and optimizer): the recipe's
    ``finish_megatron``, without a barrier (called from ``finally`` blocks, where another rank may be gone)."""
    finish_megatron(barrier=False)


@contextlib.contextmanager
def megatron_on_cpu(tp: int = 1, pp: int = 1) -> Iterator[None]:
    """In-process megatron-core on the CPU for the length of the block: the CPU stand-ins installed, a one-rank
    gloo group and the model-parallel state; all undone on leaving (the tests' shared fixture body)."""
    patches = CpuPatches().install()
    try:
        init_distributed()
        initialize_model_parallel(tp, pp)
        yield
    finally:
        destroy()
        patches.remove()


# ------------------------------------------------------------------------------------------ child processes
def run_child(cmd: list, env: Optional[dict] = None, timeout: float = 240,
              cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (in ``cwd``, default the checkout) with this checkout importable; ``env`` adds to the
    environment, its ``EXTRA_PATH`` goes first on ``PYTHONPATH``. The parent's process-group variables
    (the in-process tests' ``MASTER_PORT``, ...) and ``MONITOR_OUTPUT_DIR`` stay out of the child."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                                  "LOCAL_RANK", "MONITOR_OUTPUT_DIR")}
    full_env.update(PYTHONWARNINGS="ignore", **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([p for p in (full_env.pop("EXTRA_PATH", None), ROOT,
                                                           os.environ.get("PYTHONPATH")) if p])
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd or ROOT, env=full_env, timeout=timeout)


def lm_losses(stdout: str) -> list[str]:
    """The ``lm loss`` of each iteration a recipe printed (as printed: full float repr)."""
    return [line.split("lm loss:")[1].split("|")[0].strip() for line in stdout.splitlines() if "lm loss:" in line]


# ------------------------------------------------------------------------------------------ model
VOCAB = 128
SEQ = 16


def transformer_config(num_layers: int = 2, hidden_size: int = 32, num_attention_heads: int = 4,
                       ffn_hidden_size: int = 64, bf16: bool = False, pp: int = 1, vpp: Optional[int] = None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                             ffn_hidden_size=ffn_hidden_size, use_cpu_initialization=True, params_dtype=dtype,
                             pipeline_dtype=dtype, bf16=bf16, hidden_dropout=0.0, attention_dropout=0.0,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)


def gpt_chunks(config, seed: int = 0, vocab: int = VOCAB, seq: int = SEQ, vpp: Optional[int] = None) -> list:
    """The model chunks of this pipeline rank (one without virtual pipeline parallelism)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    chunks = []
    for vp in range(vpp or 1):
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                         max_sequence_length=seq, share_embeddings_and_output_weights=False,
                         **chunk_stage(vp if vpp else None))
        if config.bf16:
            model = model.to(torch.bfloat16)
        chunks.append(model)
    return chunks


def wrap_ddp(chunks: list, use_distributed_optimizer: bool = False) -> list:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    return [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)]


def optimizer_config(lr: float = 1e-2, bf16: bool = False, use_distributed_optimizer: bool = False,
                     clip_grad: float = 1.0, weight_decay: float = 0.01):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=0.9, adam_beta2=0.95,
                           adam_eps=1e-8, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                           use_distributed_optimizer=use_distributed_optimizer, clip_grad=clip_grad)


def megatron_optimizer(model: list, config) -> Any:
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(config, model)


def set_schedule_hooks(model: list, optimizer: Any) -> Any:
    """What Megatron-LM's ``train()`` sets on the model config before training; returns the config."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.grad_sync_func = None
    config.param_sync_func = None
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return config


# ------------------------------------------------------------------------------------------ data and steps
def batches(micro_batch_size: int, seed: int = 0, vocab: int = VOCAB, seq: int = SEQ) -> Iterator[dict]:
    """An endless, deterministic stream of micro-batches (tokens, labels, loss mask, positions, mask)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tril(torch.ones(1, 1, seq, seq)) < 0.5  # True = masked out
    positions = torch.arange(seq).unsqueeze(0).expand(micro_batch_size, seq)
    while True:
        tokens = torch.randint(0, vocab, (micro_batch_size, seq + 1), generator=g)
        yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
               "loss_mask": torch.ones(micro_batch_size, seq), "attention_mask": mask, "position_ids": positions}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's GPT loss: the masked token mean, with the token count and a report dict."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def forward_step(data_iterator, model):
    """Megatron-LM's ``forward_step(data_iterator, model)``: the output tensor and the loss function."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def forward_backward(model: list, optimizer: Any, data: Iterator[dict], num_microbatches: int = 2,
                     micro_batch_size: int = 4) -> list:
    """One iteration before ``optimizer.step()``: gradient buffers zeroed, then forward and backward of
    ``num_microbatches`` micro-batches through Megatron's schedule; the schedule's reduced losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=model,
                                       num_microbatches=num_microbatches, seq_length=SEQ,
                                       micro_batch_size=micro_batch_size, forward_only=False)


def reported_loss(losses_reduced: list) -> Optional[float]:
    """The iteration's mean token loss from the schedule's ``forward_data_store`` (last stage only)."""
    if not losses_reduced:
        return None
    total = torch.stack([d["lm loss"] for d in losses_reduced]).sum(dim=0)
    return float(total[0] / total[1])

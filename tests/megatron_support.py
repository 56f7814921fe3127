"""Test (and CPU recipe) support for real megatron-core on a machine without CUDA.

megatron-core 0.16.1 (the newest for Python 3.11) runs on the CPU with a tiny ``GPTModel`` once the few
pieces that hard-code CUDA are redirected. Everything that does so lives here, documented, and is undone
by ``CpuPatches.remove()``:

1. ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on ``torch.cuda.current_device()``;
   the replacement allocates the same buffer on the CPU.
2. ``CudaRNGStatesTracker.fork`` raises "cuda rng state model-parallel-rng is not added" because
   ``model_parallel_cuda_manual_seed`` needs CUDA; the replacement is a no-op context (dropout is 0 in
   these models, so no RNG stream is consumed there).
3. ``torch.cuda.current_device`` returns 0 instead of initialising CUDA: the DDP grad buffers
   (``param_and_grad_buffer.py``), the distributed optimizer and the pipeline's p2p buffers allocate with
   ``device=current_device()``; ``torch.cuda.synchronize`` (pipeline p2p communication) does nothing.
4. ``CudaOnCpuMode``, a ``TorchFunctionMode`` active while patched, maps a CUDA ``device=`` argument of
   factory functions (``torch.zeros(..., device="cuda")`` in the optimizers, ``clip_grads.py`` and
   ``schedules.py``; ``device=0`` from item 3) to the CPU, makes ``Tensor.cuda()`` a no-op and answers
   ``Tensor.type()`` (no arguments) with the CUDA type name, so the type checks of
   ``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer`` ("torch.cuda.FloatTensor", ...)
   accept CPU parameters. It changes no numbers: every call runs unchanged, only on the CPU.

``use_cpu_initialization=True`` in the ``TransformerConfig`` keeps weight creation off CUDA, and gloo is
the process-group backend. The rest of this module builds the tiny models, the megatron-core DDP wrapper,
the Megatron optimizer and a Megatron-LM-shaped ``forward_step``/``train_step``.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaOnCpuMode(TorchFunctionMode):
    """Runs megatron-core's CUDA-only allocations on the CPU (item 4 of the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class CpuPatches:
    """Install / remove the CPU stand-ins for megatron-core's CUDA-only pieces (see the module docstring)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._mode: Optional[CudaOnCpuMode] = None

    def install(self) -> "CpuPatches":
        import megatron.core.utils as mcu
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            numel = functools.reduce(operator.mul, tensor_shape, 1)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < numel:
                self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device="cpu", requires_grad=False)
            return self.buffer[(name, dtype)][0:numel].view(*tensor_shape)

        def fork(self, name=None):
            return contextlib.nullcontext()

        for owner, attr, value in ((mcu.GlobalMemoryBuffer, "get_tensor", get_tensor),
                                   (CudaRNGStatesTracker, "fork", fork),
                                   (torch.cuda, "current_device", lambda: 0),
                                   (torch.cuda, "synchronize", lambda device=None: None)):
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            setattr(owner, attr, value)
            self._undo.append(functools.partial(setattr, owner, attr, original))
        self._mode = CudaOnCpuMode()
        self._mode.__enter__()
        return self

    def remove(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "CpuPatches":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()


# ------------------------------------------------------------------------------------------ process groups
def init_distributed(rank: int = 0, world_size: int = 1, port: Optional[int] = None) -> None:
    """gloo process group (MASTER_ADDR/PORT from the environment unless ``port`` is given)."""
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_model_parallel(tp: int = 1, pp: int = 1, vpp: Optional[int] = None) -> None:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)


def destroy() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


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
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    chunks = []
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                         max_sequence_length=seq, pre_process=pre, post_process=post, vp_stage=vp_stage,
                         share_embeddings_and_output_weights=False)
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


def reported_loss(losses_reduced: list) -> Optional[float]:
    """The iteration's mean token loss from the schedule's ``forward_data_store`` (last stage only)."""
    if not losses_reduced:
        return None
    total = torch.stack([d["lm loss"] for d in losses_reduced]).sum(dim=0)
    return float(total[0] / total[1])

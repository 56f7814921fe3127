"""Train a tiny megatron-core GPT on the CPU, the Megatron-LM way, with msprobe's dump and monitor as flags.

    python recipes/megatron_core_gpt.py --train-iters 4 \\
        --msprobe-config dump.json --msprobe-monitor-config monitor.json

PyPI's megatron-core ships only ``megatron.core``; Megatron-LM's ``megatron.training`` (argument parsing,
``setup_model_and_optimizer``, ``train_step``, ``train``, ``pretrain``) is not installable. This file is a
small stand-in with the same names and signatures, built on megatron-core: a ``GPTModel`` from
``get_gpt_layer_local_spec()``, megatron-core's ``DistributedDataParallel``, ``get_megatron_optimizer``
(``--bf16`` / ``--use-distributed-optimizer`` select the optimizer class), ``OptimizerParamScheduler`` and
``get_forward_backward_func`` with two micro-batches per iteration (global batch = 2 x micro batch x DP).

msprobe is enabled exactly as for Megatron-LM: the flags come from ``add_args`` through
``extra_args_provider``, and ``install()`` wraps this module's ``setup_model_and_optimizer`` and
``train_step`` (``python -m msprobe_integrations.megatron`` does the same for Megatron-LM). Output: one
dump step per iteration (``DUMP_PATH/step{N}/rank{R}``), the monitor per iteration, and
``hyperparameters.json`` with Megatron's own argument names (under ``args``) at the top of both.

Runs on the CPU with gloo (one process, or ``torchrun --nproc-per-node 2`` for data parallelism); the
CUDA-only pieces of megatron-core are redirected by ``megatron_cpu.py`` beside this file (documented there).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):  # runnable from a checkout without installing the package
    if _p not in sys.path:
        sys.path.insert(0, _p)

_GLOBAL_ARGS: Optional[argparse.Namespace] = None
_CPU_PATCHES: Any = None
LOSSES: list[float] = []
"""The reported ``lm loss`` of every iteration of the last ``train()`` (also printed)."""


# ------------------------------------------------------------------------------------------ arguments
def get_args() -> argparse.Namespace:
    """Megatron-LM's ``get_args()``: the parsed arguments (asserts they were parsed)."""
    assert _GLOBAL_ARGS is not None, "args are not initialized"
    return _GLOBAL_ARGS


def set_args(args: Optional[argparse.Namespace]) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def _add_megatron_args(parser: argparse.ArgumentParser) -> None:
    """The subset of Megatron-LM's arguments this recipe uses, under Megatron's names and defaults."""
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=32)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=16)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: 2 x micro-batch-size x data-parallel size (two micro-batches per iteration)")
    g.add_argument("--train-iters", type=int, default=4)
    g.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=1e-2)
    g.add_argument("--min-lr", type=float, default=1e-3)
    g.add_argument("--lr-decay-style", type=str, default="cosine", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--use-cpu-initialization", action="store_true", default=True)
    g.add_argument("--log-interval", type=int, default=1)
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g = parser.add_argument_group(title="moe")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-token-dispatcher-type", type=str, default="allgather", choices=["allgather"])
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)


def parse_args(extra_args_provider: Optional[Callable] = None, ignore_unknown_args: bool = False,
               argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Megatron-LM's ``parse_args(extra_args_provider, ignore_unknown_args)`` (plus derived values)."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    _add_megatron_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    args.rank = int(os.environ.get("RANK", "0"))
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return args


def validate_args(args: argparse.Namespace, defaults: Optional[dict] = None) -> argparse.Namespace:
    """Defaults and derived values, as Megatron-LM's ``validate_args`` computes them."""
    for key, value in (defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    args.data_parallel_size = args.world_size // model_parallel
    if args.global_batch_size is None:
        args.global_batch_size = 2 * args.micro_batch_size * args.data_parallel_size
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    args.padded_vocab_size = args.vocab_size
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float32
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    args.iteration = 0
    return args


def core_transformer_config_from_args(args: argparse.Namespace) -> Any:
    """Megatron-LM's ``core_transformer_config_from_args`` for the arguments above."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, use_cpu_initialization=args.use_cpu_initialization,
        params_dtype=args.params_dtype, pipeline_dtype=args.params_dtype, bf16=args.bf16,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        **_moe_config(args))


def _moe_config(args: argparse.Namespace) -> dict:
    """Megatron-LM's MoE flags as ``TransformerConfig`` fields (none without ``--num-experts``)."""
    if not getattr(args, "num_experts", None):
        return {}
    return dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                moe_expert_capacity_factor=args.moe_expert_capacity_factor, add_bias_linear=False,
                expert_model_parallel_size=args.expert_model_parallel_size)


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


# ------------------------------------------------------------------------------------------ initialization
def initialize_megatron(extra_args_provider: Optional[Callable] = None, args_defaults: Optional[dict] = None,
                        ignore_unknown_args: bool = False) -> argparse.Namespace:
    """Parse arguments, start gloo, the parallel groups and the micro-batch calculator (on the CPU)."""
    global _CPU_PATCHES
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron_cpu import CpuPatches, init_parallel

    args = validate_args(parse_args(extra_args_provider, ignore_unknown_args), args_defaults)
    set_args(args)
    if _CPU_PATCHES is None:
        _CPU_PATCHES = CpuPatches().install()
        if getattr(args, "expert_model_parallel_size", 1) > 1:
            _CPU_PATCHES.for_expert_parallel()
    init_parallel(args)
    init_num_microbatches_calculator(args.rank, None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)
    torch.manual_seed(args.seed)
    return args


# ------------------------------------------------------------------------------------------ model and optimizer
def get_model(model_provider_func: Callable, model_type: Any = None, wrap_with_ddp: bool = True) -> list:
    """Model chunks of this rank (one per virtual pipeline stage), each in megatron-core's DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron_cpu import chunk_stage

    args = get_args()
    vpp = args.virtual_pipeline_model_parallel_size
    model = []
    for vp_stage in (range(vpp) if vpp else [None]):
        chunk = model_provider_func(**chunk_stage(vp_stage))
        chunk.model_type = model_type
        model.append(chunk.to(args.params_dtype))
    if not wrap_with_ddp:
        return model
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=args.use_distributed_optimizer)
    return [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(model)]


def get_optimizer_param_scheduler(optimizer: Any) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = get_args()
    decay = args.train_iters * args.global_batch_size
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
                                   lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
                                   lr_decay_steps=decay, lr_decay_style=args.lr_decay_style,
                                   start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=decay,
                                   wd_incr_style="constant")


def setup_model_and_optimizer(model_provider_func: Callable, model_type: Any = None,
                              checkpointing_context: Any = None) -> tuple:
    """Megatron-LM's ``setup_model_and_optimizer``: (model chunks, Megatron optimizer, LR scheduler)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    args = get_args()
    model = get_model(model_provider_func, model_type)
    config = OptimizerConfig(optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                             adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                             bf16=args.bf16, params_dtype=args.params_dtype, clip_grad=args.clip_grad,
                             use_distributed_optimizer=args.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(config, model)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    args.iteration = 0  # no checkpoint to load
    return model, optimizer, opt_param_scheduler


# ------------------------------------------------------------------------------------------ training
def train_step(forward_step_func: Callable, data_iterator: Iterator, model: list, optimizer: Any,
               opt_param_scheduler: Any, config: Any, forward_backward_func: Callable,
               iteration: Optional[int] = None) -> tuple:
    """Megatron-LM's ``train_step``: one iteration (all micro-batches, then the optimizer step)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    args = get_args()
    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=get_num_microbatches(), seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        decoder_seq_length=None, forward_only=False)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    if update_successful:
        opt_param_scheduler.step(increment=args.global_batch_size)
    skipped_iter = 0 if update_successful else 1
    loss_reduced = {}
    if losses_reduced:  # last pipeline stage: token-weighted mean over micro-batches, as Megatron-LM reports
        for key in losses_reduced[0]:
            total = torch.stack([x[key].view(-1) for x in losses_reduced]).sum(dim=0)
            loss_reduced[key] = total[0] / total[1]
    return loss_reduced, skipped_iter, grad_norm, num_zeros_in_grad


def train(forward_step_func: Callable, model: list, optimizer: Any, opt_param_scheduler: Any,
          train_data_iterator: Iterator, config: Any) -> int:
    """Megatron-LM's ``train`` loop (``train_step`` is looked up in this module, so it can be wrapped)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = get_args()
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    forward_backward_func = get_forward_backward_func()
    for m in model:
        m.train()
    LOSSES.clear()
    iteration = args.iteration
    while iteration < args.train_iters:
        loss_dict, skipped, grad_norm, _ = train_step(forward_step_func, train_data_iterator, model, optimizer,
                                                      opt_param_scheduler, config, forward_backward_func,
                                                      iteration=iteration)
        iteration += 1
        args.iteration = iteration
        if "lm loss" in loss_dict:
            loss = float(loss_dict["lm loss"])
            LOSSES.append(loss)
            if iteration % args.log_interval == 0 and _data_parallel_rank() == 0:
                lr = optimizer.param_groups[0]["lr"]
                print(f" iteration {iteration:8d}/{args.train_iters:8d} | learning rate: {lr:.6E} | "
                      f"lm loss: {loss!r} | grad norm: {float(grad_norm or 0):.6f} | skipped: {skipped}", flush=True)
    return iteration


def _data_parallel_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def pretrain(train_valid_test_dataset_provider: Callable, model_provider: Callable, model_type: Any,
             forward_step_func: Callable, process_non_loss_data_func: Optional[Callable] = None,
             extra_args_provider: Optional[Callable] = None, args_defaults: Optional[dict] = None,
             **kwargs: Any) -> None:
    """Megatron-LM's ``pretrain``: initialize, build model and optimizer, build data, train."""
    from megatron.core.utils import get_model_config

    args = initialize_megatron(extra_args_provider, args_defaults or {})
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
    train_ds, _, _ = train_valid_test_dataset_provider([args.train_iters * args.global_batch_size, 0, 0])
    iterator = _micro_batches(train_ds, args)
    if len(model) > 1:  # virtual pipeline: one iterator per model chunk, as Megatron-LM builds them
        iterator = [_micro_batches(train_ds, args) for _ in model]
    train(forward_step_func, model, optimizer, opt_param_scheduler, iterator, get_model_config(model[0]))


def _micro_batches(dataset: Any, args: argparse.Namespace) -> Iterator[dict]:
    """Megatron's pretraining sampler in small: consecutive micro-batches, this DP rank's share."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    start = dp_rank * args.micro_batch_size
    step = args.micro_batch_size * args.data_parallel_size
    i = start
    while True:
        samples = [dataset[(i + k) % len(dataset)] for k in range(args.micro_batch_size)]
        i += step
        yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


# ------------------------------------------------------------------------------------------ the GPT pieces
class SyntheticTokens(torch.utils.data.Dataset):
    """Deterministic random token sequences (``tokens``/``labels`` shifted by one)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (max(num_samples, 1), seq_length + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        row = self.data[i]
        return {"tokens": row[:-1], "labels": row[1:]}


def train_valid_test_datasets_provider(train_val_test_num_samples: list) -> tuple:
    args = get_args()
    return SyntheticTokens(train_val_test_num_samples[0], args.seq_length, args.padded_vocab_size, args.seed), None, None


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None) -> Any:
    """A ``GPTModel`` with the local (no Transformer Engine) layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    args = get_args()
    return GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=get_gpt_layer_local_spec(num_experts=getattr(args, "num_experts", None)),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False, **({} if vp_stage is None else {"vp_stage": vp_stage}))


def get_batch(data_iterator: Iterator) -> tuple:
    args = get_args()
    batch = next(data_iterator)
    tokens, labels = batch["tokens"], batch["labels"]
    seq = tokens.shape[1]
    attention_mask = torch.tril(torch.ones(1, 1, seq, seq)) < 0.5  # True = masked out
    position_ids = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    del args
    return tokens, labels, loss_mask, attention_mask, position_ids


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    """Summed masked token loss, the token count and the report (Megatron-LM's GPT ``loss_func``)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def forward_step(data_iterator: Iterator, model: Any) -> tuple:
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def main() -> None:
    from megatron.core.enums import ModelType

    from msprobe_integrations.megatron import add_args, install

    from megatron_cpu import finish_megatron

    hooks = install(sys.modules[__name__], patch_parse_args=False)  # flags come through extra_args_provider
    try:
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 extra_args_provider=add_args)
    finally:
        hooks.close()  # the last dump step and the monitor's files are written; msprobe lets go of the model
    finish_megatron()  # pretrain's model and optimizer are out of scope: the groups go, the process exits 0


if __name__ == "__main__":
    main()

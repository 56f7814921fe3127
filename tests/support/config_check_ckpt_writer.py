"""Writes real megatron-core GPT checkpoints for the checkpoint-compare tests (run under torchrun, gloo, CPU).

    torchrun --nproc-per-node 1 tests/support/config_check_ckpt_writer.py reference OUT
    torchrun --nproc-per-node 2 tests/support/config_check_ckpt_writer.py parallel OUT
    torchrun --nproc-per-node 1 tests/support/config_check_ckpt_writer.py deepspeed OUT

``reference`` (one process) builds a Llama-shaped GPTModel (4 layers, GQA, SwiGLU, RMSNorm, RoPE, no bias)
and writes it as Megatron-LM does with TP=1 (``OUT/tp1``: ``latest_checkpointed_iteration.txt`` +
``iter_0000001/mp_rank_00/model_optim_rng.pt``), as megatron-core's distributed checkpoint
(``OUT/dist_tp1``), once more with layer 2's ``linear_fc2.weight`` perturbed (``OUT/tp1_perturbed``), and the
model's logits for fixed tokens (``OUT/logits.pt``). ``parallel`` (two processes) loads ``OUT/dist_tp1``
into the same model re-sharded by megatron-core itself (``dist_checkpointing.load``) with TP=2 and with
PP=2 x virtual pipeline 2, and writes both in Megatron-LM's layout (``OUT/tp2``: ``mp_rank_00``/``mp_rank_01``;
``OUT/pp2vpp2``: ``mp_rank_00_000``/``mp_rank_00_001`` with ``model0``/``model1``), plus the TP=2 model as a
distributed checkpoint (``OUT/dist_tp2``). ``deepspeed`` (one process) trains a small torch model two steps
with ``deepspeed.initialize`` under ZeRO-2 and ZeRO-3, saves each with ``engine.save_checkpoint``
(``OUT/ds_zero2``, ``OUT/ds_zero3``) and the module's state dict (``OUT/ds_zero{2,3}.pt``). The Megatron-LM
file layout is written here because PyPI's megatron-core has no ``megatron.training``; the models, their state
dicts and the re-sharding are megatron-core's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_support as ms  # noqa: E402

from msprobe_core.session import finish_distributed  # noqa: E402

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ = 4, 32, 4, 2, 48, 128, 16
PERTURBED = "decoder.layers.2.mlp.linear_fc2.weight"


def config(tp: int = 1, pp: int = 1, vpp=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                             ffn_hidden_size=FFN, use_cpu_initialization=True, params_dtype=torch.float32,
                             pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                             normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                             add_bias_linear=False, layernorm_epsilon=1e-5, tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)


def chunks(cfg, vpp=None) -> list:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(0)
    out = []
    for vp in range(vpp or 1):
        stage = vp if vpp else None
        out.append(GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                            max_sequence_length=SEQ, position_embedding_type="rope",
                            share_embeddings_and_output_weights=False, vp_stage=stage,
                            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)))
    return out


def megatron_args(tp: int, pp: int, vpp=None) -> argparse.Namespace:
    """The ``args`` Megatron-LM stores (the fields the checkpoint reader uses, under Megatron's names)."""
    return argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=1,
                              num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                              group_query_attention=True, num_query_groups=GROUPS, ffn_hidden_size=FFN,
                              swiglu=True, padded_vocab_size=VOCAB, params_dtype=torch.float32)


def save_legacy(root: Path, folder: str, models: list, args: argparse.Namespace, perturb: bool = False) -> None:
    """Megatron-LM's ``save_checkpoint`` layout for this rank."""
    from megatron.core import parallel_state

    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if args.pipeline_model_parallel_size > 1 else "")
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 1}
    sds = [m.state_dict_for_save_checkpoint() for m in models]
    if perturb:
        sds[0][PERTURBED] = sds[0][PERTURBED] + 1e-3
    if len(sds) == 1:
        state["model"] = sds[0]
    else:
        state.update({f"model{i}": sd for i, sd in enumerate(sds)})
    target = root / folder / "iter_0000001" / name
    target.mkdir(parents=True, exist_ok=True)
    torch.save(state, target / "model_optim_rng.pt")
    (root / folder / "latest_checkpointed_iteration.txt").write_text("1")


def load_resharded(models: list, source: Path) -> None:
    from megatron.core import dist_checkpointing

    sharded = {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}
    loaded = dist_checkpointing.load(sharded, str(source))
    for i, m in enumerate(models):
        m.load_state_dict(loaded[f"model{i}"], strict=False)


def reference(root: Path) -> None:
    from megatron.core import dist_checkpointing

    ms.initialize_model_parallel(1, 1)
    model = chunks(config())[0]
    save_legacy(root, "tp1", [model], megatron_args(1, 1))
    save_legacy(root, "tp1_perturbed", [model], megatron_args(1, 1), perturb=True)
    (root / "dist_tp1").mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(root / "dist_tp1"))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    model.eval()
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).unsqueeze(0).expand(2, SEQ), mask)
    torch.save({"tokens": tokens, "logits": logits}, root / "logits.pt")


def parallel(root: Path) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    ms.initialize_model_parallel(2, 1)
    tp2 = chunks(config(tp=2))
    load_resharded(tp2, root / "dist_tp1")
    save_legacy(root, "tp2", tp2, megatron_args(2, 1))
    (root / "dist_tp2").mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(tp2[0].sharded_state_dict(), str(root / "dist_tp2"))
    parallel_state.destroy_model_parallel()
    ms.initialize_model_parallel(1, 2, vpp=2)
    pp2 = chunks(config(pp=2, vpp=2), vpp=2)
    load_resharded(pp2, root / "dist_tp1")
    save_legacy(root, "pp2vpp2", pp2, megatron_args(1, 2, 2))


def deepspeed_checkpoints(root: Path) -> None:
    import deepspeed

    for stage in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                               config=config)
        for _ in range(2):
            loss = engine(torch.randn(4, 7)).square().mean()
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(str(root / f"ds_zero{stage}"), tag="global_step2")
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # a no-op below ZeRO-3
            state = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
        torch.save(state, root / f"ds_zero{stage}.pt")


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    if phase == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        deepspeed_checkpoints(out)  # its engines are released on return
        finish_distributed()
        return
    with ms.CpuPatches():
        ms.init_distributed(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        try:
            (reference if phase == "reference" else parallel)(out)
            torch.distributed.barrier()
        finally:
            ms.destroy()


if __name__ == "__main__":
    main()

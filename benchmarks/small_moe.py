"""The mixture-of-experts benchmark workload: a small HF transformers Qwen3-MoE of the small GPT's size
(``benchmarks.small_gpt``: 4 layers, hidden 256, 4 heads, sequence 128, batch 8, vocabulary 2048), each
MLP replaced by 8 experts (intermediate 256), top-2, trained with AdamW on the CPU with the same synthetic
batches and the same ``train`` loop."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.small_gpt import GPTConfig

NUM_EXPERTS = 8
TOP_K = 2


class LogitsOnly(nn.Module):
    """The HF model called as ``model(ids) -> logits``, as ``small_gpt.train`` calls its model."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


def build(seed: int = 0, cfg: GPTConfig | None = None):
    """Model, AdamW optimizer and 64 batches, like ``small_gpt.build``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = cfg or GPTConfig()
    torch.manual_seed(seed)
    hf = Qwen3MoeConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=4 * cfg.hidden,
                        moe_intermediate_size=cfg.hidden, num_hidden_layers=cfg.layers,
                        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, num_experts=NUM_EXPERTS,
                        num_experts_per_tok=TOP_K, max_position_embeddings=cfg.seq, decoder_sparse_step=1,
                        norm_topk_prob=True)
    model = LogitsOnly(Qwen3MoeForCausalLM(hf))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    data = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen) for _ in range(64)]
    return model, opt, data

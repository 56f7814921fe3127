"""Tiny real mixture-of-experts models (HF transformers 5: Qwen3-MoE and Mixtral, 8 experts, top-2) and the
test fault that starves one expert, for the MoE monitor tests and benchmark."""

from __future__ import annotations

import torch

NUM_EXPERTS = 8
TOP_K = 2


def tiny_qwen3_moe(seed: int = 0, layers: int = 2):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=64,
                         decoder_sparse_step=1, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(cfg)


def tiny_mixtral(seed: int = 0, layers: int = 2):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=1000, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=NUM_EXPERTS,
                        num_experts_per_tok=TOP_K, max_position_embeddings=64)
    return MixtralForCausalLM(cfg)


MODELS = {"qwen3_moe": tiny_qwen3_moe, "mixtral": tiny_mixtral}


class StarveExpert:
    """From forward call ``from_call`` on (one call per micro-batch), a forward hook on an HF ``*TopKRouter``
    lowers ``expert``'s logit by 1e4 and routes again from the lowered logits (softmax, top-k, the router's
    own normalisation), so that the expert is never chosen. The fault, not the tool: its hook replaces the
    router's output before the monitor's hook sees it."""

    def __init__(self, router: torch.nn.Module, expert: int, from_call: int):
        self.router, self.expert, self.from_call = router, expert, from_call
        self.calls = 0
        self.handle = router.register_forward_hook(self._hook, prepend=True)

    def _hook(self, module, args, output):
        self.calls += 1
        if not module.training or self.calls <= self.from_call:
            return None
        logits = output[0].clone()
        logits[:, self.expert] -= 1e4
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, module.top_k, dim=-1)
        if getattr(module, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

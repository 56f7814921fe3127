"""A tiny real Llama and a synthetic dataset for the Hugging Face Trainer tests and recipe."""

from __future__ import annotations

import torch


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16, vocab=1000, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def training_args(out, **kw):
    from transformers import TrainingArguments
    base = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-3, seed=0, data_seed=0,
                dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)

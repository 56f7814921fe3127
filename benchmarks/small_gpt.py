"""The benchmark workload shared by every benchmark: a small GPT trained with AdamW on CPU.

4 layers, hidden 256, 4 heads, sequence 128, batch 8, vocabulary 2048, synthetic tokens, fixed seed.
``train(steps, hooks)`` runs the loop and calls the optional hooks around each step, so a benchmark can
put the tool in without changing the workload.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab: int = 2048
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 128
    batch: int = 8


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q = q.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        k = k.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        v = v.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, s, h)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.out = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SmallGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(seed: int = 0, cfg: Optional[GPTConfig] = None):
    """Model, AdamW optimizer and a fixed list of 64 batches (inputs, targets): no batch repeats within a
    benchmark run, so the run is a healthy one (a repeated batch makes gradient norms jump, which the
    monitor's alerts rightly report)."""
    cfg = cfg or GPTConfig()
    torch.manual_seed(seed)
    model = SmallGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    data = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen) for _ in range(64)]
    return model, opt, data


def train(model: nn.Module, opt: torch.optim.Optimizer, data, steps: int = 5,
          before_step: Optional[Callable[[int], None]] = None,
          after_step: Optional[Callable[[int], None]] = None) -> tuple[list[float], float]:
    """Run ``steps`` training steps; returns (losses, seconds). Hooks run around each step."""
    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        batch = data[i % len(data)]
        if before_step:
            before_step(i)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if after_step:
            after_step(i)
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def timed_train(model: nn.Module, opt: torch.optim.Optimizer, data, steps: int,
                warmup: int) -> tuple[list[float], list[float], list[float]]:
    """``warmup + steps`` training steps; (losses, wall-clock and process CPU seconds of each step after the
    warmup)."""
    stamps: list[tuple[float, float]] = []

    def stamp(_: int = 0) -> None:
        stamps.append((time.perf_counter(), time.process_time()))

    losses, _ = train(model, opt, data, steps=warmup + steps, before_step=stamp)
    stamp()
    times = [b[0] - a[0] for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]
    cpu = [b[1] - a[1] for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]
    return losses, times, cpu

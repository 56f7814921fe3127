"""Small real torch models for the dump tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyNet(nn.Module):
    """linear -> Sequential(linear, relu) -> relu: names are easy to assert."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x):
        return F.relu(self.block(self.linear(x)))


class ResidualAttention(nn.Module):
    """nn.MultiheadAttention with residuals: a graph that reuses tensors several times."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.ln(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + a
        x = x + self.ff(x) + x * 0.5
        return self.head(x).mean(dim=1)


def train_steps(model, data, steps, before=None, after=None, lr=0.05):
    """SGD+momentum steps; returns (losses, gradients per step as lists of tensors)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, grads = [], []
    for i in range(steps):
        if before:
            before(i)
        x, y = data[i % len(data)]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if after:
            after(i)
        losses.append(loss.item())
    return losses, grads


def make_data(n=3, batch=4, seq=5, d=16, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, seq, d, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]

"""The MindSpore benchmark workload: a small pre-norm transformer trained with Adam on CPU (PyNative).

Built only from ops with CPU kernels: ``mint.nn.Linear``, ``nn.LayerNorm``, multi-head attention from
``mint.matmul`` and ``mint.nn.functional.softmax``, a ``relu`` MLP, and a mean squared error written with tensor
arithmetic. 2 blocks, hidden 128, 4 heads, sequence 64, batch 8, synthetic data, fixed seed. ``train`` calls
the optional hooks around each step, so a benchmark puts the tool in without changing the workload.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import mindspore as ms
from mindspore import mint, nn


@dataclass
class NetConfig:
    inputs: int = 32
    hidden: int = 128
    heads: int = 4
    blocks: int = 2
    seq: int = 64
    batch: int = 8
    outputs: int = 8


class Attention(nn.Cell):
    def __init__(self, cfg: NetConfig):
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = mint.nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = mint.nn.Linear(cfg.hidden, cfg.hidden)

    def construct(self, x):
        b, s, h = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = mint.matmul(q, k.transpose(-2, -1)) * (self.head_dim ** -0.5)
        att = mint.nn.functional.softmax(att, dim=-1)
        y = mint.matmul(att, v).permute(0, 2, 1, 3).reshape(b, s, h)
        return self.proj(y)


class Block(nn.Cell):
    def __init__(self, cfg: NetConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm((cfg.hidden,))
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm((cfg.hidden,))
        self.fc1 = mint.nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.fc2 = mint.nn.Linear(4 * cfg.hidden, cfg.hidden)

    def construct(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(mint.nn.functional.relu(self.fc1(self.norm2(x))))


class SmallNet(nn.Cell):
    def __init__(self, cfg: NetConfig):
        super().__init__()
        self.embed = mint.nn.Linear(cfg.inputs, cfg.hidden)
        self.blocks = nn.CellList([Block(cfg) for _ in range(cfg.blocks)])
        self.norm = nn.LayerNorm((cfg.hidden,))
        self.head = mint.nn.Linear(cfg.hidden, cfg.outputs)

    def construct(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(cfg: NetConfig = NetConfig(), seed: int = 0):
    """(net, optimizer, loss-and-gradients function, batches)."""
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_seed(seed)
    net = SmallNet(cfg)
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-3)

    def forward(x, y):
        return ((net(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    rng = np.random.RandomState(seed)
    batches = [(ms.Tensor(rng.randn(cfg.batch, cfg.seq, cfg.inputs).astype(np.float32)),
                ms.Tensor(rng.randn(cfg.batch, cfg.seq, cfg.outputs).astype(np.float32))) for _ in range(4)]
    return net, opt, grad_fn, batches


def train(net, opt, grad_fn, batches, steps: int, before: Optional[Callable[[int], None]] = None,
          after: Optional[Callable[[int], None]] = None) -> tuple[list[float], list[float], list[float]]:
    """``steps`` training steps; returns the losses and each step's seconds (wall clock, and this process's
    CPU time)."""
    losses, wall, cpu = [], [], []
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        x, y = batches[i % len(batches)]
        if before is not None:
            before(i)
        loss, grads = grad_fn(x, y)
        opt(grads)
        if after is not None:
            after(i)
        losses.append(float(loss.asnumpy()))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return losses, wall, cpu

"""Small MindSpore networks for the MindSpore dump tests (built only from ops with CPU kernels), their
PyTorch twins for the cross-framework compare tests, and a tiny training loop.

``TinyNet``: a linear embedding, one pre-norm transformer block (``nn.LayerNorm``, single-head attention
from ``mint.matmul`` and ``mint.nn.functional.softmax``, an MLP with ``relu``) and a linear head; the loss is
a mean squared error written with tensor arithmetic (``mint.nn.functional.mse_loss`` has no CPU kernel).
"""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import mint, nn

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)

IN, DIM, OUT, BATCH, SEQ = 8, 16, 4, 2, 5


class Attention(nn.Cell):
    def __init__(self, dim: int):
        super().__init__()
        self.q = mint.nn.Linear(dim, dim)
        self.k = mint.nn.Linear(dim, dim)
        self.v = mint.nn.Linear(dim, dim)
        self.proj = mint.nn.Linear(dim, dim)
        self.scale = dim ** -0.5

    def construct(self, x):
        scores = mint.matmul(self.q(x), self.k(x).transpose(-2, -1)) * self.scale
        weights = mint.nn.functional.softmax(scores, dim=-1)
        return self.proj(mint.matmul(weights, self.v(x)))


class Block(nn.Cell):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm((dim,))
        self.attn = Attention(dim)
        self.norm2 = nn.LayerNorm((dim,))
        self.fc1 = mint.nn.Linear(dim, 2 * dim)
        self.fc2 = mint.nn.Linear(2 * dim, dim)

    def construct(self, x):
        h = x + self.attn(self.norm1(x))
        return h + self.fc2(mint.nn.functional.relu(self.fc1(self.norm2(h))))


class TinyNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.embed = mint.nn.Linear(IN, DIM)
        self.block = Block(DIM)
        self.head = mint.nn.Linear(DIM, OUT)

    def construct(self, x):
        return self.head(self.block(self.embed(x)))


def data(steps: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` batches (x, y) as float32 arrays."""
    rng = np.random.RandomState(seed)
    return [(rng.randn(BATCH, SEQ, IN).astype(np.float32), rng.randn(BATCH, SEQ, OUT).astype(np.float32))
            for _ in range(steps)]


def build(seed: int = 0):
    """A TinyNet with seeded weights, its SGD optimizer and the loss-and-gradients function."""
    ms.set_seed(seed)
    net = TinyNet()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.05)

    def forward(x, y):
        return ((net(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    return net, opt, grad_fn


def train(net, opt, grad_fn, batches, before=None, after=None):
    """Train on ``batches``; ``before(i)`` / ``after(i)`` run around each step. Returns (losses, grads) as
    NumPy arrays (the gradients of every step, in parameter order)."""
    losses, grads_seen = [], []
    for i, (x, y) in enumerate(batches):
        if before is not None:
            before(i)
        loss, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
        opt(grads)
        if after is not None:
            after(i)
        losses.append(loss.asnumpy().copy())
        grads_seen.append([g.asnumpy().copy() for g in grads])
    return losses, grads_seen


def torch_twin(net):
    """The same network in PyTorch with ``net``'s weights copied (LayerNorm gamma/beta -> weight/bias)."""
    import torch
    import torch.nn.functional as F

    class TAttention(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.q, self.k, self.v, self.proj = (torch.nn.Linear(dim, dim) for _ in range(4))
            self.scale = dim ** -0.5

        def forward(self, x):
            scores = torch.matmul(self.q(x), self.k(x).transpose(-2, -1)) * self.scale
            return self.proj(torch.matmul(F.softmax(scores, dim=-1), self.v(x)))

    class TBlock(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(dim, eps=1e-7)  # MindSpore's default epsilon
            self.attn = TAttention(dim)
            self.norm2 = torch.nn.LayerNorm(dim, eps=1e-7)
            self.fc1 = torch.nn.Linear(dim, 2 * dim)
            self.fc2 = torch.nn.Linear(2 * dim, dim)

        def forward(self, x):
            h = x + self.attn(self.norm1(x))
            return h + self.fc2(F.relu(self.fc1(self.norm2(h))))

    class TTinyNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(IN, DIM)
            self.block = TBlock(DIM)
            self.head = torch.nn.Linear(DIM, OUT)

        def forward(self, x):
            return self.head(self.block(self.embed(x)))

    for cls, name in ((TAttention, "Attention"), (TBlock, "Block"), (TTinyNet, "TinyNet")):
        cls.__name__ = cls.__qualname__ = name
    model = TTinyNet()
    state = {p.name.replace(".gamma", ".weight").replace(".beta", ".bias"): torch.from_numpy(p.asnumpy().copy())
             for p in net.get_parameters()}
    model.load_state_dict(state, strict=True)
    return model


def numpy_forward(weights: dict[str, np.ndarray], x: np.ndarray) -> dict[str, np.ndarray]:
    """TinyNet's forward pass in NumPy float64 from ``weights`` (parameter name -> array): the outputs of
    each cell by path, to check the dump's statistics against values computed without MindSpore."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}

    def linear(name, h):
        return h @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def layer_norm(name, h):
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return (h - mean) / np.sqrt(var + 1e-7) * w[f"{name}.gamma"] + w[f"{name}.beta"]

    out: dict[str, np.ndarray] = {}
    out["embed"] = e = linear("embed", x.astype(np.float64))
    out["block.norm1"] = n1 = layer_norm("block.norm1", e)
    q, k, v = (linear(f"block.attn.{p}", n1) for p in "qkv")
    scores = q @ k.swapaxes(-2, -1) * DIM ** -0.5
    att = np.exp(scores - scores.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    out["block.attn"] = a = linear("block.attn.proj", att @ v)
    h = e + a
    out["block.norm2"] = n2 = layer_norm("block.norm2", h)
    out["block.fc1"] = f1 = linear("block.fc1", n2)
    out["block.fc2"] = f2 = linear("block.fc2", np.maximum(f1, 0))
    out["block"] = b = h + f2
    out["head"] = linear("head", b)
    return out


def weights_of(net) -> dict[str, np.ndarray]:
    """``net``'s parameters as NumPy copies, by name."""
    return {p.name: p.asnumpy().copy() for p in net.get_parameters()}

"""A zoo of small, varied training workloads for judging the monitor's alerts (built from configs, no downloads).

Each workload is a model, its optimizer and LR schedule, and the training loop habits that make healthy
statistics move: masks holding -inf or ``finfo.min``, the smallest GPT a new user tries (``tiny_gpt``: 2
layers, hidden 64, AdamW, no schedule), Hugging Face Llama and GPT-2 from tiny configs,
BatchNorm and Dropout on SGD with momentum, LR warm-up and decay, gradient clipping, gradient accumulation,
autocast fp16/bf16 with a dynamic loss scaler (``torch.amp.GradScaler`` on CPU; the fp16 one starts at a
scale that overflows, so the scaler skips steps), small noisy batches.

``FAULTS`` are the real faults a monitor must catch at their step, naming their module or parameter:
a weight multiplied by 50 and by 5, a NaN or Inf weight, a NaN in the input batch, the learning rate
multiplied by 100, a gradient that explodes in one layer.

Used by ``benchmarks/monitor_alerts.py`` and the tests (``tests/test_monitor_rules.py``)::

    w = build("hf_llama")
    mon = TrainerMon(config); mon.set_monitor(w.model, w.grad_acc, w.optimizer)
    run(w, steps=40, fault=Fault("weight_x50", step=25))
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 40
"""Healthy steps per workload."""
FAULT_STEP = 25
"""The step a fault is injected at (enough history before it, a few steps after it)."""
ALL_OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
MONITOR_CONFIG: dict[str, Any] = {
    "xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": True,
    "ops": ALL_OPS, "format": "api",
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]},
}
"""Every metric on and msprobe's default rule (AnomalyTurbulence, threshold 0.5)."""


@dataclass
class Workload:
    """A model with its training habits. ``batch(step, micro)`` gives a micro-batch; ``loss(batch)`` its loss."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int, int], Any]
    loss: Callable[[Any], torch.Tensor]
    target: str
    """The parameter (``named_parameters`` name) weight and gradient faults are injected into."""
    scheduler: Any = None
    grad_acc: int = 1
    clip: Optional[float] = None
    amp: Optional[torch.dtype] = None
    scaler: Optional[torch.amp.GradScaler] = None
    float_input: bool = False
    """The input batch is floating point (a NaN can be put into it)."""
    notes: str = ""
    skipped: list[int] = field(default_factory=list)
    """Steps whose update the loss scaler skipped."""


# --------------------------------------------------------------------------------------------- models
class MHABlock(nn.Module):
    """Pre-LN transformer block on ``nn.MultiheadAttention`` with an explicit attention mask."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.drop(self.proj(self.act(self.fc(self.ln2(x)))))


class MHAGPT(nn.Module):
    """A GPT on ``nn.MultiheadAttention`` whose causal mask is float -inf, float ``finfo.min`` or boolean."""

    def __init__(self, mask_kind: str, vocab: int = 128, hidden: int = 32, heads: int = 4, layers: int = 2,
                 seq: int = 16, dropout: float = 0.1):
        super().__init__()
        self.mask_kind = mask_kind
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(MHABlock(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def causal_mask(self, t: int) -> torch.Tensor:
        if self.mask_kind == "neginf":  # what nn.Transformer.generate_square_subsequent_mask makes
            return nn.Transformer.generate_square_subsequent_mask(t)
        if self.mask_kind == "finfo":
            return torch.triu(torch.full((t, t), torch.finfo(torch.float32).min), 1)
        return torch.ones(t, t, dtype=torch.bool).triu(1)  # True: not allowed to attend

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = self.causal_mask(t)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class TinyBlock(nn.Module):
    """Pre-LN transformer block whose MLP is ``fc1`` -> GELU -> ``fc2``."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """The smallest GPT a new user tries first: 2 layers, hidden 64, 4 heads, sequence 32, vocabulary 256."""

    def __init__(self, vocab: int = 256, hidden: int = 64, heads: int = 4, layers: int = 2, seq: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(TinyBlock(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class SmallCNN(nn.Module):
    """Conv-BatchNorm-ReLU twice, Dropout, a linear classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.fc(self.drop(x.flatten(1)))


class NoisyMLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act1 = nn.Tanh()
        self.fc2 = nn.Linear(hidden, hidden)
        self.act2 = nn.ReLU()
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act2(self.fc2(self.act1(self.fc1(x)))))


# ------------------------------------------------------------------------------------- data and schedules
def _token_batches(vocab: int, batch: int, seq: int, seed: int) -> Callable[[int, int], torch.Tensor]:
    """Deterministic token batches (batch, seq + 1) from a skewed unigram distribution (learnable)."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1

    def get(step: int, micro: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 100_003 + step * 31 + micro)
        return torch.multinomial(weights, batch * (seq + 1), replacement=True, generator=g).view(batch, seq + 1)

    return get


def _lm_loss(model: nn.Module, hf: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(tokens: torch.Tensor) -> torch.Tensor:
        if hf:
            return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        logits = model(tokens[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    return loss


def warmup_decay(optimizer: torch.optim.Optimizer, warmup: int = 8, total: int = STEPS,
                 floor: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0, then cosine decay to ``floor`` x the base LR."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ------------------------------------------------------------------------------------------ workloads
def _mha(mask_kind: str, seed: int) -> Workload:
    torch.manual_seed(seed)
    model = MHAGPT(mask_kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return Workload(f"mha_{mask_kind}_mask", model, opt, _token_batches(128, 8, 16, seed), _lm_loss(model),
                    "blocks.1.fc.weight", scheduler=warmup_decay(opt), clip=1.0,
                    notes=f"nn.MultiheadAttention GPT, {mask_kind} causal mask, AdamW, warm-up + cosine, clip 1.0")


def _tiny_gpt(seed: int) -> Workload:
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Workload("tiny_gpt", model, opt, _token_batches(256, 8, 32, seed), _lm_loss(model),
                    "blocks.0.fc1.weight", notes="TinyGPT (2 layers, hidden 64), AdamW, no schedule, no clipping")


def _hf_llama(seed: int) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"  # the additive finfo.min mask goes through every layer
    model = LlamaForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=6, num_training_steps=STEPS)
    return Workload("hf_llama", model, opt, _token_batches(128, 4, 16, seed), _lm_loss(model, hf=True),
                    "model.layers.1.mlp.up_proj.weight", scheduler=sched, clip=1.0,
                    notes="transformers LlamaForCausalLM (eager attention), linear warm-up + decay, clip 1.0")


def _hf_gpt2(seed: int) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    return Workload("hf_gpt2", model, opt, _token_batches(128, 2, 16, seed), _lm_loss(model, hf=True),
                    "transformer.h.1.mlp.c_fc.weight", grad_acc=2,
                    notes="transformers GPT2LMHeadModel (dropout 0.1), gradient accumulation 2, batch 2")


def _cnn(seed: int) -> Workload:
    torch.manual_seed(seed)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    centers = torch.randn(10, 3, 1, 1, generator=torch.Generator().manual_seed(seed + 7))

    def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 7919 + step * 13 + micro)
        y = torch.randint(0, 10, (16,), generator=g)
        x = centers[y] + torch.randn(16, 3, 16, 16, generator=g)
        return x, y

    def loss(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b[0]).float(), b[1])

    return Workload("cnn_bn_sgd", model, opt, batch, loss, "conv2.weight", scheduler=warmup_decay(opt, warmup=5),
                    float_input=True, notes="CNN with BatchNorm and Dropout, SGD momentum 0.9, warm-up + cosine")


def _noisy_mlp(seed: int) -> Workload:
    torch.manual_seed(seed)
    model = NoisyMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(seed + 3))

    def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 4243 + step * 17 + micro)
        x = torch.randn(4, 16, generator=g)
        return x, x @ w + torch.randn(4, 1, generator=g)  # noise as large as the signal

    def loss(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(model(b[0]).float(), b[1])

    return Workload("noisy_mlp_b4", model, opt, batch, loss, "fc2.weight", clip=5.0, float_input=True,
                    notes="MLP regression, batch 4 with noise as large as the signal, Adam, clip 5.0")


def _amp(dtype: torch.dtype, seed: int) -> Workload:
    torch.manual_seed(seed)
    model = MHAGPT("neginf", dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # fp16: an initial scale the first steps overflow, so the scaler skips and halves (its dynamic range)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22 if dtype == torch.float16 else 2.0 ** 16,
                                  growth_interval=10)
    tag = "fp16" if dtype == torch.float16 else "bf16"
    return Workload(f"amp_{tag}_scaler", model, opt, _token_batches(128, 8, 16, seed), _lm_loss(model),
                    "blocks.1.fc.weight", scheduler=warmup_decay(opt), clip=1.0, amp=dtype, scaler=scaler,
                    notes=f"autocast {tag} + GradScaler (growth every 10 steps), warm-up + cosine, clip 1.0")


BUILDERS: dict[str, Callable[[int], Workload]] = {
    "mha_neginf_mask": lambda seed: _mha("neginf", seed),
    "mha_finfo_mask": lambda seed: _mha("finfo", seed),
    "mha_bool_mask": lambda seed: _mha("bool", seed),
    "tiny_gpt": _tiny_gpt,
    "hf_llama": _hf_llama,
    "hf_gpt2": _hf_gpt2,
    "cnn_bn_sgd": _cnn,
    "noisy_mlp_b4": _noisy_mlp,
    "amp_fp16_scaler": lambda seed: _amp(torch.float16, seed),
    "amp_bf16_scaler": lambda seed: _amp(torch.bfloat16, seed),
}
WORKLOADS = tuple(BUILDERS)


def build(name: str, seed: int = 0) -> Workload:
    """A fresh workload (same seed, same numbers)."""
    return BUILDERS[name](seed)


# --------------------------------------------------------------------------------------------- faults
@dataclass
class Fault:
    """A fault injected at ``step`` (before its forward; gradient faults during its backward)."""

    kind: str
    step: int = FAULT_STEP
    _handle: Any = None

    def applies_to(self, w: Workload) -> bool:
        return self.kind != "nan_input" or w.float_input

    def before_step(self, w: Workload) -> None:
        param = dict(w.model.named_parameters())[w.target]
        with torch.no_grad():
            if self.kind == "weight_x50":
                param.mul_(50)
            elif self.kind == "weight_x5":
                param.mul_(5)
            elif self.kind == "nan_weight":
                param.view(-1)[param.numel() // 3] = math.nan
            elif self.kind == "inf_weight":
                param.view(-1)[param.numel() // 3] = math.inf
        if self.kind == "lr_x100":
            for group in w.optimizer.param_groups:
                group["lr"] *= 100
            if w.scheduler is not None:  # the schedule keeps the new LR (a wrong base LR mid-run)
                w.scheduler.base_lrs = [lr * 100 for lr in w.scheduler.base_lrs]
        elif self.kind == "grad_explode":
            self._handle = param.register_hook(lambda g: g * 1e4)

    def corrupt_batch(self, batch: Any) -> Any:
        if self.kind != "nan_input":
            return batch
        x, y = batch
        x = x.clone()
        x.view(-1)[7] = math.nan
        return x, y

    def after_step(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def expected(self, w: Workload) -> str:
        """What the alert must name: a parameter, its module, a learning rate or the input."""
        if self.kind == "nan_input":
            return "the input of the first module"
        if self.kind == "lr_x100":
            return "the learning rate"
        return w.target

    def named_by(self, w: Workload, anomaly: Any) -> bool:
        """Does ``anomaly`` (the fault step's first alert) name this fault's origin?"""
        if self.kind == "nan_input":
            return anomaly.kind == "actv" and ".input" in anomaly.name and anomaly.rule == "AnomalyNan"
        if self.kind == "lr_x100":
            return anomaly.kind == "lr"
        owner = w.target.rpartition(".")[0]
        return anomaly.name == w.target or anomaly.module == owner


FAULTS = ("weight_x50", "weight_x5", "nan_weight", "inf_weight", "nan_input", "lr_x100", "grad_explode")


# ------------------------------------------------------------------------------------------ training
def run(w: Workload, steps: int = STEPS, fault: Optional[Fault] = None,
        before_step: Optional[Callable[[int], None]] = None,
        after_step: Optional[Callable[[int], None]] = None) -> list[float]:
    """Train ``steps`` optimizer steps; returns the losses (the last micro-batch's, unscaled).

    The loop: zero_grad; per micro-batch forward (under autocast when ``w.amp``) and backward (scaled
    when there is a loss scaler); unscale; clip; ``optimizer.step()`` (through the scaler, which skips it
    on Inf/NaN gradients); scaler update; LR schedule step.
    """
    losses: list[float] = []
    model, opt = w.model, w.optimizer
    model.train()
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        if fault is not None and fault.step == step:
            fault.before_step(w)
        opt.zero_grad(set_to_none=True)
        for micro in range(w.grad_acc):
            batch = w.batch(step, micro)
            if fault is not None and fault.step == step:
                batch = fault.corrupt_batch(batch)
            with torch.autocast("cpu", dtype=w.amp, enabled=w.amp is not None):
                loss = w.loss(batch) / w.grad_acc
            (w.scaler.scale(loss) if w.scaler is not None else loss).backward()
            losses.append(float(loss.detach()) * w.grad_acc)
        if w.scaler is not None:
            w.scaler.unscale_(opt)
        if w.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
        if w.scaler is not None:
            scale = w.scaler.get_scale()
            w.scaler.step(opt)
            w.scaler.update()
            if w.scaler.get_scale() < scale:
                w.skipped.append(step)
        else:
            opt.step()
        if w.scheduler is not None:
            with warnings.catch_warnings():  # a step the loss scaler skipped did not call optimizer.step()
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                w.scheduler.step()
        if fault is not None and fault.step == step:
            fault.after_step()
        if after_step is not None:
            after_step(step)
    return losses

"""Real L1 dumps for the acc_check tests, written by msprobe_core.pytorch.PrecisionDebugger."""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from msprobe_core.acc_check.records import LOW_PRECISION, normalize_dtype
from msprobe_core.pytorch import PrecisionDebugger
from small_gpt import GPTConfig, SmallGPT

TINY = GPTConfig(vocab=64, layers=1, hidden=32, heads=2, seq=8, batch=2)


def dump_step(path: Path, task: str, step: Callable[[], None], register: Optional[Callable] = None) -> Path:
    """Run ``step`` between start() and stop()/step() of an L1 dump (``task`` statistics or tensor); the
    path of the dump.json written."""
    PrecisionDebugger.reset()
    try:
        debugger = PrecisionDebugger(dump_path=str(path), level="L1", task=task)
        if register:
            register(debugger)
        debugger.start()
        step()
        debugger.stop()
        debugger.step()
    finally:
        PrecisionDebugger.reset()
    (found,) = glob.glob(os.path.join(path, "step0", "*", "dump.json"))
    return Path(found)


def gpt_step(cfg: GPTConfig = TINY, seed: int = 0) -> Callable[[], None]:
    """One forward/backward of the small GPT in bfloat16 autocast (loss in float32)."""
    torch.manual_seed(seed)
    model = SmallGPT(cfg)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), ids[:, 1:].reshape(-1))
        loss.backward()

    return step


@contextlib.contextmanager
def perturbed(module, name: str, factor: float = 1 + 2 ** -6):
    """``module.name`` returns its float16/bfloat16 results (torch or MindSpore tensors) multiplied by ``factor`` (a
    kernel wrong by more than its dtype's rounding); float32/float64 results are untouched, so the benchmark stays
    right."""
    original = getattr(module, name)

    def wrong(*args, **kwargs):
        out = original(*args, **kwargs)
        if normalize_dtype(str(getattr(out, "dtype", ""))) in LOW_PRECISION:  # a torch or MindSpore tensor
            out = out * factor
        return out

    setattr(module, name, wrong)
    try:
        yield
    finally:
        setattr(module, name, original)

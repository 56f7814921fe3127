"""Real L1 dumps for the acc_check tests, written by msprobe_core.pytorch.PrecisionDebugger."""

from __future__ import annotations

import contextlib
import csv
import glob
import os
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from msprobe_core.acc_check.api_calls import LOW_PRECISION, normalize_dtype
from msprobe_core.acc_check.runner import RunSummary
from msprobe_core.acc_check.standards import ERROR
from msprobe_core.pytorch import PrecisionDebugger
from small_gpt import GPTConfig, SmallGPT

TINY = GPTConfig(vocab=64, layers=1, hidden=32, heads=2, seq=8, batch=2)
ERROR_DATA_PARTS = ("forward.input", "forward.output.tested", "forward.output.bench",
                    "backward.input", "backward.output.tested", "backward.output.bench")


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


def check_only_failure(summary: RunSummary, api: str, out: Path, suffix: str) -> dict[str, Path]:
    """Asserts that ``api`` is the run's only failing call, forward and backward (an RMSE error), and that
    ``-save_error_data`` wrote exactly its inputs and both outputs under ``out/error_data`` as
    ``{api}.{part}{suffix}`` (``suffix``: ``.pt``, ``.0.npy``); returns those files by part."""
    assert summary.failed == [api]
    with open(summary.result_csv, newline="", encoding="utf-8") as f:
        row = next(r for r in csv.DictReader(f) if r["API Name"] == api)
    assert (row["Forward Test Success"], row["Backward Test Success"]) == (ERROR, ERROR)
    assert "RMSE" in row["Message"]
    saved = {p.name: p for p in (out / "error_data").rglob("*." + suffix.rsplit(".", 1)[-1])}
    assert sorted(saved) == sorted(f"{api}.{part}{suffix}" for part in ERROR_DATA_PARTS)
    return {part: saved[f"{api}.{part}{suffix}"] for part in ERROR_DATA_PARTS}

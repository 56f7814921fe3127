"""What the examples of README.md and docs/ run on: the small models the tests already build, and the config
files the examples name. Each page imports what it needs in an invisible code block
(``<!-- invisible-code-block: python ... -->``), so a reader sees only the example and the test runs it whole."""

from __future__ import annotations

import json
from pathlib import Path

DUMP_CONFIG = {"task": "statistics", "level": "L1", "dump_path": "./dump_path", "step": [], "rank": []}
"""``config.json`` / ``dump.json`` of the examples: msprobe's keys, L1 statistics of every step and rank."""
MONITOR_CONFIG = {"targets": {}, "xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
                  "ops": ["min", "max", "norm", "nans"], "format": "csv",
                  "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}}
"""``monitor.json`` of the examples: msprobe's monitor keys, CSV output, the default alert rule."""


def write_configs(folder: str = ".") -> None:
    """``config.json``, ``dump.json`` and ``monitor.json`` in ``folder`` (the example's working folder)."""
    for name, doc in (("config.json", DUMP_CONFIG), ("dump.json", DUMP_CONFIG), ("monitor.json", MONITOR_CONFIG)):
        Path(folder, name).write_text(json.dumps(doc))


def llama(batches: int = 2, seed: int = 0):
    """A tiny Hugging Face Llama (2 layers, hidden 64), its AdamW and a loader of ``batches`` batches of 4
    sequences of 16 tokens, each batch a dict with ``input_ids`` and ``labels``."""
    import torch
    from hf_support import TokenDataset, tiny_llama
    model = tiny_llama(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(TokenDataset(n=4 * batches, seed=seed), batch_size=4)
    return model, optimizer, loader


def trainer_inputs(max_steps: int = 2):
    """``(model, args, ds)`` for a ``transformers.Trainer``: the tiny Llama, TrainingArguments on the CPU
    (``max_steps`` steps of 4 sequences, no checkpoints) and a token dataset."""
    from hf_support import TokenDataset, tiny_llama, training_args
    return tiny_llama(), training_args("trainer_output", max_steps=max_steps), TokenDataset(n=16)


def mindspore_net(steps: int = 2):
    """MindSpore's small network of the MindSpore tests: ``(net, forward, optimizer, loader)``, ``forward(x, y)``
    its loss and ``loader`` ``steps`` batches of MindSpore tensors."""
    import mindspore as ms
    import ms_models
    net, optimizer, _ = ms_models.build()

    def forward(x, y):
        return ((net(x) - y) ** 2).mean()

    loader = [(ms.Tensor(x), ms.Tensor(y)) for x, y in ms_models.data(steps)]
    return net, forward, optimizer, loader


def fresh(folder: str) -> None:
    """Starts the next example of a page in its own sub-folder ``folder`` (with the config files) and without a
    process-wide debugger: as if it ran in a new script."""
    import os
    from msprobe_core.pytorch import PrecisionDebugger
    PrecisionDebugger.reset()
    try:
        from msprobe_core.mindspore import PrecisionDebugger as MsDebugger
    except ImportError:
        MsDebugger = None
    if MsDebugger is not None and "mindspore" in __import__("sys").modules:
        MsDebugger.reset()
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    write_configs()


def dumped(step: int = 0, dump_path: str = "dump_path") -> list:
    """The dump.json files the example wrote for ``step`` (one per rank folder, ``rank{R}`` or ``proc{pid}``);
    an AssertionError naming what is there when there is none."""
    import glob
    import os
    found = glob.glob(os.path.join(dump_path, f"step{step}", "*", "dump.json"))
    assert found, f"no dump.json for step {step} under {dump_path}: {os.listdir(dump_path) if os.path.isdir(dump_path) else 'no folder'}"
    return found


def small_dump(dump_path: str, perturb: float = 0.0, nan: bool = False, task: str = "statistics",
               level: str = "mix", steps: int = 1) -> str:
    """A dump of the tests' small attention model (``ResidualAttention``, fixed weights and data) at
    ``dump_path``: ``perturb`` is added to one weight of ``ff.0`` (a run that diverges there), ``nan`` puts a
    NaN into that weight (a run whose NaN starts there). Returns ``dump_path``."""
    import torch
    import torch.nn.functional as F
    from dump_models import ResidualAttention, make_data
    from msprobe_core.pytorch import PrecisionDebugger
    PrecisionDebugger.reset()
    torch.manual_seed(0)
    model = ResidualAttention()
    with torch.no_grad():
        model.ff[0].weight[0, 0] += perturb
        if nan:
            model.ff[0].weight[0, 0] = float("nan")
    debugger = PrecisionDebugger(dump_path=dump_path, task=task, level=level)
    for x, y in make_data(n=steps):
        debugger.start(model)
        F.cross_entropy(model(x), y).backward()
        debugger.stop()
        debugger.step()
    PrecisionDebugger.reset()
    return dump_path


def small_model(batches: int = 2):
    """The tests' small attention model (``ResidualAttention``: LayerNorm, nn.MultiheadAttention, an MLP,
    residuals), its SGD optimizer and ``batches`` batches ``(x, y)`` for ``F.cross_entropy``."""
    import torch
    from dump_models import ResidualAttention, make_data
    torch.manual_seed(0)
    model = ResidualAttention()
    return model, torch.optim.SGD(model.parameters(), lr=0.05), make_data(n=batches)


def cli(*args: str, ok=(0,)) -> str:
    """Runs ``python -m msprobe_core ARGS`` as a reader would type it; its output, or an AssertionError with it
    when the exit status is not in ``ok``."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "msprobe_core", *args], capture_output=True, text=True)
    assert proc.returncode in ok, f"exit {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return proc.stdout

"""Builders of small synthetic dump folders for the compare tests (msprobe's dump.json layout).

``DumpBuilder`` collects records made from numpy arrays and writes ``dump.json``, ``stack.json``,
``construct.json`` and, for task ``tensor``, one ``.pt`` per tensor. ``mlp_run`` builds the L1 (or mix)
dump of a tiny numpy MLP's forward and backward, optionally with a perturbed weight or an extra call,
so that differences propagate the way they do in a real run.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

TORCH_DTYPES = {np.dtype(np.float32): "torch.float32", np.dtype(np.float64): "torch.float64",
                np.dtype(np.float16): "torch.float16", np.dtype(np.int64): "torch.int64",
                np.dtype(np.bool_): "torch.bool"}


class DumpBuilder:
    """Records of one rank folder, written by ``write``."""

    def __init__(self, task: str = "tensor", level: str = "L1", summary_mode: str = "statistics"):
        self.task = task
        self.level = level
        self.summary_mode = summary_mode
        self.data: dict[str, Any] = {}
        self.tensors: dict[str, np.ndarray] = {}
        self.construct: dict[str, Optional[str]] = {}
        self.stack: dict[str, list[str]] = {}

    # -------------------------------------------------------------- leaves
    def summary(self, arr: np.ndarray, data_name: str) -> dict:
        """A tensor summary as the dumper writes it."""
        arr = np.asarray(arr)
        out: dict[str, Any] = {"type": "torch.Tensor", "dtype": TORCH_DTYPES.get(arr.dtype, f"torch.{arr.dtype}"),
                               "shape": list(arr.shape)}
        if self.task == "structure" or arr.size == 0:
            out.update(Max=None, Min=None, Mean=None, Norm=None)
        else:
            x = arr.astype(np.float64)
            out.update(Max=float(x.max()), Min=float(x.min()), Mean=float(x.mean()),
                       Norm=float(np.sqrt((x * x).sum())))
        out["requires_grad"] = False
        if self.summary_mode == "md5":
            out["md5"] = f"{zlib.crc32(np.ascontiguousarray(arr).tobytes()):08x}"
        if self.task == "tensor":
            out["data_name"] = data_name
            self.tensors[data_name] = arr
        return out

    def leaf(self, value: Any, data_name: str) -> Any:
        """A dump.json ARG for ``value`` (array, list/tuple, None, or plain value)."""
        if value is None:
            return None
        if isinstance(value, np.ndarray):
            return self.summary(value, data_name + ".pt")
        if isinstance(value, (list, tuple)):
            return [self.leaf(v, f"{data_name}.{i}") for i, v in enumerate(value)]
        return {"type": type(value).__name__, "value": value}

    # -------------------------------------------------------------- records
    def forward(self, name: str, inputs: Sequence[Any] = (), outputs: Sequence[Any] = (),
                kwargs: Optional[dict] = None, params: Optional[dict] = None, parent: Optional[str] = None,
                stack: Optional[list[str]] = None) -> str:
        """Add a forward record (API or module); returns its name."""
        rec: dict[str, Any] = {
            "input_args": [self.leaf(v, f"{name}.input.{i}") for i, v in enumerate(inputs)],
            "input_kwargs": {k: self.leaf(v, f"{name}.input.{k}") for k, v in (kwargs or {}).items()},
            "output": [self.leaf(v, f"{name}.output.{i}") for i, v in enumerate(outputs)],
        }
        if params is not None:
            rec["parameters"] = {k: self.leaf(v, f"{name}.parameters.{k}") for k, v in params.items()}
        self.data[name] = rec
        if parent is not None or self.level in ("L0", "mix"):
            self.construct[name] = parent
        self.stack[name] = stack or [f"File /work/model.py, line {10 + len(self.data)}, in forward, \n  y = op(x)"]
        return name

    def backward(self, name: str, inputs: Sequence[Any] = (), outputs: Sequence[Any] = (),
                 parent: Optional[str] = None) -> str:
        """Add a backward record; returns its name."""
        self.data[name] = {"input": [self.leaf(v, f"{name}.input.{i}") for i, v in enumerate(inputs)],
                           "output": [self.leaf(v, f"{name}.output.{i}") for i, v in enumerate(outputs)]}
        if parent is not None or self.level in ("L0", "mix"):
            self.construct[name] = parent
        return name

    def param_grad(self, name: str, grads: dict[str, np.ndarray]) -> str:
        """Add a parameters_grad record."""
        self.data[name] = {k: [self.summary(v, f"{name}.{k}.pt")] for k, v in grads.items()}
        return name

    # -------------------------------------------------------------- output
    def write(self, rank_dir: Path, dump_json: bool = True) -> Path:
        """Write the rank folder; with ``dump_json=False`` leave a crash journal instead of dump.json."""
        rank_dir = Path(rank_dir)
        rank_dir.mkdir(parents=True, exist_ok=True)
        tensor_dir = rank_dir / "dump_tensor_data"
        if self.task == "tensor":
            import torch

            tensor_dir.mkdir(exist_ok=True)
            for data_name, arr in self.tensors.items():
                torch.save(torch.from_numpy(np.ascontiguousarray(arr)), tensor_dir / data_name)
        header = {"task": self.task, "level": self.level, "framework": "pytorch",
                  "dump_data_dir": str(tensor_dir) if self.task == "tensor" else None}
        if dump_json:
            (rank_dir / "dump.json").write_text(json.dumps({**header, "data": self.data}, indent=1))
        else:
            (rank_dir / ".dump.journal").write_text(json.dumps({"k": "h", "v": header}) + "\n")
        (rank_dir / "stack.json").write_text(json.dumps(self.stack, indent=1))
        (rank_dir / "construct.json").write_text(json.dumps(self.construct if self.level != "L1" else {}))
        return rank_dir


def mlp_run(rank_dir: Path, task: str = "tensor", level: str = "L1", layers: int = 4, perturb: Optional[int] = None,
            extra_call_after: Optional[int] = None, seed: int = 0, summary_mode: str = "statistics",
            scale: float = 1.0) -> Path:
    """Dump a tiny numpy MLP (linear -> relu per layer, then a loss) with forward and backward records.

    ``perturb=k`` flips the sign of layer k's weight (a bug in a known layer); ``extra_call_after=k``
    adds one extra ``Tensor.mul`` (times 1) after layer k's relu, which shifts later call counts but no
    values. At level ``mix`` each layer is a module ``Module.layers.{k}.Layer.forward.0`` holding its APIs.
    """
    rng = np.random.default_rng(seed)
    b = DumpBuilder(task=task, level=level, summary_mode=summary_mode)
    x = rng.standard_normal((4, 8)).astype(np.float32) * scale
    weights = [(rng.standard_normal((8, 8)) / np.sqrt(8)).astype(np.float32) for _ in range(layers)]
    if perturb is not None:
        weights[perturb] = -weights[perturb]
    counts: dict[str, int] = {}

    def name(api: str, direction: str = "forward", count: Optional[int] = None) -> str:
        if count is None:
            count = counts.get(api, 0)
            counts[api] = count + 1
        return f"{api}.{count}.{direction}"

    acts = []
    mod_names = []
    for k, w in enumerate(weights):
        parent = None
        if level == "mix":
            parent = f"Module.layers.{k}.Layer.forward.0"
            mod_names.append(parent)
            b.construct[parent] = None
            b.data[parent] = {}  # filled after its calls, keeping call-start order
        y = x @ w.T
        lin = b.forward(name("Functional.linear"), [x, w], [y], parent=parent)
        r = np.maximum(y, 0)
        relu = b.forward(name("Functional.relu"), [y], [r], kwargs={"inplace": False}, parent=parent)
        if extra_call_after == k:
            b.forward(name("Tensor.mul"), [r, 1.0], [r.copy()], parent=parent)
        if level == "mix":
            b.data[parent] = {"input_args": [b.leaf(x, f"{parent}.input.0")], "input_kwargs": {},
                              "output": [b.leaf(r, f"{parent}.output.0")], "parameters": {}}
        acts.append((lin, relu, x, w, y))
        x = r
    loss = np.float32((x * x).mean())
    b.forward(name("Torch.mean"), [x * x], [np.array(loss, dtype=np.float32)])
    grad = (2 * x / x.size).astype(np.float32)
    for lin, relu, x_in, w, y in reversed(acts):
        g_y = (grad * (y > 0)).astype(np.float32)
        b.backward(relu.replace("forward", "backward"), [grad], [g_y])
        g_x = (g_y @ w).astype(np.float32)
        g_w = (g_y.T @ x_in).astype(np.float32)
        b.backward(lin.replace("forward", "backward"), [g_y], [g_x, g_w])
        grad = g_x
    return b.write(rank_dir)

"""PyTorch replay backend of acc_check.

Each recorded call (``Functional.*`` -> ``torch.nn.functional``, ``Torch.*`` -> ``torch``, ``Tensor.*`` ->
``torch.Tensor`` methods, ``VF.*`` -> ``torch._VF``) is rebuilt from its record: tensors from their
tensor files (``torch.load``) in real-data mode, otherwise from ``inputs.random_array``; plain values
exactly. It then runs

* **tested**: on the accelerator (CUDA, or NPU with torch_npu; the CPU when there is none) in the
  recorded dtypes. A call whose floating outputs are float16/bfloat16 while its floating inputs are
  float32 ran under autocast: it is replayed under ``torch.autocast`` with that dtype.
* **benchmark**: on the CPU in float64: floating inputs are converted to float64 (for autocast calls
  after rounding them to the autocast dtype, as autocast did, so the benchmark sees the kernel's
  inputs), floating ``dtype`` arguments become float64, device arguments become the CPU.

For calls that compute in float16/bfloat16 a third run is the **reference** of the dtype-aware standard
(see ``standards``): the benchmark again on the CPU, computed in float32 with every aten operation's result
rounded to float16/bfloat16 precision (a ``TorchDispatchMode``; backward formulas are rounded op by op as
well, fused attention runs as its math decomposition): what a correct kernel computing in float32 and
rounding its output gives.

All run forward and, when recorded inputs require gradients and the call returns floating outputs,
backward: the gradients of the outputs come from the dump's backward record (its tensor files, or
random values matching its statistics), or are random in [-1, 1] when the dump has no backward record.

Not replayed (listed with the reason): distributed calls, custom APIs (a prefix or name torch does not
have), random ops (dropout with p > 0 in training, rand*, normal, bernoulli, ...), ops returning
uninitialized memory (empty*), writes into part of another tensor (``__setitem__``, ``set_``,
``resize_``, ``as_strided_``: in-place ops on views), and arguments the dump could not describe.
Other in-place ops are replayed on a copy of their target.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from msprobe_core.acc_check.inputs import call_rng, random_array
from msprobe_core.acc_check.api_calls import LOW_PRECISION, ApiCall, TensorSpec, Typed, normalize_dtype, precision_rank
from msprobe_core.acc_check.replay import OutputPair, Replay, Unreplayable
from msprobe_core.acc_check.replay_common import (benchmark_failed, failure_text, grad_output_specs, is_in_place,
                                                  forward_pairs, output_leaves, run_backwards, run_tested,
                                                  shared_reason, typed_in, unknown_typed_reason)
from msprobe_core.acc_check.standards import round_to
from msprobe_core.dumpdir.tensor_reader import ArrayTensor
from msprobe_core.files.safe_names import name_max, safe_file_name

_OWNERS: dict[str, Any] = {"Functional": torch.nn.functional, "Torch": torch, "Tensor": torch.Tensor,
                           "VF": torch._VF}
_CASTS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16", "double", "view", "view_as"})
_KNOWN_TYPED = frozenset({"torch.dtype", "torch.device", "torch.Size"})


def make_backend(device_index: Optional[int] = None, workers: int = 1) -> "TorchBackend":
    """The backend of one process: the accelerator ``device_index`` when there is one, else the CPU (with
    the CPUs shared among ``workers`` processes)."""
    index = device_index or 0
    if torch.cuda.is_available():
        device = f"cuda:{index}"
    elif hasattr(torch, "npu") and torch.npu.is_available():  # torch_npu
        device = f"npu:{index}"
    else:
        device = "cpu"
        if workers > 1:
            try:
                cpus = len(os.sched_getaffinity(0))
            except AttributeError:
                cpus = os.cpu_count() or 1
            torch.set_num_threads(max(1, cpus // workers))
    return TorchBackend(device)


def _autocast_dtype(call: ApiCall) -> Optional[str]:
    """The autocast dtype a call ran under, inferred from its dtypes (None when it did not)."""
    if call.api in _CASTS or any(t.type == "torch.dtype" for t in typed_in((call.args, call.kwargs))):
        return None
    ins = [s for s in call.input_tensors() if s.is_float]
    outs = {s.dtype for s in call.output_tensors() if s.is_float}
    if not ins or len(outs) != 1:
        return None
    low = next(iter(outs))
    if low not in LOW_PRECISION:
        return None
    if any(s.dtype == "float32" and s.shape for s in ins) and all(s.dtype in ("float32", low) for s in ins):
        return low
    return None


def _array(value: Any) -> tuple[ArrayTensor, str]:
    """A tensor or Python value as a numpy ``ArrayTensor`` and the name of its dtype."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        name = str(t.dtype)
        if t.dtype == torch.bfloat16:
            raw = t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
            return ArrayTensor(raw, "bfloat16", tuple(t.shape)), name
        try:
            raw = t.numpy()
        except TypeError:  # float8 and other dtypes numpy lacks
            raw = t.to(torch.float32).numpy()
        return ArrayTensor(raw.reshape(-1), normalize_dtype(name), tuple(t.shape)), name
    arr = np.asarray(value)
    if arr.dtype.kind not in "biufc":
        raise TypeError(f"output of type {type(value).__name__}")
    return ArrayTensor(arr.reshape(-1), str(arr.dtype), tuple(arr.shape)), type(value).__name__


def _from_values(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` from a numpy array, rounding float16/bfloat16 with numpy (several times faster
    than torch's own conversions from float64 on CPU)."""
    if dtype == torch.bfloat16:
        raw = round_to(values.reshape(-1), "bfloat16", values.shape).raw
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).reshape(values.shape)
    if dtype == torch.float16:
        return torch.from_numpy(values.astype(np.float16))
    if dtype == torch.float32:
        return torch.from_numpy(values.astype(np.float32, copy=False))
    return torch.from_numpy(values).to(dtype)


def _upcast(t: torch.Tensor, dtype: torch.dtype = torch.float64,
            round_first: Optional[torch.dtype] = None) -> torch.Tensor:
    """A floating CPU tensor as ``dtype`` (float32 or float64; complex tensors as the complex of that width),
    rounded to ``round_first`` on the way (as autocast rounds its inputs)."""
    if t.is_complex():
        return t.to(torch.complex128 if dtype == torch.float64 else torch.complex64)
    if round_first is not None and t.dtype != round_first and t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = _from_values(t.detach().numpy(), round_first)
    if t.dtype in (torch.bfloat16, torch.float16):
        values = _array(t)[0].values()  # float32, by numpy
        return torch.from_numpy(values.astype(np.float64) if dtype == torch.float64 else values).reshape(t.shape)
    return t.to(dtype)


_SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11}
_FLOAT16_OVERFLOW = 65520.0  # float16 rounds values of this magnitude and above to infinity


def _round_precision(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 ``t`` rounded to nearest at ``dtype``'s precision, staying float32 (Veltkamp splitting: three
    multiply/subtracts instead of two slow dtype conversions). float16's range is applied; its subnormals
    keep 11 bits."""
    c = t * (2.0 ** (24 - _SIGNIFICAND_BITS[dtype]) + 1.0)
    rounded = c - (c - t)
    if dtype == "float16":
        rounded = torch.where(rounded.abs() >= _FLOAT16_OVERFLOW, rounded.sign() * torch.inf, rounded)
    return torch.where(rounded.isnan(), t, rounded)  # infinities (and values near float32's limit) stay


class _InPrecision(TorchDispatchMode):
    """Runs float32 code as if every aten operation rounded its result to ``dtype``."""

    def __init__(self, dtype: str):
        super().__init__()
        self.dtype = dtype

    def _round(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
            return _round_precision(t, self.dtype)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = [r.alias_info for r in func._schema.returns]
        if not any(aliases):
            return tree_map(self._round, out)
        for alias, value in zip(aliases, out if isinstance(out, (list, tuple)) else [out]):
            written = alias is not None and alias.is_write  # in-place ops and out= write the rounded result
            if written and isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                value.copy_(_round_precision(value, self.dtype))
        return out  # views share their input's (already rounded) values


def _output_leaves(out: Any) -> list[tuple[str, Any]]:
    return output_leaves(out, torch.Size)


def _tensors(out: Any) -> list[torch.Tensor]:
    return [v for _, v in _output_leaves(out) if isinstance(v, torch.Tensor)]


def _lower(dtype: str, autocast: Optional[str]) -> str:
    if autocast and precision_rank(autocast) < precision_rank(dtype) and dtype in ("float32", "float64"):
        return autocast
    return dtype


@dataclass
class _Side:
    """One replay of a call: tested (accelerator, recorded dtypes, autocast), benchmark (CPU float64) or
    reference (the benchmark in float32 with every operation rounded to ``precision``). ``leaves``: input
    tensor index -> the tensor whose gradient is compared."""

    args: list
    kwargs: dict
    leaves: dict[int, torch.Tensor]
    device: str
    autocast: Optional[str] = None
    precision: Optional[str] = None
    out: Any = None

    def _mode(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.enable_grad())
        if self.precision:
            # fused attention runs as its math decomposition, whose every step the mode rounds
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
            stack.enter_context(_InPrecision(self.precision))
        return stack

    def run(self, fn: Callable) -> None:
        """The forward call; its output goes to ``out``."""
        with self._mode():
            if self.autocast:
                with torch.autocast(torch.device(self.device).type, dtype=getattr(torch, self.autocast)):
                    self.out = fn(*self.args, **self.kwargs)
            else:
                self.out = fn(*self.args, **self.kwargs)

    def grads(self, indices: list[int], host_grads: list[torch.Tensor], order: list[int]) -> tuple:
        """Gradients of the leaves ``order`` for the output tensors ``indices`` receiving ``host_grads``."""
        outs = _tensors(self.out)
        chosen = [outs[i] for i in indices]
        grads = [(_upcast(g, o.dtype) if o.dtype in (torch.float32, torch.float64) and self.device == "cpu" else g)
                 .to(self.device, o.dtype) for g, o in zip(host_grads, chosen)]
        with self._mode():
            out = torch.autograd.grad(chosen, [self.leaves[i] for i in order], grads, allow_unused=True)
        if self.precision:  # the gradient reaches a float16/bfloat16 input in that dtype
            return tuple(None if g is None else _round_precision(g, self.precision) for g in out)
        return out


class TorchBackend:
    """Replays recorded PyTorch calls; see the module docstring."""

    framework = "pytorch"

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.device_type = torch.device(device).type

    # ------------------------------------------------------------------ classification
    def unreplayable(self, call: ApiCall) -> Optional[str]:
        """The reason ``call`` cannot be replayed, or None."""
        shared = shared_reason(call)
        if shared:
            return shared
        owner = _OWNERS.get(call.prefix)
        if owner is None:
            return f"custom API: '{call.prefix}' is not a torch namespace (an API registered with register_custom_api?)"
        if getattr(owner, call.api, None) is None:
            return f"custom API: this torch ({torch.__version__}) has no {call.prefix}.{call.api}"
        return unknown_typed_reason(call, _KNOWN_TYPED)
        return None

    # ------------------------------------------------------------------ replay
    def replay(self, call: ApiCall, keep_data: bool) -> Replay:
        """Run ``call`` tested, as the float64 CPU benchmark and (float16/bfloat16 calls) as the in-dtype
        reference, forward and backward; see the module docstring."""
        fn = getattr(_OWNERS[call.prefix], call.api)
        rng = call_rng(call.name)
        notes: list[str] = []
        host_args = [self._host(node, rng, notes) for node in call.args]
        host_kwargs = {k: self._host(v, rng, notes) for k, v in call.kwargs.items()}
        autocast = _autocast_dtype(call)
        if autocast:
            notes.append(f"ran under autocast({autocast}) (inferred from the dtypes)")
        in_place = is_in_place(call)
        args, tested, t_error = self._run_tested(fn, call, host_args, host_kwargs, autocast, in_place)
        bench = self._side(args, host_kwargs, call, bench=True, autocast=autocast, in_place=in_place)
        try:
            bench.run(fn)
        except Exception as e:  # noqa: BLE001
            raise Unreplayable(benchmark_failed(e, t_error)) from None
        if t_error is not None:
            failure = f"the tested call on {self.device} raised {failure_text(t_error)}"
            return Replay([], forward_failure=failure, notes=notes)
        replay = Replay(forward_pairs(call, _output_leaves(tested.out), _output_leaves(bench.out), torch.Tensor,
                                      lambda name, t, b, path: _pair(name, t, b, autocast, path), notes), notes=notes)
        grads = self._backward(call, tested, bench, autocast, rng, replay)
        ref_dtype = _reference_dtype(call, autocast)
        if ref_dtype:
            reference = self._side(args, host_kwargs, call, bench=True, autocast=autocast, in_place=in_place,
                                   precision=ref_dtype)
            replay.reference = lambda: _run_reference(fn, reference, replay, grads)
        if keep_data:
            replay.save = _saver(call.name, host_args, host_kwargs, tested.out, bench.out, grads)
        return replay

    def _run_tested(self, fn: Callable, call: ApiCall, host_args: list, host_kwargs: dict, autocast: Optional[str],
                    in_place: bool) -> tuple[list, _Side, Optional[BaseException]]:
        """The tested forward: (the positional arguments used, the tested side holding its output, the
        exception it raised)."""
        def attempt(args: list) -> _Side:
            tested = self._side(args, host_kwargs, call, bench=False, autocast=autocast, in_place=in_place)
            tested.run(fn)
            return tested

        return run_tested(call, host_args, attempt, lambda tested: [tuple(t.shape) for t in _tensors(tested.out)])

    def _host(self, node: Any, rng: np.random.Generator, notes: list[str]) -> Any:
        """A record tree with tensors built on the CPU in their recorded dtype (files or random values)."""
        if isinstance(node, TensorSpec):
            return self._tensor(node, rng, notes)
        if isinstance(node, list):
            return [self._host(v, rng, notes) for v in node]
        if isinstance(node, dict):
            return {k: self._host(v, rng, notes) for k, v in node.items()}
        return node

    def _tensor(self, spec: TensorSpec, rng: np.random.Generator, notes: list[str]) -> torch.Tensor:
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise Unreplayable(f"tensor dtype {spec.framework_dtype!r} is not a torch dtype")
        if spec.data_path:
            t = torch.load(spec.data_path, map_location="cpu", weights_only=True)
            if isinstance(t, torch.Tensor) and t.dtype == dtype and tuple(t.shape) == spec.shape:
                return t
            notes.append(f"{os.path.basename(spec.data_path)} does not hold a {spec.dtype}{list(spec.shape)} tensor: "
                         "random values used")
        return _from_values(random_array(spec, rng), dtype)

    def _value(self, node: Any, bench: bool, compute: torch.dtype = torch.float64) -> Any:
        if not isinstance(node, Typed):
            return node
        if node.type == "torch.dtype":
            dtype = getattr(torch, str(node.value).rsplit(".", 1)[-1])
            if bench and dtype.is_floating_point:
                return compute
            if bench and dtype.is_complex:
                return torch.complex128 if compute == torch.float64 else torch.complex64
            return dtype
        if node.type == "torch.device":
            return torch.device("cpu" if bench or str(node.value).startswith("cpu") else self.device)
        return torch.Size(node.value)  # the only other _KNOWN_TYPED

    def _side(self, args: list, kwargs: dict, call: ApiCall, bench: bool, autocast: Optional[str], in_place: bool,
              precision: Optional[str] = None) -> _Side:
        """One side's arguments from the host tree: tested (``bench`` False: the device, autocast) or benchmark
        (float64 on the CPU, autocast's rounding applied to the inputs; ``precision`` makes it the reference,
        in float32)."""
        specs = call.input_tensors()
        leaves: dict[int, torch.Tensor] = {}
        counter = iter(range(len(specs)))
        compute = torch.float32 if precision else torch.float64
        round_first = getattr(torch, autocast) if autocast else None

        def convert(node: Any) -> Any:
            if isinstance(node, torch.Tensor):
                i = next(counter)
                x = node
                if bench and (x.is_floating_point() or x.is_complex()):
                    x = _upcast(x, compute, round_first)
                elif not bench:
                    x = x.to(self.device)
                if specs[i].requires_grad and (x.is_floating_point() or x.is_complex()):
                    x = x.detach().requires_grad_(True)
                    leaves[i] = x
                return x
            if isinstance(node, (list, tuple)):
                return type(node)(convert(v) for v in node)
            if isinstance(node, dict):
                return {k: convert(v) for k, v in node.items()}
            return self._value(node, bench, compute)

        converted_args = [convert(v) for v in args]
        converted_kwargs = {k: convert(v) for k, v in kwargs.items()}
        if in_place and converted_args and isinstance(converted_args[0], torch.Tensor):
            converted_args[0] = converted_args[0].clone()  # never write into a leaf or the host copy
        if bench:
            return _Side(converted_args, converted_kwargs, leaves, "cpu", precision=precision)
        return _Side(converted_args, converted_kwargs, leaves, self.device, autocast=autocast)

    def _backward(self, call: ApiCall, tested: _Side, bench: _Side, autocast: Optional[str],
                  rng: np.random.Generator, replay: Replay) -> Optional[dict]:
        """Gradients of the recorded inputs on both sides; ``replay.backward`` gets their pairs. Returns what the
        backward was given and gave (the output gradients, the indices of the outputs and leaves they concern,
        both sides' input gradients), or None without a backward."""
        chosen = self._grad_outputs(call, tested, bench, rng, replay)
        if not chosen:
            return None
        indices = [i for i, _ in chosen]
        host_grads = [g for _, g in chosen]
        order = sorted(tested.leaves)
        grads = run_backwards(lambda: tested.grads(indices, host_grads, order),
                              lambda: bench.grads(indices, host_grads, order), replay, self.device)
        if grads is None:
            return None
        t_grads, b_grads = grads
        pairs = []
        for i, tg, bg in zip(order, t_grads, b_grads):
            if tg is None and bg is None:
                continue
            if tg is None or bg is None:
                side = "benchmark" if tg is None else "tested"
                replay.backward_failure = f"input {i} gets a gradient on the {side} side only"
                continue
            pairs.append(_pair(f"{call.name}.backward.output.{i}", tg, bg, autocast, i))
        replay.backward = pairs
        return {"grad_outputs": host_grads, "indices": indices, "order": order, "tested": list(t_grads),
                "bench": list(b_grads)}

    def _grad_outputs(self, call: ApiCall, tested: _Side, bench: _Side, rng: np.random.Generator,
                      replay: Replay) -> list[tuple[int, torch.Tensor]]:
        """(output tensor index, host gradient) of the outputs whose gradients are replayed: from the backward
        record (files or statistics), random in [-1, 1] when the dump has none; [] without a backward."""
        if not tested.leaves:
            return []
        b_count = len(_tensors(bench.out))
        outputs = [(t.requires_grad and (t.is_floating_point() or t.is_complex()) and i < b_count,
                    normalize_dtype(str(t.dtype)), str(t.dtype), tuple(t.shape)) for i, t in enumerate(_tensors(tested.out))]
        return [(i, self._tensor(spec, rng, replay.notes)) for i, spec in grad_output_specs(call, outputs, replay.notes)]


def _reference_dtype(call: ApiCall, autocast: Optional[str]) -> Optional[str]:
    """The float16/bfloat16 dtype a call computes in (autocast's, else its outputs' or inputs'), or None."""
    if autocast:
        return autocast
    for specs in (call.output_tensors(), call.input_tensors()):
        low = [s.dtype for s in specs if s.dtype in LOW_PRECISION]
        if low:
            return low[0]
    return None


def _pair(name: str, tested: Any, bench: Any, autocast: Optional[str], key: Any) -> OutputPair:
    tested_arr, tested_dtype = _array(tested)
    bench_arr, bench_dtype = _array(bench)
    return OutputPair(name, tested_arr, bench_arr, tested_dtype, bench_dtype, _lower(tested_arr.dtype, autocast),
                      key=key)


def _run_reference(fn: Callable, reference: _Side, replay: Replay, grads: Optional[dict]) -> None:
    """The in-dtype reference of ``replay``'s pairs of that precision, forward and backward (see ``standards``)."""
    reference.run(fn)
    outputs = dict(_output_leaves(reference.out))
    for pair in replay.forward:
        if pair.precision == reference.precision and pair.key in outputs:
            pair.reference = _array(outputs[pair.key])[0]
    if grads is None or not replay.backward:
        return
    r_grads = dict(zip(grads["order"], reference.grads(grads["indices"], grads["grad_outputs"], grads["order"])))
    for pair in replay.backward:
        if pair.precision == reference.precision and r_grads.get(pair.key) is not None:
            pair.reference = _array(r_grads[pair.key])[0]


def _detached(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, (list, tuple)):
        return [_detached(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    return obj


def _saver(name: str, args: list, kwargs: dict, t_out: Any, b_out: Any,
           grads: Optional[dict]) -> Callable[[Path, bool], None]:
    def save(folder: Path, with_backward: bool) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        files = {"forward.input": {"args": args, "kwargs": kwargs}, "forward.output.tested": t_out,
                 "forward.output.bench": b_out}
        if with_backward and grads is not None:
            files.update({"backward.input": grads["grad_outputs"], "backward.output.tested": grads["tested"],
                          "backward.output.bench": grads["bench"]})
        for suffix, obj in files.items():
            torch.save(_detached(obj), folder / safe_file_name(f"{name}.{suffix}", ".pt", name_max(folder)))

    return save


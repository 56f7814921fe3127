"""MindSpore replay backend of acc_check (dump.json framework ``mindspore``, and ``mindtorch`` for MSAdapter).

Native MindSpore records are replayed through the namespaces the dump wrapped: ``Mint.*`` ->
``mindspore.mint``, ``MintFunctional.*`` -> ``mindspore.mint.nn.functional``, ``Functional.*`` ->
``mindspore.ops``, ``Tensor.*`` -> ``mindspore.Tensor`` methods, and ``Primitive.{attribute}.{Class}`` ->
a fresh ``mindspore.ops.{Class}()`` when that primitive class has no attributes to set (``Dense``); a
primitive with attributes (``LayerNorm``'s axes and epsilon) is listed, since the dump does not record them.

MSAdapter (``mindtorch``) records carry PyTorch's names while their tensors were MindSpore's. mindtorch cannot
run next to the real torch (it replaces ``import torch``), and its own backward is a no-op, so they are
replayed with MindSpore's PyTorch-style API: ``Torch.*`` -> ``mindspore.mint``, ``Functional.*`` ->
``mindspore.mint.nn.functional``, ``Tensor.*`` -> ``mindspore.Tensor`` methods. A name that table does not
have (``VF.*``, ``Torch.X`` without ``mint.X``) is listed with the reason, and a call whose MindSpore
namesake returns other shapes than the recorded ones is listed too (the two APIs differ).

Each call runs in PyNative mode (``launch_blocking``, so a failing kernel is reported by its own call):

* **tested**: on the MindSpore device (Ascend/GPU when the build has one, else the CPU) in the recorded dtypes;
* **benchmark**: on the CPU in float64 (floating inputs and ``mindspore.dtype`` arguments become float64).

A MindSpore CPU kernel may lack float64 (``Var``), a dtype (no bfloat16 ``MatMul``) or exist in no dtype at all
(``GeluExt``, ``LayerNormExt``, ``LogSoftmaxExt`` in MindSpore 2.10). Then, never silently:

* no float64 benchmark kernel, float16/bfloat16 tested: the benchmark runs in float32 (noted in the Message);
  a float32 tested call is listed (a float32 benchmark would compare the kernel with itself);
* the tested dtype has no kernel on the tested device while the benchmark runs: listed as
  ``no {dtype} kernel on cpu`` (a limit of the device, not a wrong result);
* neither side runs: listed with both errors.

Backward: ``mindspore.vjp`` over the floating tensor inputs the dump marks ``requires_grad``, with the output
gradients of the dump's backward record (files, or random values matching its statistics; random in [-1, 1]
without a backward record). float16/bfloat16 results are judged against the correctly rounded benchmark
(``standards``: MindSpore has no mode that rounds every primitive's result, which an in-dtype reference needs).

Not replayed (listed with the reason): distributed calls, random ops, uninitialized memory, writes into part
of a tensor or into a Parameter, ``Jit`` graphs, custom APIs, arguments the dump could not describe.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import mindspore as ms
from mindspore import mint, ops

from msprobe_core.acc_check.inputs import call_rng, random_array
from msprobe_core.acc_check.api_calls import LOW_PRECISION, ApiCall, TensorSpec, Typed, dtype_kind, normalize_dtype
from msprobe_core.acc_check.replay import OutputPair, Replay, Unreplayable
from msprobe_core.acc_check.replay_common import (benchmark_failed, failure_text, grad_output_specs, is_in_place,
                                                  forward_pairs, output_leaves, run_backwards, run_tested,
                                                  shared_reason, unknown_typed_reason)
from msprobe_core.acc_check.standards import round_to
from msprobe_core.dumpdir.tensor_reader import ArrayTensor
from msprobe_core.files.safe_names import name_max, safe_file_name
from msprobe_core.mindspore.runtime import settle

MINDSPORE, MINDTORCH = "mindspore", "mindtorch"
_OWNERS: dict[str, dict[str, tuple[str, Any]]] = {
    MINDSPORE: {"Mint": ("mindspore.mint", mint), "MintFunctional": ("mindspore.mint.nn.functional", mint.nn.functional),
                "Functional": ("mindspore.ops", ops), "Tensor": ("mindspore.Tensor", ms.Tensor)},
    MINDTORCH: {"Torch": ("mindspore.mint", mint), "Functional": ("mindspore.mint.nn.functional", mint.nn.functional),
                "Tensor": ("mindspore.Tensor", ms.Tensor)},
}
_RANDOM = frozenset({"uniform", "standard_normal", "standard_laplace", "gamma", "random_gamma", "random_poisson",
                     "random_categorical", "shuffle", "choice_with_mask", "log_uniform_candidate_sampler",
                     "uniform_candidate_sampler", "laplace", "rand_ext", "randn_ext", "randperm_ext", "dropout_ext",
                     "multinomial_ext", "bernoulli_ext", "normal_ext"})
_PARAMETER_WRITES = frozenset({"assign", "assign_add", "assign_sub", "scatter_update", "scatter_nd_update",
                               "scatter_add", "scatter_sub", "scatter_max", "scatter_min", "scatter_mul", "scatter_div"})
_KNOWN_TYPED = frozenset({"mindspore.dtype", "torch.Size"})
_MS_DTYPES = {name: getattr(ms, name) for name in ("float16", "bfloat16", "float32", "float64", "int8", "int16",
                                                    "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                                    "complex64", "complex128") if hasattr(ms, name)}
_MS_DTYPES["bool"] = ms.bool_
_MISSING_KERNEL = ("unregistered", "Unsupported data type", "supports types", "Create kernelmod",
                   "does not support this kernel data type", "not support")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _setup(device_index: Optional[int], workers: int) -> str:
    """PyNative on the build's device (``device_index``), synchronous kernels; CPU kernels get CPUs / workers
    threads (MindSpore's default is 25 threads whatever the machine)."""
    target = ms.get_context("device_target")
    if target in ("Ascend", "GPU"):
        ms.set_device(target, device_index or 0)
        device = f"{target.lower()}:{device_index or 0}"
    else:
        ms.set_device("CPU")
        device = "cpu"
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.runtime.launch_blocking()
    try:
        ms.device_context.cpu.op_tuning.threads_num(max(1, _cpus() // max(1, workers)))
    except RuntimeError:  # set once per process already
        pass
    return device


def make_backend(device_index: Optional[int] = None, workers: int = 1) -> "MindSporeBackend":
    """The backend of one process replaying native MindSpore records (see the module docstring)."""
    return MindSporeBackend(_setup(device_index, workers), MINDSPORE)


def make_mindtorch_backend(device_index: Optional[int] = None, workers: int = 1) -> "MindSporeBackend":
    """The backend of one process replaying MSAdapter (mindtorch) records through MindSpore's PyTorch-style API."""
    return MindSporeBackend(_setup(device_index, workers), MINDTORCH)


@dataclass
class _Host:
    """A recorded tensor rebuilt on the host: its exact values (float32 for bfloat16) and dtype name."""

    values: np.ndarray
    dtype: str
    requires_grad: bool

    def tensor(self, bench_dtype: Optional[Any]) -> ms.Tensor:
        """As a MindSpore tensor: recorded dtype, or ``bench_dtype`` for floating values (complex: complex128)."""
        if bench_dtype is not None and dtype_kind(self.dtype) == "float":
            return ms.Tensor(self.values.astype(np.float64 if bench_dtype == ms.float64 else np.float32),
                             dtype=bench_dtype)
        if bench_dtype is not None and dtype_kind(self.dtype) == "complex":
            return ms.Tensor(self.values.astype(np.complex128))
        return ms.Tensor(self.values, dtype=_MS_DTYPES[self.dtype])


def _host_values(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` rounded to ``dtype`` and held exactly by NumPy (bfloat16 as float32)."""
    if dtype == "bfloat16":
        return round_to(values.reshape(-1).astype(np.float32), "bfloat16", values.shape).values().reshape(values.shape)
    if dtype_kind(dtype) in ("float", "complex", "int") or dtype == "bool":
        return values.astype(np.dtype("bool" if dtype == "bool" else dtype), copy=False)
    raise Unreplayable(f"tensor dtype {dtype!r} is not a MindSpore dtype")


def _array(value: Any) -> tuple[ArrayTensor, str]:
    """An output tensor or number as a NumPy ``ArrayTensor`` and the name of its dtype (``Float16``)."""
    if isinstance(value, ms.Tensor):
        name, shape = str(value.dtype), tuple(value.shape)
        if normalize_dtype(name) == "bfloat16":
            return round_to(value.astype(ms.float32).asnumpy().reshape(-1), "bfloat16", shape), name
        raw = value.asnumpy()
        return ArrayTensor(raw.reshape(-1), normalize_dtype(raw.dtype.name), shape), name
    arr = np.asarray(value)
    if arr.dtype.kind not in "biufc":
        raise TypeError(f"output of type {type(value).__name__}")
    return ArrayTensor(arr.reshape(-1), str(arr.dtype), tuple(arr.shape)), type(value).__name__


def _missing_kernel(e: BaseException) -> bool:
    return any(s in str(e) for s in _MISSING_KERNEL)


def _tensors(out: Any) -> list[ms.Tensor]:
    return [v for _, v in output_leaves(out) if isinstance(v, ms.Tensor)]


@dataclass
class _Run:
    """One side's forward output and, when it has differentiable inputs, the function of them it computed
    (``mindspore.vjp`` runs it again for the backward: PyNative keeps one gradient graph at a time)."""

    out: Any
    function: Optional[Callable]
    inputs: list[ms.Tensor]    # the inputs ``function`` differentiates
    leaves: list[int]          # their indices among the call's input tensors
    dtype: Optional[Any]       # None: tested (recorded dtypes); else the benchmark's floating dtype


class MindSporeBackend:
    """Replays recorded MindSpore (or mindtorch) calls; see the module docstring."""

    def __init__(self, device: str = "cpu", framework: str = MINDSPORE):
        self.device = device
        self.framework = framework
        self.owners = _OWNERS[framework]

    # ------------------------------------------------------------------ classification
    def _function(self, call: ApiCall) -> Callable:
        if call.prefix == "Primitive" and self.framework == MINDSPORE:
            return getattr(ops, call.api.rsplit(".", 1)[-1])()
        return getattr(self.owners[call.prefix][1], call.api)

    def unreplayable(self, call: ApiCall) -> Optional[str]:
        """The reason ``call`` cannot be replayed, or None."""
        shared = shared_reason(call, _RANDOM)
        if shared:
            return shared
        if call.api in _PARAMETER_WRITES:
            return "writes into a Parameter of the training run, which the dump does not hold"
        if call.prefix == "Jit":
            return "a mindspore.jit graph: a compiled function or cell, not one API"
        if call.prefix == "Primitive" and self.framework == MINDSPORE:
            return _primitive_reason(call.api)
        owner = self.owners.get(call.prefix)
        if owner is None:
            if self.framework == MINDTORCH:
                return (f"no MindSpore equivalent: '{call.prefix}' records are replayed only as Torch./Functional./"
                        "Tensor. through mindspore.mint")
            return f"custom API: '{call.prefix}' is not a MindSpore namespace the dump wraps"
        if getattr(owner[1], call.api, None) is None:
            if self.framework == MINDTORCH:
                return f"no MindSpore equivalent: {owner[0]} ({ms.__version__}) has no {call.api}"
            return f"custom API: this MindSpore ({ms.__version__}) has no {owner[0]}.{call.api}"
        return unknown_typed_reason(call, _KNOWN_TYPED)

    # ------------------------------------------------------------------ replay
    def replay(self, call: ApiCall, keep_data: bool) -> Replay:
        """Run ``call`` tested and as the CPU benchmark, forward and backward; see the module docstring."""
        fn = self._function(call)
        rng = call_rng(call.name)
        notes: list[str] = []
        host_args = [self._host(node, rng, notes) for node in call.args]
        host_kwargs = {k: self._host(v, rng, notes) for k, v in call.kwargs.items()}
        specs = call.input_tensors()
        in_place = is_in_place(call)
        args, tested, t_error = self._run_tested(fn, call, host_args, host_kwargs, specs, in_place)
        bench = self._run_bench(fn, call, args, host_kwargs, specs, in_place, tested, t_error, notes)
        if t_error is not None:
            if _missing_kernel(t_error):
                dtypes = sorted({s.framework_dtype for s in specs if s.is_float}) or ["these input"]
                raise Unreplayable(f"no {'/'.join(dtypes)} kernel on {self.device}: {failure_text(t_error)}")
            return Replay([], forward_failure=f"the tested call on {self.device} raised {failure_text(t_error)}",
                          notes=notes)
        assert tested is not None
        replay = Replay(forward_pairs(call, output_leaves(tested.out), output_leaves(bench.out), ms.Tensor,
                                      lambda name, t, b, _: _pair(name, t, b), notes), notes=notes)
        grads = self._backward(call, tested, bench, rng, replay)
        if keep_data:
            replay.save = _saver(call.name, host_args, host_kwargs, tested.out, bench.out, grads)
        return replay

    def _run_tested(self, fn: Callable, call: ApiCall, host_args: list, host_kwargs: dict, specs: list[TensorSpec],
                    in_place: bool) -> tuple[list, Optional[_Run], Optional[BaseException]]:
        """The tested forward: (the positional arguments used, its run, the exception it raised). For mindtorch
        records, another output shape than the recorded one means the MindSpore namesake differs."""
        result = run_tested(call, host_args, lambda args: self._run(fn, args, host_kwargs, specs, None, in_place),
                            lambda run: [tuple(t.shape) for t in _tensors(run.out)])
        got = [list(t.shape) for t in _tensors(result[1].out)] if result[1] is not None else None
        recorded = [list(s.shape) for s in call.output_tensors()]
        if self.framework == MINDTORCH and got is not None and got != recorded:
            owner = self.owners[call.prefix][0]
            raise Unreplayable(f"no MindSpore equivalent: {owner}.{call.api} returns shapes {got}, the recorded "
                               f"PyTorch-style call {recorded} (the two APIs differ)")
        return result

    def _run_bench(self, fn: Callable, call: ApiCall, args: list, kwargs: dict, specs: list[TensorSpec],
                   in_place: bool, tested: Optional[_Run], t_error: Optional[BaseException], notes: list[str]) -> _Run:
        """The CPU benchmark in float64; in float32 (noted) when float64 has no kernel and the tested outputs are
        float16/bfloat16. Raises ``Unreplayable`` when no benchmark runs."""
        try:
            return self._run(fn, args, kwargs, specs, ms.float64, in_place)
        except Exception as e:  # noqa: BLE001
            error = e
        low = tested is not None and any(normalize_dtype(str(t.dtype)) in LOW_PRECISION for t in _tensors(tested.out))
        if not low:
            if t_error is None and _missing_kernel(error):
                raise Unreplayable(f"no float64 CPU kernel for the benchmark ({failure_text(error)}); a float32 "
                                   "benchmark would compare the float32 kernel with itself") from None
            raise Unreplayable(benchmark_failed(error, t_error)) from None
        try:
            run = self._run(fn, args, kwargs, specs, ms.float32, in_place)
        except Exception as e:  # noqa: BLE001
            raise Unreplayable(f"{benchmark_failed(error, t_error)}; in float32: {failure_text(e)}") from None
        notes.append(f"benchmark in float32 on the CPU: float64 raised {failure_text(error)}")
        return run

    def _host(self, node: Any, rng: np.random.Generator, notes: list[str]) -> Any:
        """A record tree with tensors as ``_Host`` values (files or random values) and typed values resolved."""
        if isinstance(node, TensorSpec):
            return _Host(self._values(node, rng, notes), node.dtype, node.requires_grad)
        if isinstance(node, list):
            return [self._host(v, rng, notes) for v in node]
        if isinstance(node, dict):
            return {k: self._host(v, rng, notes) for k, v in node.items()}
        if isinstance(node, Typed) and node.type == "torch.Size":
            return tuple(node.value)
        return node

    def _values(self, spec: TensorSpec, rng: np.random.Generator, notes: list[str]) -> np.ndarray:
        if spec.dtype not in _MS_DTYPES:
            raise Unreplayable(f"tensor dtype {spec.framework_dtype!r} is not a MindSpore dtype")
        if spec.data_path:
            try:
                values = np.load(spec.data_path, allow_pickle=False)
            except (OSError, ValueError) as e:
                values, problem = None, f"cannot be read ({e})"
            else:
                stored = "float32" if spec.dtype == "bfloat16" else spec.dtype  # bfloat16 is saved as float32
                problem = "" if (values.dtype.name, values.shape) == (stored, spec.shape) else \
                    f"holds {values.dtype.name}{list(values.shape)}, not {spec.framework_dtype}{list(spec.shape)}"
            if not problem:
                return _host_values(values, spec.dtype)
            notes.append(f"{os.path.basename(spec.data_path)} {problem}: random values used")
        return _host_values(random_array(spec, rng), spec.dtype)

    def _run(self, fn: Callable, args: list, kwargs: dict, specs: list[TensorSpec], bench_dtype: Optional[Any],
             in_place: bool) -> _Run:
        """One side's forward, through ``mindspore.vjp`` when it has inputs to differentiate."""
        tensors: list[ms.Tensor] = []

        def convert(node: Any) -> Any:
            if isinstance(node, _Host):
                tensors.append(node.tensor(bench_dtype))
                return tensors[-1]
            if isinstance(node, (list, tuple)):
                return type(node)(convert(v) for v in node)
            if isinstance(node, dict):
                return {k: convert(v) for k, v in node.items()}
            if isinstance(node, Typed) and node.type == "mindspore.dtype":
                dtype = _MS_DTYPES.get(normalize_dtype(str(node.value)))
                if dtype is None:
                    raise Unreplayable(f"dtype argument {node.value!r} is not a MindSpore dtype")
                return bench_dtype if bench_dtype is not None and dtype_kind(normalize_dtype(str(node.value))) \
                    == "float" else dtype
            return node

        c_args, c_kwargs = [convert(v) for v in args], {k: convert(v) for k, v in kwargs.items()}
        leaves = [i for i, (s, t) in enumerate(zip(specs, tensors)) if s.requires_grad and _is_float(t)]
        try:
            out = fn(*c_args, **c_kwargs)
            for t in _tensors(out):
                t.asnumpy()  # a kernel's failure surfaces here, not at a later call (PyNative runs kernels asynchronously)
        except Exception:
            settle()  # nothing of this call's failure is left to surface at the next call
            raise
        if in_place or not leaves:
            return _Run(out, None, [], [], bench_dtype)

        def differentiable(*xs: ms.Tensor) -> Any:
            swap = dict(zip(leaves, xs))
            counter = iter(range(len(tensors)))

            def rebuild(node: Any) -> Any:
                if isinstance(node, ms.Tensor):
                    return swap.get(next(counter), node)
                if isinstance(node, (list, tuple)):
                    return type(node)(rebuild(v) for v in node)
                if isinstance(node, dict):
                    return {k: rebuild(v) for k, v in node.items()}
                return node

            return fn(*rebuild(c_args), **rebuild(c_kwargs))

        return _Run(out, differentiable, [tensors[i] for i in leaves], leaves, bench_dtype)

    def _backward(self, call: ApiCall, tested: _Run, bench: _Run, rng: np.random.Generator,
                  replay: Replay) -> Optional[dict]:
        """Input gradients on both sides (``replay.backward`` gets their pairs); what the backward was given and
        gave, or None without a backward."""
        if tested.function is None or bench.function is None:
            return None
        outs = _tensors(tested.out)
        b_outs = _tensors(bench.out)
        described = [(_is_float(t) and i < len(b_outs), normalize_dtype(str(t.dtype)), str(t.dtype),
                      tuple(t.shape)) for i, t in enumerate(outs)]
        chosen = dict(grad_output_specs(call, described, replay.notes))
        if not chosen:
            return None
        host = {i: _Host(self._values(spec, rng, replay.notes), spec.dtype, False) for i, spec in chosen.items()}
        grads = run_backwards(lambda: _vjp(tested, outs, host), lambda: _vjp(bench, b_outs, host), replay,
                              self.device)
        if grads is None:
            return None
        t_grads, b_grads = grads
        replay.backward = [_pair(f"{call.name}.backward.output.{i}", tg, bg)
                           for i, tg, bg in zip(tested.leaves, t_grads, b_grads)]
        return {"grad_outputs": [host[i].values for i in sorted(host)], "tested": list(t_grads),
                "bench": list(b_grads)}


def _primitive_reason(api: str) -> Optional[str]:
    """Why a ``Primitive.{attribute}.{Class}`` record cannot be replayed, or None for a class without attributes."""
    cls = getattr(ops, api.rsplit(".", 1)[-1], None)
    if not isinstance(cls, type):
        return f"custom API: mindspore.ops has no primitive {api.rsplit('.', 1)[-1]}"
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if params:
        names = ", ".join(p.name for p in params)
        return f"a primitive held by a cell: its attributes ({names}) are not recorded in the dump"
    return None


def _vjp(run: _Run, outs: list[ms.Tensor], host: dict[int, _Host]) -> tuple:
    """The input gradients of ``run`` for the output gradients ``host`` (zeros for the other outputs)."""
    grads = [host[i].tensor(run.dtype).astype(o.dtype) if i in host else mint.zeros_like(o) for i, o in enumerate(outs)]
    if isinstance(run.out, ms.Tensor):
        v: Any = grads[0]
    elif isinstance(run.out, (list, tuple)) and len(grads) == len(run.out):
        v = tuple(grads)
    else:
        raise TypeError("the output holds values other than tensors")
    assert run.function is not None
    _, vjp = ms.vjp(run.function, *run.inputs)
    result = vjp(v)
    return result if isinstance(result, tuple) else (result,)


def _host_array(value: Any) -> np.ndarray:
    if isinstance(value, _Host):
        return value.values
    if isinstance(value, np.ndarray):
        return value
    return value.astype(ms.float32).asnumpy() if normalize_dtype(str(value.dtype)) == "bfloat16" else value.asnumpy()


def _is_float(t: ms.Tensor) -> bool:
    return dtype_kind(normalize_dtype(str(t.dtype))) == "float"


def _pair(name: str, tested: Any, bench: Any) -> OutputPair:
    tested_arr, tested_dtype = _array(tested)
    bench_arr, bench_dtype = _array(bench)
    return OutputPair(name, tested_arr, bench_arr, tested_dtype, bench_dtype, tested_arr.dtype)


def _saver(name: str, args: list, kwargs: dict, t_out: Any, b_out: Any,
           grads: Optional[dict]) -> Callable[[Path, bool], None]:
    """Saves the call's input and output tensors as ``.npy`` (bfloat16 as float32, as the dump does):
    ``{name}.forward.input.{k}.npy``, ``{name}.forward.output.tested.{path}.npy``, ..."""
    def arrays(tree: Any) -> list[tuple[str, np.ndarray]]:
        return [(path, _host_array(v)) for path, v in output_leaves(tree) if isinstance(v, (_Host, ms.Tensor, np.ndarray))]

    def save(folder: Path, with_backward: bool) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        files = {"forward.input": [*args, *kwargs.values()], "forward.output.tested": t_out,
                 "forward.output.bench": b_out}
        if with_backward and grads is not None:
            files.update({"backward.input": grads["grad_outputs"], "backward.output.tested": grads["tested"],
                          "backward.output.bench": grads["bench"]})
        for suffix, tree in files.items():
            for path, values in arrays(tree):
                np.save(folder / safe_file_name(f"{name}.{suffix}.{path}", ".npy", name_max(folder)), values,
                        allow_pickle=False)

    return save

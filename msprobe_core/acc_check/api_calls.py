"""dump.json -> the API calls acc_check replays (framework-neutral).

A forward record (``Functional.linear.0.forward``) becomes an ``ApiCall`` holding its arguments as a tree
of ``TensorSpec`` (dtype, shape, Max/Min, requires_grad and, in tensor dumps, the tensor file), plain
Python values (int, float, bool, str, None, slice, Ellipsis, complex) and ``Typed`` values (framework
objects such as ``torch.dtype`` that only a replay backend can rebuild). The matching backward record
(``Functional.linear.0.backward``) supplies the gradients of the outputs (``grad_outputs``) and, where the dumper
marked no input ``requires_grad`` (MindSpore's functional autodiff under mindtorch tracks none), tells which
inputs got a gradient (``_mark_grad_inputs``). Module
records (L0), parameter gradients and ``save()`` records are not API calls and are counted, not listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

from msprobe_core.dumpdir.layout import check_finished
from msprobe_core.dumpdir.rank_dump import read_dump_json, tensor_dir
from msprobe_core.dumpdir.record_leaves import is_module, is_tensor_summary
from msprobe_core.errors import DumpInputError

LOW_PRECISION = ("float16", "bfloat16")
_MS_DTYPES = {"float": "float32", "half": "float16", "double": "float64", "bfloat": "bfloat16"}


def normalize_dtype(name: str) -> str:
    """``torch.bfloat16`` / ``BFloat16`` / ``mindspore.float32`` -> ``bfloat16`` / ``float32``."""
    short = str(name).rsplit(".", 1)[-1].lower()
    return _MS_DTYPES.get(short, short)


def dtype_kind(dtype: str) -> str:
    """``float``, ``complex``, ``int``, ``bool`` or ``other`` for a normalized dtype name."""
    if dtype == "bool":
        return "bool"
    if dtype.startswith(("float", "bfloat")):
        return "float"
    if dtype.startswith("complex"):
        return "complex"
    if dtype.startswith(("int", "uint")):
        return "int"
    return "other"


def precision_rank(dtype: str) -> int:
    """Lower is less precise: float16/bfloat16 0, float32 1, everything else 2."""
    if dtype in LOW_PRECISION:
        return 0
    return 1 if dtype == "float32" else 2


@dataclass(frozen=True)
class TensorSpec:
    """One recorded tensor; ``data_path`` is its tensor file when the dump holds one."""

    dtype: str
    framework_dtype: str
    shape: tuple[int, ...]
    max: Any = None
    min: Any = None
    requires_grad: bool = False
    data_path: Optional[str] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return dtype_kind(self.dtype) in ("float", "complex")


@dataclass(frozen=True)
class Typed:
    """A recorded value of a framework type (``{"type": "torch.dtype", "value": "torch.float32"}``);
    ``value`` is None when the dumper could not describe it."""

    type: str
    value: Any


Tree = Union[TensorSpec, Typed, list, dict, Any]


@dataclass
class ApiCall:
    """One recorded API call: ``name`` ``Functional.linear.0``, ``prefix`` ``Functional``, ``api`` ``linear``."""

    name: str
    prefix: str
    api: str
    args: list
    kwargs: dict
    outputs: list
    grad_outputs: Optional[list] = None  # the backward record's "input": one entry per output tensor
    problem: str = ""                    # why the record cannot be read (the call is listed, not replayed)

    def input_tensors(self) -> list[TensorSpec]:
        """The tensor arguments in the order the dumper numbers them (positional, then keyword)."""
        return tensors_in((self.args, self.kwargs))

    def output_tensors(self) -> list[TensorSpec]:
        return tensors_in(self.outputs)


def leaves_of(tree: Any, kind: type) -> list:
    """The leaves of type ``kind`` in a tree of lists, tuples and dicts, depth first, in order."""
    found: list = []

    def walk(node: Any) -> None:
        if isinstance(node, kind):
            found.append(node)
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for item in node.values():
                walk(item)

    walk(tree)
    return found


def tensors_in(tree: Any) -> list[TensorSpec]:
    """The ``TensorSpec`` leaves of a tree, depth first, in order."""
    return leaves_of(tree, TensorSpec)


@dataclass
class DumpFile:
    """A parsed dump.json: header fields and the API calls in recorded order."""

    path: Path
    task: str
    level: str
    framework: str
    calls: list[ApiCall]
    skipped_records: int = 0
    tensor_dir: Optional[Path] = None
    prefixes: set = field(default_factory=set)

    @property
    def has_tensor_data(self) -> bool:
        return any(s.data_path for c in self.calls for s in c.input_tensors())


_PLAIN = {"int": int, "float": float, "bool": bool, "str": str}


class _Parser:
    def __init__(self, tensor_dir: Optional[Path]):
        self.tensor_dir = tensor_dir
        self.files = set(p.name for p in tensor_dir.iterdir()) if tensor_dir and tensor_dir.is_dir() else set()

    def value(self, node: Any) -> Tree:
        if isinstance(node, list):
            return [self.value(v) for v in node]
        if not isinstance(node, dict):
            return node
        if is_tensor_summary(node):
            return self.tensor(node)
        if "type" in node and "value" in node and len(node) <= 3:
            return _typed(str(node["type"]), node["value"])
        return {str(k): self.value(v) for k, v in node.items()}

    def tensor(self, node: dict) -> TensorSpec:
        data_name = node.get("data_name")
        path = None
        if data_name and data_name in self.files:
            path = str(self.tensor_dir / data_name)  # type: ignore[operator]
        raw_dtype = str(node.get("dtype", ""))
        dtype = normalize_dtype(raw_dtype)
        shape = node.get("shape") or []
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise DumpInputError(f"a tensor's shape is {shape!r}; expected a list of ints >= 0")
        requires_grad = node.get("requires_grad")
        if requires_grad is None:  # dumps without the field: floating tensors may carry gradients
            requires_grad = dtype_kind(dtype) == "float"
        return TensorSpec(dtype, raw_dtype, tuple(shape), node.get("Max"), node.get("Min"), bool(requires_grad), path)


def _typed(kind: str, value: Any) -> Any:
    if kind in _PLAIN and value is not None:
        return _PLAIN[kind](value)
    if kind == "slice" and isinstance(value, list) and len(value) == 3:
        return slice(*value)
    if kind == "ellipsis":
        return Ellipsis
    if kind == "complex" and isinstance(value, list) and len(value) == 2:
        return complex(value[0], value[1])
    if kind == "NoneType":
        return None
    return Typed(kind, value)


def _split_name(name: str) -> Optional[tuple[str, str, str, str]]:
    """``Functional.linear.0.forward`` -> (prefix, api, count, direction); None for other names."""
    tokens = name.split(".")
    if len(tokens) < 4 or tokens[-1] not in ("forward", "backward") or not tokens[-2].isdigit():
        return None
    return tokens[0], ".".join(tokens[1:-2]), tokens[-2], tokens[-1]


def resolve_dump_json(path: Union[str, Path]) -> Path:
    """The dump.json named by -api_info (a file, or a rank folder holding dump.json)."""
    p = Path(path)
    if p.is_dir():
        check_finished(p)  # a crashed dump's folder gets the `recover` hint
        p = p / "dump.json"
    if not p.is_file():
        raise DumpInputError(f"-api_info {str(path)!r}: no such file; expected the dump.json of an L1 or mix dump")
    return p


def load_dump(path: Union[str, Path]) -> DumpFile:
    """Parse dump.json into ``ApiCall`` objects; ``DumpInputError`` naming the file when it is not a dump."""
    json_path = resolve_dump_json(path)
    raw = read_dump_json(json_path)
    tensors = tensor_dir(json_path.parent, raw.get("dump_data_dir"))
    parser = _Parser(tensors)
    data: dict = raw["data"]
    calls: list[ApiCall] = []
    skipped = 0
    prefixes = set()
    for name, record in data.items():
        parts = _split_name(name)
        if parts is None or is_module(name) or not isinstance(record, dict):
            skipped += 1
            continue
        prefix, api, count, direction = parts
        if direction != "forward":
            if f"{prefix}.{api}.{count}.forward" not in data:
                skipped += 1  # a backward record whose forward was not dumped
            continue
        prefixes.add(prefix)
        call_name = f"{prefix}.{api}.{count}"
        backward = data.get(f"{call_name}.backward")
        try:
            grad_outputs = parser.value(backward.get("input", [])) if isinstance(backward, dict) else None
            calls.append(ApiCall(call_name, prefix, api, list(parser.value(record.get("input_args") or [])),
                                 dict(parser.value(record.get("input_kwargs") or {})),
                                 list(parser.value(record.get("output") or [])), grad_outputs))
            if isinstance(backward, dict):
                _mark_grad_inputs(calls[-1], list(parser.value(backward.get("output") or [])))
        except (DumpInputError, TypeError, ValueError) as e:
            calls.append(ApiCall(call_name, prefix, api, [], {}, [], problem=f"unreadable record: {e}"))
    framework = str(raw.get("framework") or _guess_framework(prefixes))
    return DumpFile(json_path, str(raw.get("task") or "statistics"), str(raw.get("level") or ""), framework,
                    calls, skipped, tensors if tensors.is_dir() else None, prefixes)


def _mark_grad_inputs(call: ApiCall, input_grads: list) -> None:
    """A call with a backward record whose forward record marks no input ``requires_grad`` (the dumper could not
    tell): the floating inputs whose gradient the backward record lists get it, every floating input when its
    entries do not line up with the input tensors."""
    specs = call.input_tensors()
    if not specs or any(s.requires_grad for s in specs):
        return
    got = iter([isinstance(g, TensorSpec) for g in input_grads] if len(input_grads) == len(specs) else
               [True] * len(specs))

    def mark(node: Any) -> Any:
        if isinstance(node, TensorSpec):
            return replace(node, requires_grad=True) if next(got) and dtype_kind(node.dtype) == "float" else node
        if isinstance(node, (list, tuple)):
            return type(node)(mark(v) for v in node)
        if isinstance(node, dict):
            return {k: mark(v) for k, v in node.items()}
        return node

    call.args, call.kwargs = mark(call.args), mark(call.kwargs)


def _guess_framework(prefixes: set) -> str:
    """Old dumps without a "framework" field: MindSpore's Mint records name it, anything else is PyTorch."""
    return "mindspore" if prefixes & {"Mint", "MintFunctional", "Primitive", "Jit"} else "pytorch"

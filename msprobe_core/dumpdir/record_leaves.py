"""Record names and the leaves (tensors and plain values) a dump.json record holds.

A record is one entry of dump.json's ``data``: an API call (``Functional.relu.0.forward``), a module
call (``Module.conv2.Conv2d.forward.0``) or a module's parameter gradients
(``Module.conv2.Conv2d.parameters_grad.0``). ``flatten_record`` turns it into ``Leaf`` objects whose
``path`` is the part msprobe appends to the record name in tensor file names (``input.0``,
``output.0.1``, ``input.alpha``, ``parameters.weight``, ``weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

DIRECTIONS = frozenset({"forward", "backward", "parameters_grad"})
MODULE_PREFIXES = frozenset({"Module", "Cell"})
TENSOR_TYPES = frozenset({"torch.Tensor", "torch.nn.parameter.Parameter", "mindspore.Tensor",
                          "numpy.ndarray", "torch.return_types"})


@dataclass(frozen=True)
class Leaf:
    """One tensor or plain value of a record.

    ``path`` is relative to the record (``input.0``); ``summary`` is the JSON dict from dump.json
    (a tensor summary, or ``{"type": "int", "value": 3}``).
    """

    path: str
    summary: dict

    @property
    def is_tensor(self) -> bool:
        """True for tensor summaries (they carry dtype/shape), False for plain values."""
        return is_tensor_summary(self.summary)

    @property
    def role(self) -> str:
        """``input``, ``output``, ``parameters`` or, for parameter gradients, ``parameters_grad``."""
        head = self.path.split(".", 1)[0]
        return head if head in ("input", "output", "parameters") else "parameters_grad"


def is_tensor_summary(summary: dict) -> bool:
    """True for a tensor's summary (a tensor type, or a dtype and a shape), False for a plain value's."""
    return summary.get("type") in TENSOR_TYPES or ("dtype" in summary and "shape" in summary)


def _count_index(tokens: list[str]) -> Optional[int]:
    """Index of the call-count token in a split record name, or None when there is none."""
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] not in DIRECTIONS:
            continue
        after = i + 1 < len(tokens) and tokens[i + 1].isdigit()
        before = i > 0 and tokens[i - 1].isdigit()
        if tokens[0] in MODULE_PREFIXES:
            return i + 1 if after else (i - 1 if before else None)
        return i - 1 if before else (i + 1 if after else None)
    return None


def normalize_name(name: str) -> str:
    """The record name with its call count replaced by ``*`` (``Functional.relu.*.forward``).

    Two runs that differ by one extra call shift every later count of that API; normalized names stay
    equal, which is what sequence alignment matches on.
    """
    tokens = name.split(".")
    idx = _count_index(tokens)
    if idx is None:
        return name
    tokens[idx] = "*"
    return ".".join(tokens)


def direction(name: str) -> str:
    """``forward``, ``backward``, ``parameters_grad`` or ``""`` when the name carries none."""
    for token in reversed(name.split(".")):
        if token in DIRECTIONS:
            return token
    return ""


def is_module(name: str) -> bool:
    """True for module (``Module.``/``Cell.``) records."""
    return name.split(".", 1)[0] in MODULE_PREFIXES


def _join(path: str, part: Any) -> str:
    return f"{path}.{part}" if path else str(part)


def _walk(path: str, arg: Any) -> Iterator[Leaf]:
    if arg is None:
        return
    if isinstance(arg, (list, tuple)):
        for i, item in enumerate(arg):
            yield from _walk(_join(path, i), item)
    elif isinstance(arg, dict):
        if "type" in arg or is_tensor_summary(arg):
            yield Leaf(path, arg)
        else:
            for key, item in arg.items():
                yield from _walk(_join(path, key), item)


def _section(prefix: str, value: Any) -> Iterator[Leaf]:
    if isinstance(value, dict) and ("type" in value or is_tensor_summary(value)):
        yield from _walk(f"{prefix}.0", value)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(f"{prefix}.{key}", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(f"{prefix}.{i}", item)


SECTIONS = ("input_args", "input_kwargs", "output", "input", "parameters")


def record_problem(record: Any) -> Optional[str]:
    """Why a dump.json record cannot be compared, or None when it can. A record is an object holding its
    sections (``input_args``/``input_kwargs``/``output``; ``input``/``output`` for backward records;
    parameter names for parameter gradients) or, for ``save()``'s records, a value summary (or a list of
    them); each tensor summary holds its ``dtype`` and ``shape``."""
    if isinstance(record, list):
        return next(filter(None, (record_problem(v) for v in record if v is not None)), None)
    if not isinstance(record, dict):
        return f"{_json_type(record)} where a record object is expected"
    if not record:
        return "an empty object: none of its fields (input_args, input_kwargs, output, input, parameters)"
    if not ("type" in record or is_tensor_summary(record)):
        present = [k for k in SECTIONS if k in record] or list(record)
        bad = [k for k in present if record[k] is not None and not isinstance(record[k], (list, dict))]
        if bad:
            return f"field '{bad[0]}' is {_json_type(record[bad[0]])}, not a list or object"
    for leaf in flatten_record(record):
        missing = [k for k in ("dtype", "shape") if k not in leaf.summary]
        if leaf.is_tensor and missing:
            return f"tensor {leaf.path or 'value'} lacks {' and '.join(missing)}"
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "a number", float: "a number"}.get(type(value), f"a {type(value).__name__}")


def flatten_record(record: Any) -> list[Leaf]:
    """The leaves of one dump.json record, in msprobe's order (inputs, kwargs, outputs, parameters).

    A record that is itself a value (``save()``'s ``{name}.{n}.debug`` records) is one leaf with path ''.
    """
    if isinstance(record, (list, tuple)) or (isinstance(record, dict)
                                             and ("type" in record or is_tensor_summary(record))):
        return list(_walk("", record))
    if not isinstance(record, dict):
        return []
    leaves: list[Leaf] = []
    if "input_args" in record or "input_kwargs" in record:
        leaves.extend(_section("input", record.get("input_args")))
        leaves.extend(_section("input", record.get("input_kwargs")))
        leaves.extend(_section("output", record.get("output")))
        leaves.extend(_section("parameters", record.get("parameters")))
    elif "input" in record or "output" in record:
        leaves.extend(_section("input", record.get("input")))
        leaves.extend(_section("output", record.get("output")))
    else:  # parameters_grad: {pname: [SUMMARY]} (one gradient per parameter in practice)
        for key, value in record.items():
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            leaves.extend(_walk(key, value))
    return leaves

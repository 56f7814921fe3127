"""Comparing dumps of two frameworks: a MindSpore (or MSAdapter) run against a PyTorch run of the same network.

Records are aligned on names both runs share once translated (``FrameworkViews``):

- a Cell is its PyTorch Module: ``Cell.block.fc1.Linear.forward.0`` aligns with
  ``Module.block.fc1.Linear.forward.0`` (path and class; classes that differ by name, ``Dense`` and
  ``Linear``, through the ``cell`` table), and its parameters by their PyTorch names (``gamma`` is
  ``weight`` in a ``LayerNorm``: the ``parameter`` table);
- an API is known by the PyTorch API it stands for, whichever way either run called it
  (``torch.matmul``, ``Tensor.matmul`` and MindSpore's ``ops.matmul`` or ``mint.matmul`` are one
  ``matmul``): names map through the ``api`` table (``mindspore.ops.dense`` is
  ``torch.nn.functional.linear``; a primitive by its class, ``Primitive.Dense``) or stay as they are;
- dtypes compare by meaning (``Float32`` is ``torch.float32``: ``same_dtype``).

The table ships as ``ms_to_pt_mapping.yaml`` beside this module; ``compare --api-mapping FILE`` adds a
user's entries (same layout) on top of it. Reports keep each run's own record names; a leaf within a
record is named as PyTorch names it (``parameters.weight`` for a LayerNorm's ``gamma``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

from msprobe_core.common.yaml_file import read_yaml_mapping
from msprobe_core.dumpdir.rank_dump import RankDump
from msprobe_core.dumpdir.record_leaves import DIRECTIONS, flatten_record
from msprobe_core.errors import ConfigError

DEFAULT_MAPPING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ms_to_pt_mapping.yaml")
PYTORCH = "pytorch"
MINDSPORE_FRAMEWORKS = frozenset({"mindspore", "mindtorch"})
API_KEY_PREFIX = "Api"  # records of either run keyed by the PyTorch API they stand for

# Where MindSpore's and PyTorch's APIs live, as written in the table, and the record prefixes they dump as.
_MS_MODULES = (("mindspore.mint.nn.functional.", "MintFunctional"), ("mint.nn.functional.", "MintFunctional"),
               ("mindspore.mint.", "Mint"), ("mint.", "Mint"), ("mindspore.ops.", "Functional"),
               ("ops.", "Functional"), ("mindspore.Tensor.", "Tensor"), ("Tensor.", "Tensor"),
               ("Primitive.", "Primitive"))
_PT_MODULES = ("torch.nn.functional.", "torch.Tensor.", "torch.", "Tensor.", "Functional.", "Torch.")
_MODULE_PREFIXES = ("Cell", "Module")


@dataclass
class FrameworkMapping:
    """MindSpore -> PyTorch names: ``api`` (``"{record prefix}.{name}"`` -> PyTorch API name), ``cell``
    (class -> class) and ``parameter`` (class or ``"*"`` -> {MindSpore parameter: PyTorch parameter})."""

    api: dict[str, str] = field(default_factory=dict)
    cell: dict[str, str] = field(default_factory=dict)
    parameter: dict[str, dict[str, str]] = field(default_factory=dict)

    def api_name(self, prefix: str, name: str) -> str:
        """The PyTorch API name of a MindSpore record's API (its own name when the table has none)."""
        return self.api.get(f"{prefix}.{name}", name)

    def parameters(self, cls: str) -> dict[str, str]:
        """Parameter renames of a cell class (its own entries over the ``"*"`` ones)."""
        return {**self.parameter.get("*", {}), **self.parameter.get(cls, {})}


def load_mapping(extra: Optional[str | os.PathLike] = None) -> FrameworkMapping:
    """The shipped table, with the entries of the YAML file ``extra`` (same layout) on top."""
    mapping = FrameworkMapping()
    for path in (DEFAULT_MAPPING, *([os.fspath(extra)] if extra else [])):
        _merge(mapping, _read(path), path)
    return mapping


def _read(path: str) -> Mapping[str, Any]:
    doc = read_yaml_mapping(path, "api_mapping", "a YAML mapping with the sections api, cell and parameter")
    if set(doc) - {"api", "cell", "parameter"}:
        raise ConfigError("api_mapping", path, "a YAML mapping with the sections api, cell and parameter")
    return doc


def _merge(mapping: FrameworkMapping, doc: Mapping[str, Any], path: str) -> None:
    for section in ("api", "cell"):
        entries = doc.get(section) or {}
        if not isinstance(entries, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in entries.items()):
            raise ConfigError(f"api_mapping.{section}", entries, "a mapping of MindSpore name -> PyTorch name", path)
        for key, value in entries.items():
            if section == "api":
                mapping.api[ms_api_key(key, path)] = pt_api_name(value)
            else:
                mapping.cell[key] = value
    params = doc.get("parameter") or {}
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise ConfigError("api_mapping.parameter", params, "a mapping of cell class (or '*') -> "
                          "{MindSpore parameter: PyTorch parameter}", path)
    for cls, renames in params.items():
        mapping.parameter.setdefault(str(cls), {}).update({str(k): str(v) for k, v in renames.items()})


def ms_api_key(api: str, source: Optional[str] = None) -> str:
    """``mindspore.mint.nn.functional.relu`` / ``mint.nn.functional.relu`` / ``MintFunctional.relu`` ->
    ``MintFunctional.relu`` (a dump record's prefix and name)."""
    for module, prefix in _MS_MODULES:
        if api.startswith(module):
            return f"{prefix}.{api[len(module):]}"
    if api.split(".", 1)[0] in ("Mint", "MintFunctional", "Functional", "Tensor", "Primitive") and "." in api:
        return api
    raise ConfigError("api_mapping.api", api, "a MindSpore API such as mindspore.ops.matmul, mint.nn.functional.relu, "
                      "Tensor.add or Primitive.Dense (a primitive by its class)", source)


def pt_api_name(api: str) -> str:
    """``torch.nn.functional.linear`` / ``torch.matmul`` / ``Tensor.add`` -> the API's name."""
    for module in _PT_MODULES:
        if api.startswith(module):
            return api[len(module):]
    return api


def cross_framework(a: str, b: str) -> bool:
    """Can dumps of frameworks ``a`` and ``b`` be compared through the mapping (MindSpore or MSAdapter
    against PyTorch or each other)?"""
    return a != b and {a, b} <= MINDSPORE_FRAMEWORKS | {PYTORCH}


_DTYPE_ALIASES = {"bool_": "bool", "half": "float16", "float": "float32", "double": "float64"}


def dtype_meaning(dtype: Any) -> Any:
    """``torch.float32``, ``Float32`` and ``float32`` -> ``float32``; anything else unchanged."""
    if not isinstance(dtype, str):
        return dtype
    name = dtype.rsplit(".", 1)[-1].lower()
    return _DTYPE_ALIASES.get(name, name)


def same_dtype(a: Any, b: Any) -> bool:
    """Do two dump.json dtypes mean the same type, whichever framework wrote them?"""
    return a == b or dtype_meaning(a) == dtype_meaning(b)


# ------------------------------------------------------------------------------------------ the views
@dataclass
class FrameworkViews:
    """Both dumps under aligned names (``target``, ``golden``), and the way back to each run's own names."""

    target: RankDump
    golden: RankDump
    target_names: dict[str, str]  # aligned name -> the target run's own name
    golden_names: dict[str, str]
    note: str

    def restore(self, pair: Any, target: RankDump, golden: RankDump) -> None:
        """Give a compared ``PairResult`` back its runs' own record names and dumps."""
        t_back, g_back = self.target_names, self.golden_names
        pair.merged = [(t_back.get(t, t) if t else t, g_back.get(g, g) if g else g) for t, g in pair.merged]
        for row in pair.rows:
            row.target_record = t_back.get(row.target_record, row.target_record) if row.target_record else None
            row.golden_record = g_back.get(row.golden_record, row.golden_record) if row.golden_record else None
        for div in (pair.divergence, pair.first_warning):
            if div is not None:
                div.target_record = t_back.get(div.target_record, div.target_record)
                div.golden_record = g_back.get(div.golden_record, div.golden_record) if div.golden_record else None
                div.parent = t_back.get(div.parent, div.parent) if div.parent else None
        if getattr(pair, "unreadable", None):
            pair.unreadable = [t_back.get(n, g_back.get(n, n)) for n in pair.unreadable]
        pair.target, pair.golden = target, golden
        pair.notes.append(self.note)


def framework_views(target: RankDump, golden: RankDump, mapping: Optional[FrameworkMapping] = None
                    ) -> Optional[FrameworkViews]:
    """Aligned views of two dumps of different frameworks; None when both are of one framework."""
    if target.framework == golden.framework:
        return None
    mapping = mapping or load_mapping()
    t_view, t_names = _view(target, mapping)
    g_view, g_names = _view(golden, mapping)
    note = (f"{target.framework} dump compared with a {golden.framework} dump: records aligned on PyTorch names "
            "(cells as modules, APIs through the MindSpore-to-PyTorch mapping), dtypes by meaning")
    return FrameworkViews(t_view, g_view, t_names, g_names, note)


def _view(dump: RankDump, mapping: FrameworkMapping) -> tuple[RankDump, dict[str, str]]:
    from_ms = dump.framework == "mindspore"
    counts: dict[str, int] = {}
    forward_of: dict[str, str] = {}  # own name of a forward call -> its aligned name (backward follows it)
    aligned: dict[str, str] = {}
    data: dict[str, Any] = {}
    for name, record in dump.data.items():
        new, record = _translate(name, record, from_ms, mapping, counts, forward_of)
        aligned[name] = new
        data[new] = record
    construct = {aligned.get(k, k): (aligned.get(v, v) if v else v) for k, v in dump.construct.items()}
    view = replace(dump, data=data, construct=construct)
    view.__dict__["stack"] = {aligned.get(k, k): v for k, v in dump.stack.items()}
    return view, {new: old for old, new in aligned.items()}


def _translate(name: str, record: Any, from_ms: bool, mapping: FrameworkMapping, counts: dict[str, int],
               forward_of: dict[str, str]) -> tuple[str, Any]:
    """A record's aligned name (its call count renumbered in execution order among records of the same
    aligned name) and the record with PyTorch parameter names."""
    tokens = name.split(".")
    where = next((i for i in range(len(tokens) - 1, 0, -1) if tokens[i] in DIRECTIONS), None)
    if where is None:
        return name, record
    if tokens[0] in _MODULE_PREFIXES:  # {Cell|Module}.{path}.{Class}.{direction}.{n}
        cls = tokens[where - 1]
        if from_ms:
            cls = mapping.cell.get(cls, cls)
            record = _rename_parameters(record, tokens[where], mapping.parameters(tokens[where - 1]))
        base = ".".join(["Module", *tokens[1:where - 1], cls])
        return f"{base}.{tokens[where]}.{tokens[where + 1] if where + 1 < len(tokens) else '0'}", record
    # {Prefix}.{api...}.{n}.{direction}; a primitive is Primitive.{attribute}.{Class}.{n}.{direction}
    prefix, api = tokens[0], tokens[1:where - 1]
    if prefix == "Primitive" and api:
        api = [api[-1]]
    api_name = mapping.api_name(prefix, ".".join(api)) if from_ms else ".".join(api)
    key = f"{API_KEY_PREFIX}.{api_name}"
    if tokens[where] == "forward" and isinstance(record, dict) and "input_args" in record:
        record = {**record, "input_args": _tensors(record.get("input_args")) + _tensors(record.get("input_kwargs")),
                  "input_kwargs": {}}
    own_call = ".".join(tokens[:where])
    if tokens[where] == "forward" or own_call not in forward_of:
        n = counts.get(key, 0)
        counts[key] = n + 1
        forward_of[own_call] = f"{key}.{n}"
    return f"{forward_of[own_call]}.{tokens[where]}", record


def _tensors(args: Any) -> list:
    """The tensor summaries among an API's arguments, in order: frameworks order and name an API's other
    arguments differently (``F.layer_norm(x, shape, w, b, eps)`` is MindSpore's ``LayerNorm(eps)(x, gamma,
    beta)``), so a cross-framework comparison pairs inputs by their tensors only."""
    return [leaf.summary for leaf in flatten_record(args if isinstance(args, list) else [args]) if leaf.is_tensor] \
        if args else []


def _rename_parameters(record: Any, direction: str, renames: dict[str, str]) -> Any:
    if not renames or not isinstance(record, dict):
        return record
    if direction == "forward" and isinstance(record.get("parameters"), dict):
        return {**record, "parameters": {renames.get(k, k): v for k, v in record["parameters"].items()}}
    if direction == "parameters_grad":
        return {renames.get(k, k): v for k, v in record.items()}
    return record

"""Call arguments as dump.json structures, for any framework: the walk over nested arguments, non-tensor
values, the statistics fields and the deferred host copy.

A framework's summarizer (``msprobe_core.pytorch.summarize``, ``msprobe_core.mindspore.summarize``)
subclasses ``SummarizerBase`` with what touches its tensors: which objects are tensors (``tensor_types``),
a tensor's summary (``tensor``), the host copy of deferred device statistics (``_rows_to_host``) and
checksums (``_checksums``). Tensor files go through the core's writer (``msprobe_core.dump.tensor_files``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

from msprobe_core.files import json_text
from msprobe_core.files.safe_names import NAME_MAX, name_max, safe_file_name

NO_STATS = {"Max": None, "Min": None, "Mean": None, "Norm": None}


class SummarizerBase:
    """Summaries of one process's records (``reset()`` at step end drops what a subclass caches per step).

    ``_pending`` holds ``(summary, device statistics, kind, numel)`` until ``resolve()`` copies them to the
    host at once; ``_pending_crc`` holds what ``_checksums`` needs to fill a deferred ``md5``."""

    tensor_types: tuple = ()
    """The framework's tensor classes (``isinstance`` test of ``summarize``)."""
    device_norm_squared = True
    """Is the 4th deferred statistic the sum of squares (else the norm itself)?"""
    record_text: Any = None
    """A compiled maker of forward records' JSON text (``text(obj)``, ``inputs(args, kwargs)``,
    ``record(head, outputs)``: the same text as ``text``, or None where ``text`` gives None), or None."""

    def __init__(self, statistics: bool, md5: bool, files: Any = None):
        self.statistics = statistics
        self.md5 = md5
        self.files = files
        self.tensor_dir: Optional[Path] = None
        self._pending: list[tuple[dict, Any, str, int]] = []
        self._pending_crc: list[tuple[dict, Any]] = []
        self._made_dir: Optional[Path] = None
        self._dir_prefix = ""
        self._name_limit = NAME_MAX

    def reset(self) -> None:
        """The step ended: drop what is cached per tensor."""

    # ------------------------------------------------------------------ structures
    def summarize(self, obj: Any, file_base: Optional[str], save: bool) -> Any:
        """The dump.json structure of ``obj``; ``file_base`` names saved tensors when ``save``."""
        if isinstance(obj, self.tensor_types):
            return self.tensor(obj, file_base, save)
        if obj is None:
            return None
        if isinstance(obj, (list, tuple)):
            if type(obj).__name__ == "Size":  # torch.Size (and mindtorch's)
                return {"type": "torch.Size", "value": [int(v) for v in obj]}
            if not (save and file_base):  # file names only matter for saved tensors: none built per element
                return [self.summarize(v, None, save) for v in obj]
            return [self.summarize(v, f"{file_base}.{i}", save) for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if not (save and file_base):
                return {str(k): self.summarize(v, None, save) for k, v in obj.items()}
            return {str(k): self.summarize(v, f"{file_base}.{k}", save) for k, v in obj.items()}
        return self.describe(obj)

    def text(self, obj: Any) -> Optional[str]:
        """The JSON text of ``summarize(obj, None, False)``, built from each tensor's cached summary text
        (``tensor_text``), or None when a tensor in ``obj`` has none (the caller takes ``summarize``)."""
        if isinstance(obj, self.tensor_types):
            return self.tensor_text(obj)
        if obj is None:
            return "null"
        kind = type(obj)
        if kind is float or kind is int or kind is bool:  # ``describe``'s {"type": ..., "value": ...}, written at once
            return f'{{"type": "{kind.__name__}", "value": {json_text.number(obj) if kind is float else repr(obj).lower() if kind is bool else obj}}}'
        if isinstance(obj, (list, tuple)):
            if type(obj).__name__ == "Size":
                return json_text.encode(self.summarize(obj, None, False))
            items = []
            for v in obj:
                item = self.tensor_text(v) if isinstance(v, self.tensor_types) else self.text(v)
                if item is None:
                    return None
                items.append(item)
            return json_text.array(items)
        if isinstance(obj, dict):
            pairs = []
            for k, v in obj.items():
                item = self.text(v)
                if item is None:
                    return None
                pairs.append((str(k), item))
            return json_text.obj(pairs)
        return json_text.encode(self.describe(obj))

    def tensor_text(self, t: Any) -> Optional[str]:
        """The JSON text of ``tensor(t, None, False)`` where it is known at once (host statistics); None
        where only ``tensor`` applies. The base class has none."""
        return None

    def tensor(self, t: Any, file_base: Optional[str], save: bool) -> dict:
        """One tensor's summary (and its file when ``save``)."""
        raise NotImplementedError

    def describe(self, obj: Any) -> dict:
        """A non-tensor, non-container argument (``describe_value``)."""
        return describe_value(obj)

    def file_path(self, file_base: str, suffix: str) -> tuple[str, str]:
        """(file name, path) of a tensor file in the current tensor folder (made on first use): the name is
        ``file_base + suffix`` made safe (``safe_names``: it never leaves the folder)."""
        assert self.tensor_dir is not None
        if self._made_dir != self.tensor_dir:
            self.tensor_dir.mkdir(parents=True, exist_ok=True)
            self._made_dir = self.tensor_dir
            self._dir_prefix = f"{self.tensor_dir}{os.sep}"
            self._name_limit = name_max(self.tensor_dir)
        name = safe_file_name(file_base, suffix, self._name_limit)
        return name, self._dir_prefix + name  # a plain string: a Path per file costs more than the rest of the job

    # ------------------------------------------------------------------ host copy
    @property
    def has_pending(self) -> bool:
        """Are some summaries still waiting for their device statistics or checksums?"""
        return bool(self._pending or self._pending_crc)

    def resolve(self) -> None:
        """Copy every pending device statistic to the host at once and fill the summaries; then the
        deferred checksums."""
        pending, self._pending = self._pending, []
        if pending:
            rows = self._rows_to_host(pending)
            for (summary, _, kind, numel), row in zip(pending, rows):
                if row is not None:
                    fill(summary, row, kind, numel, self.device_norm_squared)
        crcs, self._pending_crc = self._pending_crc, []
        if crcs:
            self._checksums(crcs)

    def _rows_to_host(self, pending: list[tuple[dict, Any, str, int]]) -> list[Optional[tuple]]:
        """Host values of the pending device statistics (None, with the reason in the summary, where they
        cannot be read)."""
        raise NotImplementedError

    def _checksums(self, pending: list[tuple[dict, Any]]) -> None:
        """Fill the deferred ``md5`` fields."""
        raise NotImplementedError


def stats_text(row: Any, kind: str, numel: int) -> str:
    """``"Max": ..., "Min": ..., "Mean": ..., "Norm": ...`` as JSON text, the values ``fill`` gives from host
    statistics (max, min, sum, sum of squares, ...)."""
    if kind == "bool":
        return f'"Max": {"true" if row[0] else "false"}, "Min": {"true" if row[1] else "false"}, "Mean": null, "Norm": null'
    mx, mn, mean, norm = row[0], row[1], row[2] / numel, math.sqrt(row[3])
    if (mx + mn + mean + norm) * 0.0 == 0.0:  # all finite: each one's repr is its JSON text
        return f'"Max": {mx!r}, "Min": {mn!r}, "Mean": {mean!r}, "Norm": {norm!r}'
    number = json_text.number
    return f'"Max": {number(mx)}, "Min": {number(mn)}, "Mean": {number(mean)}, "Norm": {number(norm)}'


NO_STATS_TEXT = '"Max": null, "Min": null, "Mean": null, "Norm": null'


def fill(summary: dict, row: Any, kind: str, numel: int, norm_is_squared: bool = True) -> None:
    """Max/Min/Mean/Norm from (max, min, sum, sum of squares or norm, ...) of ``numel`` elements; bools get
    Max=any, Min=all."""
    if kind == "bool":
        summary["Max"], summary["Min"] = bool(row[0]), bool(row[1])
        summary["Mean"] = summary["Norm"] = None
    else:
        summary["Max"], summary["Min"] = row[0], row[1]
        summary["Mean"] = row[2] / numel
        summary["Norm"] = math.sqrt(row[3]) if norm_is_squared else row[3]


def describe_value(obj: Any, framework: Optional[Callable[[Any], Optional[dict]]] = None,
                   plain: Optional[Callable[[Any], Any]] = None) -> dict:
    """A non-tensor argument as msprobe writes it: ``{"type": ..., "value": ...}``. ``framework`` describes
    the framework's own values (dtypes, devices; None for anything else); ``plain`` gives a slice bound's
    JSON value (default: numbers and strings as they are, anything else as its text)."""
    if isinstance(obj, bool):
        return {"type": "bool", "value": obj}
    if isinstance(obj, int):
        return {"type": "int", "value": obj}
    if isinstance(obj, float):
        return {"type": "float", "value": obj}
    if isinstance(obj, str):
        return {"type": "str", "value": obj}
    if isinstance(obj, slice):
        bound = plain or plain_value
        return {"type": "slice", "value": [bound(obj.start), bound(obj.stop), bound(obj.step)]}
    if obj is Ellipsis:
        return {"type": "ellipsis", "value": "..."}
    if isinstance(obj, complex):
        return {"type": "complex", "value": [obj.real, obj.imag]}
    if framework is not None:
        described = framework(obj)
        if described is not None:
            return described
    return {"type": type(obj).__qualname__, "value": None}


def plain_value(v: Any) -> Any:
    """A JSON value for ``v``: None, numbers and strings as they are, anything else as its text."""
    return v if v is None or isinstance(v, (int, float, str, bool)) else str(v)


def tensors_in(obj: Any, tensor_types: Any) -> list:
    """Tensors (instances of ``tensor_types``) inside a nested structure (lists, tuples, dicts), in the
    order the structure lists them."""
    if isinstance(obj, tensor_types):
        return [obj]
    found: list = []
    _collect(obj, found, tensor_types)
    return found


def _collect(obj: Any, found: list, tensor_types: Any) -> None:
    if isinstance(obj, (list, tuple)):
        for v in obj:
            if isinstance(v, tensor_types):
                found.append(v)
            elif isinstance(v, (list, tuple, dict)):
                _collect(v, found, tensor_types)
    elif isinstance(obj, dict):
        _collect(list(obj.values()), found, tensor_types)
    elif isinstance(obj, tensor_types):
        found.append(obj)

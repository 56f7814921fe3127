"""Statistics of many tensors at once on their device (``StatsEngine``).

Every number goes through ``msprobe_core.pytorch.tensor_stats.batched_stats``. ``StatsEngine.compute``
skips the NaN count where it is provably zero: a tensor whose min, max, norm or mean is finite holds no
NaN (each of them propagates NaN), so on the CPU, where reading a few numbers back costs nothing, the NaN
count is only computed for rows where one of those is not finite. The result is exact. On accelerators
the count is computed with the rest (no host sync). Statistics of sharded tensors: ``shard_stats``.

``StatsEngine.append_row`` (one tensor) and ``StatsEngine.append_rows`` (a batch, one kernel call) are the
monitor's path for CPU tensors the one-pass kernel reads: the kernel's host floats appended to the step's
``bytearray`` by the kernel itself, no tensor and no Python float made (the monitor calls them thousands of
times a step); ``StatsEngine.host_values`` turns a step's worth of them into the ``ops`` at once (the kernel's
``raw_ops``).
"""

from __future__ import annotations

from struct import Struct
from typing import Sequence

import numpy as np
import torch

from msprobe_core.pytorch.tensor_stats import HOST_CODES, batched_stats, fast_cpu_stats, host_stats
from msprobe_core.stats.kernel import KERNEL

_NAN_PROXIES = ("min", "max", "norm", "mean")
RAW_WIDTH = 7
"""Host floats per tensor row: the kernel's max, min, sum, sum of squares, zeros and NaNs, then the element
count."""
_ROW = Struct(f"{RAW_WIDTH}d")
_raw_ops = getattr(KERNEL, "raw_ops", None)
_TensorRows = getattr(KERNEL, "TensorRows", None)
_OP_CODES = {"min": 0, "max": 1, "norm": 2, "mean": 3, "zeros": 4, "nans": 5}
"""``raw_ops``' code of each op."""
_get_num_threads = torch.get_num_threads
# the float types the kernel reads without a conversion (TensorRows), with their dtype codes
_KERNEL_FLOATS = {dtype: HOST_CODES[dtype] for dtype in (torch.float32, torch.float64, torch.bfloat16)}


class StatsEngine:
    """Computes the configured ``ops`` for a list of same-device tensors: a float32 [n, len(ops)] tensor."""

    def __init__(self, ops: Sequence[str], eps: float):
        self.ops = tuple(ops)
        self.eps = float(eps)
        self._lazy_nans = "nans" in self.ops and any(op in self.ops for op in _NAN_PROXIES)
        self._other_ops = tuple(op for op in self.ops if op != "nans")
        self._nans_at = self.ops.index("nans") if "nans" in self.ops else -1
        self._proxy_cols = [self._other_ops.index(op) for op in _NAN_PROXIES if op in self._other_ops]
        self.count_eps = self.eps if "zeros" in self.ops else -1.0
        """The kernel's eps: the zero count's, or -1 (no zero count) without ``zeros`` in ``ops``."""
        self._op_codes = [_OP_CODES[op] for op in self.ops]
        self.host_rows = fast_cpu_stats() and None not in (_raw_ops, _TensorRows)
        """CPU tensors are summarised on the host by the one-pass kernel (``append_row``, ``append_rows``)."""
        self.tensor_rows = _TensorRows(_KERNEL_FLOATS, torch.Tensor, torch.nn.Parameter, torch._C.TensorBase,
                                        torch.strided) if self.host_rows else None
        """The kernel's ``TensorRows`` (None without host rows): plain dense float CPU tensors' rows, torch asked
        in C."""

    def append_row(self, raw: bytearray, t: torch.Tensor) -> int | None:
        """Append the host row (``RAW_WIDTH`` doubles: max, min, sum, sum of squares, zeros, NaNs, element
        count; ``host_values`` makes the ``ops`` of them) of one non-empty CPU tensor to ``raw``; returns its
        index, or None, with nothing appended, where the kernel does not apply (no kernel, another device,
        a subclass, ...). A dense float CPU tensor goes straight to the kernel, anything else through
        ``host_stats``."""
        row = self.tensor_rows.row(raw, t, self.count_eps, _get_num_threads())  # the usual tensor, asked in C
        if row is not None:
            return row
        values = host_stats(t, self.count_eps)
        if values is None:
            return None
        raw += _ROW.pack(*values, t.numel())
        return len(raw) // _ROW.size - 1

    def append_rows(self, raw: bytearray, tensors: Sequence[torch.Tensor]) -> list[int]:
        """``append_row`` of each of non-empty ``tensors`` the kernel reads, in order; returns the positions of
        the others (for the device path). Dense float tensors all: one kernel call for the lot."""
        if self.tensor_rows.rows(raw, tensors, self.count_eps, _get_num_threads()) is not None:
            return []
        return [i for i, t in enumerate(tensors) if self.append_row(raw, t) is None]

    def host_values(self, raw: bytearray) -> np.ndarray:
        """The ``ops`` of the rows ``append_row``/``append_rows`` made, ``[rows, ops]`` float64 holding float32
        values (the numbers ``compute`` gives), in one kernel call."""
        out = np.frombuffer(_raw_ops(raw, self._op_codes), dtype=np.float64)
        return out.reshape(-1, len(self.ops))

    @torch.no_grad()
    def compute(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Statistics of ``tensors`` (all on one device, none empty), in ``ops`` order, on that device."""
        if not tensors:
            return torch.empty((0, len(self.ops)), dtype=torch.float32)
        if not (self._lazy_nans and tensors[0].device.type == "cpu") or fast_cpu_stats():
            # the one-pass CPU kernel counts NaNs for free
            return batched_stats(tensors, self.ops, self.eps)
        rest = batched_stats(tensors, self._other_ops, self.eps)
        nans = torch.zeros((len(tensors), 1), dtype=rest.dtype)
        proxies = rest[:, self._proxy_cols]
        if not bool(torch.isfinite(proxies).all()):  # CPU: reading the flag back costs no device sync
            bad = (~torch.isfinite(proxies).all(dim=1)).nonzero().flatten().tolist()
            nans[bad, 0] = batched_stats([tensors[i] for i in bad], ("nans",), self.eps)[:, 0]
        j = self._nans_at
        return torch.cat([rest[:, :j], nans, rest[:, j:]], dim=1)

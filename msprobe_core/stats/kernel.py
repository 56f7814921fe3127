"""The optional one-pass statistics kernel behind a small interface, with its kill switch.

``KERNEL`` is the compiled ``_fast_stats`` module, or None when it was not built (no C compiler at
install) or ``MSPROBE_FAST_STATS=0`` turned it off; callers then use their framework's own reductions.
Its functions (see ``_fast_stats.c``):

- ``stats(address, numel, code, eps, threads)`` -> (max, min, sum, sum of squares, zeros, NaNs);
- ``copy_stats(dst, src, numel, code, eps, threads)`` -> the same, while copying the buffer to ``dst``;
- ``stats_many(addresses, numels, codes, eps, threads, out)`` -> the same for many buffers, into ``out``;
- ``append_row(raw, address, numel, code, eps, threads)`` / ``append_rows(raw, addresses, numels, codes, eps,
  threads)`` -> one or many tensors' statistics and element counts appended to the ``bytearray`` ``raw`` (the
  monitor's rows of a step, as doubles); the index of the first row appended;
- ``csv_rows(heads, middle, tails, values, width, ndigits)`` -> a kind's CSV lines, each float written as
  Python's ``"%.{ndigits}g"`` writes it, ``values`` a sequence of floats or a buffer of doubles
  (``monitor/writers/csv_writer.py``);
- ``raw_ops(raw, ops)`` -> the ops of ``append_row``'s rows, as doubles of float32 values (``monitor/stats.py``);
- ``TensorRows``: ``append_row``/``append_rows`` of plain dense float tensors, torch asked in C (``monitor/stats.py``;
  through the optional C++ extension ``_torch_facts`` where it was built for the running torch, ``_fast_facts.c``);
- ``frame_key(depth)`` -> the bytes naming the calling stack (code objects and offsets; ``files/call_stack.py``);
- ``buffer(address, nbytes)`` -> a read-only memoryview of the bytes;
- ``Entry`` and ``RecordText``: the dump's per-version tensor entries and its forward records' JSON text in C
  (``pytorch/summarize.py``); ``GradText``: a gradient's text; ``walk``: a call's autograd nodes
  (``pytorch/backward_capture.py``); ``repr_check``: the floats' shortest text (``_fast_repr.c``) against
  Python's ``repr``;
- ``TextJournal``: ``StepRecorder.put_text``/``put_text_field`` stored and journaled in one call
  (``_fast_journal.c``, ``files/step_recorder.py``);
- ``ApiCall`` and ``ModePass``: an L1 API call recorded in one call, and the operator mode's pass-through
  (``_fast_api.c``, ``pytorch/api_fast.py``, ``pytorch/api_patch.py``); ``ApiGrad``, ``NodeEdges``: the gradient
  records of a call made with autograd on (``_fast_gradapi.c``);
- ``ModuleHooks``, ``CallGrads``, ``ParamGrad``, ``SingleEdge``, ``OwnGrads``: the L0 dump's module and
  gradient hooks of a usual call (``_fast_l0.c``, ``dump/call_records.py``, ``pytorch/dump_service.py``);
- ``ActivationCore``, ``ForwardSite``, ``Activation``: the monitor's activation hooks of a usual call
  (``_fast_monitor.c``, ``monitor/module_hooks.py``); ``state_rows``: a batch of weights, gradients or optimizer
  moments recorded (rows and entries) in one call (``monitor/collector.py``);
- ``write_lines``: a step's dump.json, stack.json or construct.json written from its dict in one call
  (``_fast_files.c``, ``files/step_recorder.py``).

Dtype codes: float32 0, float64 1, bfloat16 2, int64 3, int32 4, int16 5, int8 6, uint8 7, bool 8.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

KILL_SWITCH_ENV = "MSPROBE_FAST_STATS"
"""``MSPROBE_FAST_STATS=0`` turns the kernel off (statistics then come from the framework's reductions)."""

try:
    from msprobe_core.stats import _fast_stats as _compiled
except ImportError:  # pragma: no cover - built without a C compiler
    _compiled = None

KERNEL: Optional[ModuleType] = None if os.environ.get(KILL_SWITCH_ENV, "1") == "0" else _compiled

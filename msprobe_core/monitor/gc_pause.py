"""``gc_paused()``: Python's cyclic garbage collector held off while the monitor turns a step into rows,
writes and judges them.

A monitored step makes one ``MetricRow`` per tensor (thousands on a large model), used for a few
milliseconds and then dropped. Left to itself the collector would run young collections in the middle of
that work, promote the rows to older generations, and so bring on full collections of the training's
whole heap: tens of milliseconds each, the largest share of the monitor's cost on a model of many small
modules. Held off for that stretch, the rows are freed by reference counting before any collection sees
them; the collector resumes right after (collections are delayed, none is lost).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (restored as it was, also on error)."""
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

"""What the dump service knows about the open step only: made new when a step ends, so a new step never
inherits a stale counter, call or open module of the previous one."""

from __future__ import annotations

from typing import Any


class StepState:
    """The open step's record bookkeeping (``CallRecords.step_state``; ``CallRecords`` and ``UserApi`` read
    and write it; ``CallRecords.new_step`` replaces it when the service ends the step)."""

    __slots__ = ("counters", "module_stack", "module_calls", "bwd_sizes", "recorded_modules")

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        """Calls so far per API, module, parameter or ``save`` name: the numbers in the record names."""
        self.module_stack: list[str] = []
        """The forward records of the modules running now, innermost last (construct.json's parents)."""
        self.module_calls: dict[int, list[Any]] = {}
        """id(module) -> its open calls (a ``Call``, None when not recorded, or ``SKIPPED``), innermost last."""
        self.bwd_sizes: dict[str, tuple[int, int]] = {}
        """A backward record's (input, output) gradients expected: its forward's output and input tensors."""
        self.recorded_modules: set[str] = set()
        """Modules with a forward record this step: their parameters' gradients are recorded."""

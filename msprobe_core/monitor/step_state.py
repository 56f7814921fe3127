"""``StepState``: what the monitor knows about the optimizer step in progress, and nothing that outlives it.

``TrainerMon`` makes a new one at each step boundary (and when a skipped update starts the step over), so a
step never inherits a flag of the one before: what is not set for this step has its default here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class StepState:
    """One optimizer step of the monitor, from its begin to its end (or its start over)."""

    token: int
    """Counts the steps begun (starting over included). Activation hooks tell a stale gradient by the
    state object itself (each step has its own)."""
    collecting: bool
    """This step is monitored (its statistics are recorded)."""
    contributing: bool = False
    """Not collecting, but another rank of the shard group is: its shards go into their all-reduces
    (``shard_agreement``)."""
    agreed: bool = False
    """The ranks agreed on ``contributing`` (once per step, before its first sharded all-reduce)."""
    pre_done: bool = False
    """``pre_optimizer_step`` ran: weights and gradients are read."""
    grads_done: bool = False
    """The weight gradients are recorded (``collect_grads``)."""
    forwards: int = 0
    """Training forwards of the first chunk in this step (more than ``grad_acc_steps``: an update was
    skipped without ``optimizer.step()``)."""
    skip_checked: bool = False
    """This step's gradients were checked for a skipped update and found finite."""
    lrs: list[float] = field(default_factory=list)
    """The optimizer's learning rates, read before the update."""

    @property
    def reading(self) -> bool:
        """Whether this step's states are read: to record them, or only to contribute shards."""
        return self.collecting or self.contributing

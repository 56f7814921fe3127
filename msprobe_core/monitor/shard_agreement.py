"""Every rank of a sharded group in the same collectives, whichever ranks collect a step.

With a sharded state reader (DeepSpeed ZeRO, Megatron's distributed optimizer, any reader with
``sharded = True``) the statistics of a weight, gradient or moment are all-reduced over the reader's group
(``shard_stats``): every rank of the group must make the same all-reduces in the same order. When the
monitor may collect a step on some ranks and not on others (``module_ranks`` naming only part of the
group, or ``dynamic_on`` switched by a config file that each rank reads at its own moment), the ranks
first agree with one 1-element all-reduce per step (``needs_agreement``), and a rank that does not
collect while another does *contributes* its shards: it reads them and takes part in the same
all-reduces, and writes nothing. Without agreement a rank left out would skip the all-reduces and the
others would wait for it forever.
"""

from __future__ import annotations

from typing import Any

from msprobe_core.monitor.config import MonitorConfig
from msprobe_core.pytorch.ranks import any_rank, group_ranks, group_size


def needs_agreement(config: MonitorConfig, dynamic: bool, group: Any) -> bool:
    """Whether the ranks of ``group`` may disagree about collecting a step (see the module docstring)."""
    if group_size(group) <= 1:
        return False
    return dynamic or not all(config.selects_rank(r) for r in group_ranks(group))


def contributes(collecting: bool, config: MonitorConfig, dynamic: bool, group: Any) -> bool:
    """Whether this rank, not collecting the step itself, must contribute its shards because another rank
    of ``group`` collects it. Called once per step by every rank of the group, at the same point."""
    if not needs_agreement(config, dynamic, group):
        return False
    others = any_rank(collecting, group)
    return others and not collecting

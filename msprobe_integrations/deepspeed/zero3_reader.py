"""ZeRO-3 gradient shards (and fp32 master and optimizer-state partitions): ``Stage3Reader``.

At stage 3 every parameter is partitioned into ``p.ds_tensor`` (``p.numel() == 0`` outside gather windows).
The reader reads this rank's fp32 master partition, gradient partition and state partitions through
DeepSpeed's local (non-collective) accessors, with the padding of the last partition cut off; the monitor
combines the partitions' statistics over the data-parallel group.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional

import torch

from msprobe_core.session import STATE_KINDS, StateReader, rank_in
from msprobe_integrations.deepspeed.engine import dp_group, empty_shard, loss_scale, state_keys, unscale

logger = logging.getLogger("msprobe_core.deepspeed")


class Stage3Reader(StateReader):
    """ZeRO stage 3: parameters are partitioned into ``p.ds_tensor`` (``p.numel() == 0`` outside gather
    windows). Reads this rank's fp32 master partition, gradient partition and state partitions through
    DeepSpeed's local (non-collective) accessors, with the padding of the last partition cut off."""

    sharded = True

    def __init__(self, engine: Any):
        self.engine = engine
        self.group = dp_group(engine)
        self._warned: set[str] = set()

    @staticmethod
    def _partition(p: torch.nn.Parameter) -> tuple[int, int]:
        """(where this rank's partition starts among ``p``'s elements, its size with padding)."""
        size = int(p.ds_tensor.ds_numel if hasattr(p.ds_tensor, "ds_numel") else p.ds_tensor.numel())
        return rank_in(getattr(p, "ds_process_group", None)) * size, size

    def _valid(self, p: torch.nn.Parameter, shard: Optional[torch.Tensor]) -> torch.Tensor:
        """The part of this rank's partition that holds elements of ``p`` (no padding)."""
        if shard is None:
            return empty_shard(p.ds_tensor.device)
        shard = shard.reshape(-1)
        start, size = self._partition(p)
        valid = max(0, min(size, int(p.ds_numel) - start))
        return shard.narrow(0, 0, min(valid, shard.numel()))

    def shard_start(self, name: str, param: Any) -> Optional[int]:
        return self._partition(param)[0] if hasattr(param, "ds_tensor") else None

    def _read(self, what: str, name: str, p: torch.nn.Parameter, fn: Callable[[], Any]) -> torch.Tensor:
        try:
            return self._valid(p, fn())
        except Exception as exc:
            if what not in self._warned:
                self._warned.add(what)
                logger.warning("msprobe: could not read the %s of %s from ZeRO-3 (%s); reported as empty", what, name, exc)
            return empty_shard(p.ds_tensor.device)

    def weights(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_local_fp32_param
        return {n: self._read("weight", n, p, lambda p=p: safe_get_local_fp32_param(p))
                for n, p in params.items() if hasattr(p, "ds_id")}

    def grads(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_local_grad
        scale = loss_scale(self.engine)
        return {n: unscale(self._read("gradient", n, p, lambda p=p: safe_get_local_grad(p)), scale)
                for n, p in params.items() if hasattr(p, "ds_id")}

    def optimizer_states(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
        from deepspeed.utils import safe_get_local_optimizer_state
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key in state_keys(self.engine.optimizer):  # empty before the first optimizer step
            out[STATE_KINDS[key]] = {n: self._read(key, n, p, lambda p=p, k=key: safe_get_local_optimizer_state(p, k))
                                     for n, p in params.items() if hasattr(p, "ds_id")}
        return out

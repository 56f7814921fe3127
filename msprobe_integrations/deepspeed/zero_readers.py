"""Where ZeRO stages 0, 1 and 2 keep gradients, fp32 master weights and optimizer states (``StateReader``s),
and ``make_state_reader``, which picks the reader for an engine (stage 3: ``zero3_reader``).

Stage 0 (plain data parallel): ``param.grad`` and ``optimizer.state[param]``, already all-reduced, or the
fp32 masters of DeepSpeed's fp16/bf16 optimizers. Stages 1-2 (and the bf16 optimizer): this rank's
fragments of the fp32 master weights, the reduced gradient partitions and the partitioned Adam states,
linked through ``param._hp_mapping``; the monitor combines the fragments' statistics over the
data-parallel group.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional

import torch

from msprobe_core.session import STATE_KINDS, StateReader, TorchStateReader
from msprobe_integrations.deepspeed.engine import (dp_group, empty_shard, loss_scale, state_keys, torch_optimizer,
                                                   unscale)
from msprobe_integrations.deepspeed.zero3_reader import Stage3Reader

logger = logging.getLogger("msprobe_core.deepspeed")


class Stage0Reader(TorchStateReader):
    """ZeRO stage 0 (plain data parallel): every rank holds whole ``param.grad`` and optimizer states,
    already all-reduced at the boundary, so statistics are local (``sharded = False``). With DeepSpeed's
    fp16/bf16 optimizers the weights are the fp32 master copies and the states those of the masters."""

    sharded = False

    def __init__(self, engine: Any):
        super().__init__(params_have_main_grad=False)
        self.engine = engine
        self.group = dp_group(engine)

    def _masters(self) -> dict[int, tuple[torch.Tensor, Callable[[str], Optional[torch.Tensor]]]]:
        """``id(model param) -> (fp32 master, state getter)`` for DeepSpeed's fp16 optimizers (empty otherwise)."""
        opt = self.engine.optimizer
        state = getattr(torch_optimizer(opt), "state", None) or {}
        lp_groups = getattr(opt, "fp16_groups", None) or []
        out: dict[int, tuple[torch.Tensor, Callable[[str], Optional[torch.Tensor]]]] = {}
        unfused = getattr(opt, "fp32_groups", None)
        flats = getattr(opt, "fp32_groups_flat", None)
        for i, lps in enumerate(lp_groups):
            if unfused is not None and i < len(unfused):  # FP16_UnfusedOptimizer: one master per parameter
                for lp, hp in zip(lps, unfused[i]):
                    out[id(lp)] = (hp, lambda key, hp=hp: (state.get(hp) or {}).get(key))
            elif flats is not None and i < len(flats):  # FP16_Optimizer: one flat master per group
                offset = 0
                for lp in lps:
                    n = lp.numel()

                    def get(key: str, flat=flats[i], offset=offset, n=n, lp=lp) -> Optional[torch.Tensor]:
                        t = (state.get(flat) or {}).get(key)
                        return t.narrow(0, offset, n).view_as(lp) if isinstance(t, torch.Tensor) else None

                    out[id(lp)] = (flats[i].narrow(0, offset, n).view_as(lp), get)
                    offset += n
        return out

    def weights(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        masters = self._masters()
        return {n: masters[id(p)][0] if id(p) in masters else p for n, p in params.items()}

    def grads(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        scale = loss_scale(self.engine)
        return {n: unscale(g, scale) for n, g in super().grads(params).items()}

    def optimizer_states(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
        masters = self._masters()
        if not masters:
            return super().optimizer_states(torch_optimizer(self.engine.optimizer), params)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in params.items():
            if id(p) not in masters:
                continue
            for key, kind in STATE_KINDS.items():
                t = masters[id(p)][1](key)
                if isinstance(t, torch.Tensor):
                    out.setdefault(kind, {})[name] = t
        return out


class FragmentReader(StateReader):
    """ZeRO stage 1-2 (and DeepSpeed's bf16 optimizer): each parameter ``p`` linked to the fp32 master
    partition of this rank through ``p._hp_mapping`` (None where this rank holds no piece of ``p``).

    Weights: the fp32 master fragment. Gradients: the reduced gradient of the fragment (``averaged_gradients``,
    present between the boundary backward and the optimizer step). States: the optimizer-state fragments,
    linked after the first optimizer step. A rank without a piece of a parameter returns an empty tensor,
    so every rank returns the same names (the monitor's combine all-reduces rows in sorted-name order).
    """

    sharded = True

    def __init__(self, engine: Any):
        self.engine = engine
        self.group = dp_group(engine)
        self._warned: set[str] = set()

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("msprobe: could not read %s from the ZeRO optimizer (%s); reported as empty", what, exc)

    def weights(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            if not hasattr(p, "_hp_mapping"):
                continue
            hm = p._hp_mapping
            out[name] = hm.get_hp_fragment() if hm is not None else empty_shard(p.device)
        return out

    def grads(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        scale = loss_scale(self.engine)
        out: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            if not hasattr(p, "_hp_mapping"):
                continue
            hm = p._hp_mapping
            if hm is None:
                out[name] = empty_shard(p.device)
                continue
            try:
                frag = hm.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
            except Exception as exc:  # no gradients at this moment (outside the boundary)
                self._warn_once(f"the gradient of {name}", exc)
                out[name] = empty_shard(p.device)
                continue
            address = hm.lp_fragment_address
            if frag.numel() == p.numel() and frag.numel() != address.numel:
                # a full-size accumulation buffer (bf16 optimizer, one rank): keep this rank's fragment only
                frag = frag.narrow(0, address.start, address.numel)
            out[name] = unscale(frag, scale)
        return out

    def shard_start(self, name: str, param: Any) -> Optional[int]:
        hm = getattr(param, "_hp_mapping", None)
        return int(hm.lp_fragment_address.start) if hm is not None else 0  # no piece here: an empty shard

    def optimizer_states(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
        zero = self.engine.optimizer
        keys = state_keys(zero)
        if not keys:
            return {}  # the optimizer has not stepped yet (the same on every rank)
        inner_state = getattr(torch_optimizer(zero), "state", None) or {}
        flats = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_groups_flat_partition", None) or []
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in params.items():
            if not hasattr(p, "_hp_mapping"):
                continue
            hm = p._hp_mapping
            state = None
            if hm is not None and hm.param_group_index < len(flats):
                state = inner_state.get(flats[hm.param_group_index])
            for key in keys:
                frag = None
                if hm is not None:
                    # the torch optimizer's state of this rank's flat fp32 partition, cut to p's fragment. (DeepSpeed's
                    # own hp_mapping.optim_fragment is linked once, after the first group stepped, so it stays
                    # empty for later param groups.)
                    flat_state = state.get(key) if state else None
                    if isinstance(flat_state, torch.Tensor) and flat_state.dim() == 1:
                        address = hm.hp_fragment_address
                        frag = flat_state.narrow(0, address.start, address.numel)
                    elif hm.optim_fragment:
                        frag = hm.optim_fragment.get(key)
                out.setdefault(STATE_KINDS[key], {})[name] = frag if frag is not None else empty_shard(p.device)
        return out


def make_state_reader(engine: Any) -> StateReader:
    """The reader for where this engine keeps gradients and optimizer states (see the module docstring)."""
    params = list(engine.module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        return Stage3Reader(engine)
    if any(hasattr(p, "_hp_mapping") for p in params):
        return FragmentReader(engine)
    return Stage0Reader(engine)

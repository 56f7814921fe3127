"""Where a Megatron optimizer keeps gradients, fp32 main parameters and Adam moments: a ``StateReader``.

Megatron's optimizers never expose these through ``param.grad`` / ``optimizer.state[param]`` of the model's
parameters, so the monitor reads them through this reader (``msprobe_core.monitor.state_readers``):

* ``FP32Optimizer``: the model parameters are the main parameters; gradients are ``param.main_grad`` in
  the DDP grad buffer (after the data-parallel reduction, before clipping); moments are the inner torch
  optimizer's ``state[param]``.
* ``Float16OptimizerWithFloat16Params`` (bf16/fp16): each 16-bit model parameter has an fp32 main copy
  (``fp32_from_float16_groups``, paired with ``float16_groups``); weights and Adam moments are read
  from the main copy, gradients from the model parameter's ``main_grad``.
* ``DistributedOptimizer``: each data-parallel rank owns a contiguous range of the grad buffer. Only that
  range of ``main_grad`` holds the reduced gradient, and the optimizer holds fp32 main parameters and
  moments for that range only. The reader returns this rank's *shards* (an empty tensor for a parameter
  this rank owns no piece of) and is ``sharded``: the monitor combines per-shard partial statistics over
  the optimizer's data-parallel group into statistics of the full tensors, with no gather.
* ``ChainedOptimizer``: its ``chained_optimizers`` are read one by one (any of the above).

Anything else (a plain torch optimizer, an unknown wrapper) is read like ``TorchStateReader`` does.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch

from msprobe_core.session import EXP_AVG, EXP_AVG_SQ, STATE_KINDS, StateReader, TorchStateReader, rank_in

logger = logging.getLogger("msprobe_core.megatron")

_EMPTY = torch.empty(0)


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers under ``ChainedOptimizer`` (recursively); the optimizer itself otherwise."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer] if optimizer is not None else []
    out: list[Any] = []
    for inner in chained:
        out.extend(leaf_optimizers(inner))
    return out


def is_distributed(optimizer: Any) -> bool:
    return hasattr(optimizer, "model_param_gbuf_map") and hasattr(optimizer, "shard_fp32_groups")


class _Entry:
    """How to read one model parameter: its main (fp32) parameter, the slice of ``main_grad`` that the
    main parameter stands for, and the torch optimizer that holds its state."""

    __slots__ = ("main", "start", "end", "inner", "owned")

    def __init__(self, main: Optional[torch.Tensor], inner: Any, start: Optional[int] = None,
                 end: Optional[int] = None, owned: bool = True):
        self.main, self.inner, self.start, self.end, self.owned = main, inner, start, end, owned


class MegatronStateReader(StateReader):
    """Reads a Megatron optimizer (see the module docstring). ``sharded`` is set when any optimizer in the
    chain is a ``DistributedOptimizer``; ``group`` is then its data-parallel group."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer
        self._fallback = TorchStateReader(params_have_main_grad=True)
        self._entries: dict[int, _Entry] = {}
        leaves = leaf_optimizers(optimizer)
        distributed = [o for o in leaves if is_distributed(o) and not getattr(o, "is_stub_optimizer", False)]
        self.sharded = bool(distributed)
        # the dense parameters' data-parallel group (the widest: an expert optimizer's is a part of it)
        self.group = max((getattr(o, "data_parallel_group", None) for o in distributed), key=_group_size,
                         default=None)
        self._replica = rank_in(self.group) if self.sharded else 0
        for leaf in leaves:
            if getattr(leaf, "is_stub_optimizer", False) or getattr(leaf, "optimizer", None) is None:
                continue
            if is_distributed(leaf):
                group = getattr(leaf, "data_parallel_group", None)
                if group is not self.group and not _expert_shards_cover(group, self.group):
                    logger.warning("monitor: a DistributedOptimizer in the chain reduces over another "
                                   "data-parallel group (expert parallelism); its parameters are not monitored")
                    self._mark_unowned(leaf)
                    continue
                self._add_distributed(leaf)
            elif hasattr(leaf, "float16_groups"):
                self._add_float16(leaf)
            else:
                self._add_plain(leaf)

    # ------------------------------------------------------------------------------ the mapping
    def _add_plain(self, leaf: Any) -> None:
        inner = leaf.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                self._entries[id(p)] = _Entry(p, inner)

    def _add_float16(self, leaf: Any) -> None:
        inner = leaf.optimizer
        for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                self._entries[id(model_param)] = _Entry(main_param, inner)
        for group in leaf.fp32_from_fp32_groups:
            for p in group:
                self._entries[id(p)] = _Entry(p, inner)

    def _add_distributed(self, leaf: Any) -> None:
        inner = leaf.optimizer
        pairs = list(zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups)) + \
            list(zip(leaf.model_fp32_groups, leaf.shard_fp32_groups))
        for model_group, shard_group in pairs:
            for model_param, shard in zip(model_group, shard_group):
                rng = leaf._get_model_param_range_map(model_param)["param"]
                self._entries[id(model_param)] = _Entry(shard, inner, rng.start, rng.end)
        # parameters of this optimizer's grad buffers that this rank owns no piece of
        for model_param in _buffer_params(leaf):
            self._entries.setdefault(id(model_param), _Entry(None, inner, owned=False))

    def _mark_unowned(self, leaf: Any) -> None:
        for model_param in _buffer_params(leaf):
            self._entries[id(model_param)] = _Entry(None, None, owned=False)

    def _present(self, entry: _Entry) -> bool:
        """Whether this rank contributes the tensor (sharded mode: a replicated tensor counts on one rank)."""
        if not entry.owned or entry.main is None:
            return False
        return entry.start is not None or not self.sharded or self._replica == 0

    # ------------------------------------------------------------------------------ StateReader
    def shard_start(self, name: str, param: Any) -> Optional[int]:
        """This rank's range of the parameter under the distributed optimizer starts at its ``param`` range;
        anything else is the whole tensor or nothing."""
        entry = self._entries.get(id(param))
        return entry.start if entry is not None and entry.start is not None else 0

    def grads(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            entry = self._entries.get(id(p))
            if entry is None:
                g = self._fallback.grads({name: p}).get(name)
                if g is not None:
                    out[name] = g if self._present(_Entry(p, None)) else _EMPTY
                continue
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is None:
                if self.sharded:
                    out[name] = _EMPTY
                continue
            if not self._present(entry):
                out[name] = _EMPTY
            elif entry.start is not None:
                out[name] = grad.view(-1)[entry.start:entry.end]
            else:
                out[name] = grad
        return out

    def weights(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        """The fp32 main parameters (shards under the distributed optimizer), before the update."""
        out: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            entry = self._entries.get(id(p))
            if entry is None:
                out[name] = p if self._present(_Entry(p, None)) else _EMPTY
            else:
                out[name] = entry.main if self._present(entry) else _EMPTY
        return out

    def optimizer_states(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in params.items():
            entry = self._entries.get(id(p))
            if entry is None:
                entry = _Entry(p, getattr(optimizer, "optimizer", optimizer))
            inner = entry.inner
            state = inner.state.get(entry.main) if self._present(entry) and inner is not None else None
            found: dict[str, torch.Tensor] = {}
            for key, kind in STATE_KINDS.items():
                t = state.get(key) if state else None
                if isinstance(t, torch.Tensor) and kind not in found:
                    found[kind] = t
            if self.sharded:
                # every rank of the group reports the same names: an empty shard where it holds none
                for kind in expected_kinds(inner):
                    out.setdefault(kind, {})[name] = found.get(kind, _EMPTY)
            else:
                for kind, t in found.items():
                    out.setdefault(kind, {})[name] = t
        return out


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _expert_shards_cover(expert_dp: Any, dense_dp: Any) -> bool:
    """Whether an expert optimizer's shards (over the expert data-parallel group ``expert_dp``, each
    expert-parallel rank its own experts) hold every element of the experts once over ``dense_dp``: the
    expert-parallel group times the expert data-parallel group is the dense data-parallel group (megatron-core
    carves expert parallelism out of data parallelism). Then the expert parameters' shards are combined over
    ``dense_dp`` like any other's, into the statistics of all experts (every expert's rows on every rank)."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        ep = parallel_state.get_expert_model_parallel_group()
    except Exception:  # no expert parallelism set up
        return False
    ranks = set(dist.get_process_group_ranks(dense_dp))
    experts, shards = set(dist.get_process_group_ranks(ep)), set(dist.get_process_group_ranks(expert_dp))
    return experts <= ranks and shards <= ranks and len(experts) * len(shards) == len(ranks)


def expected_kinds(inner: Any) -> tuple[str, ...]:
    """The moment kinds a torch optimizer keeps, from its defaults (the same on every rank)."""
    defaults = getattr(inner, "defaults", None) or {}
    if "betas" in defaults:
        return (EXP_AVG, EXP_AVG_SQ)
    if defaults.get("momentum"):
        return (EXP_AVG,)
    return ()


def _buffer_params(leaf: Any) -> list:
    """Every parameter in a distributed optimizer's grad buffers (all ranks' ranges, not only this one's)."""
    params: list = []
    for buffer in getattr(leaf, "buffers", None) or []:
        params.extend(getattr(buffer, "params", None) or getattr(buffer, "param_index_map", {}))
    seen = {id(p) for p in params}
    params.extend(p for p in getattr(leaf, "model_param_gbuf_map", {}) if id(p) not in seen)
    return params

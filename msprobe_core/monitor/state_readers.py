"""Where gradients, weights and optimizer states live: the pluggable ``StateReader``.

The monitor asks its reader for three mappings ``{parameter name: tensor}`` at each monitored step:
weights (before the update), gradients (before the update, or earlier when an integration calls
``TrainerMon.collect_grads()`` before clipping) and optimizer states (after the update), the latter
as ``{kind: {name: tensor}}`` with kinds ``exp_avg`` and ``exp_avg_sq``.

``TorchStateReader`` (the default) reads ``param.main_grad`` when present and ``params_have_main_grad``
(Megatron), else ``param.grad``; and ``optimizer.state[param]``: Adam/AdamW ``exp_avg``/``exp_avg_sq``,
SGD's ``momentum_buffer`` (reported as ``exp_avg``, the first moment).

A sharded reader (DeepSpeed ZeRO, a distributed optimizer) sets ``sharded = True`` and returns this
rank's *shards*. The monitor then computes per-shard partial sums and combines them over
``group`` (or the ``dp_group`` given to ``set_monitor``) as scalars, so every rank writes the statistics
of the full tensors. Every rank of the group must return the same names (an empty tensor where it holds
no piece); rows are combined in sorted-name order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from operator import is_
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from msprobe_core.monitor.records import EXP_AVG, EXP_AVG_SQ
from msprobe_core.monitor.selection import named_parameters
from msprobe_core.monitor.shard_stats import shard_partials
from msprobe_core.monitor.stats import StatsEngine

# optimizer.state key -> monitor kind
STATE_KINDS: dict[str, str] = {"exp_avg": EXP_AVG, "exp_avg_sq": EXP_AVG_SQ, "momentum_buffer": EXP_AVG}


class StateReader(ABC):
    """Reads gradients, weights and optimizer states of the monitored parameters."""

    sharded: bool = False
    """True when the tensors returned are per-rank shards to be combined over ``group``."""
    group: Any = None
    """The process group over which shard statistics are combined (None: the monitor's dp_group)."""

    @abstractmethod
    def grads(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        """``{name: gradient}`` for parameters that have one; parameters without a gradient are left out."""

    @abstractmethod
    def optimizer_states(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
        """``{kind: {name: tensor}}`` with kinds ``exp_avg`` / ``exp_avg_sq``; missing states are left out."""

    def weights(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        """``{name: weight}``; the default returns the parameters themselves."""
        return dict(params)

    def named_parameters(self, chunks: Sequence[nn.Module]) -> dict[str, nn.Parameter]:
        """The monitored parameters under their (unwrapped, qualified) names, before ``targets`` select."""
        return named_parameters(chunks)

    def full_numel(self, name: str, param: Any) -> int:
        """The element count of the full tensor named ``name`` (a shard's reader knows it)."""
        return int(getattr(param, "ds_numel", 0) or (param.numel() if param is not None else 0))

    def full_shape(self, name: str, param: Any) -> tuple[int, ...]:
        """The shape of the full tensor named ``name`` (DeepSpeed ZeRO-3 keeps it in ``ds_shape``; a reader whose
        parameters are pieces knows it)."""
        return param_shape(param)

    def shard_start(self, name: str, param: Any) -> int | None:
        """Where this rank's shard of ``name`` starts among the parameter's elements in row-major order, for a
        sharded reader whose shards are contiguous pieces of the flattened parameter (ZeRO fragments and
        partitions, distributed-optimizer ranges, FSDP pieces; any number for an empty piece); None where that is
        not known (per-expert rows of a fused expert tensor are then not made from shards)."""
        return None

    def partials(self, engine: StatsEngine, names: Sequence[str], tensors: Mapping[str, Any],
                 group: Any) -> tuple[torch.Tensor, list[Any]]:
        """This rank's partial statistics (``shard_stats``) of ``tensors`` in ``names`` order, and for each row the
        group over which it adds up (``shard_stats.LOCAL``: nothing to add); the monitor combines them
        (``combine_grouped``). Every rank of a group hands the same names."""
        return shard_partials(engine, [tensors[n] for n in names]), [group] * len(names)


def param_shape(param: Any) -> tuple[int, ...]:
    """A parameter's full shape: DeepSpeed ZeRO-3's ``ds_shape`` (its data is an empty stand-in), else its shape."""
    shape = getattr(param, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(param.shape)


class TorchStateReader(StateReader):
    """Plain PyTorch (and Megatron ``main_grad``) gradients, torch optimizer ``state`` dicts."""

    def __init__(self, params_have_main_grad: bool = True):
        self.params_have_main_grad = params_have_main_grad

    def grads(self, params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            g = getattr(p, "main_grad", None) if self.params_have_main_grad else None
            if g is None:
                g = p.grad
            if g is not None:
                out[name] = g
        return out

    def optimizer_states(self, optimizer: Any, params: Mapping[str, torch.nn.Parameter]) -> dict[str, dict[str, torch.Tensor]]:
        state = getattr(optimizer, "state", None)
        out: dict[str, dict[str, torch.Tensor]] = {}
        if not state:
            return out
        # torch's state is keyed by the parameters: looked up by identity, without a Python Tensor.__hash__ each
        if isinstance(state, dict):
            if len(state) == len(params) and all(map(is_, state, params.values())):
                found = list(state.values())  # the usual optimizer: its state holds the parameters in their order
            else:
                by_id = {id(p): s for p, s in state.items()}
                found = list(map(by_id.get, map(id, params.values())))
        else:
            found = [state.get(p) for p in params.values()]
        if all(found):  # every parameter has a state (after the first step)
            names, states = list(params), found
        else:
            named = [(name, s) for name, s in zip(params, found) if s]
            names, states = [name for name, _ in named], [s for _, s in named]
        columns = {key: _column(names, states, key) for key in STATE_KINDS}
        if columns["exp_avg"] and columns["momentum_buffer"]:  # both report exp_avg: per parameter, as they come
            for name, s in zip(names, states):
                for key, kind in STATE_KINDS.items():
                    t = s.get(key)
                    if isinstance(t, torch.Tensor):
                        out.setdefault(kind, {})[name] = t
            return out
        # one column per kind, the kinds in the order the loop above meets them
        wanted = {STATE_KINDS[key] for key, column in columns.items() if column}
        for name, s in zip(names, states):
            for key, kind in STATE_KINDS.items():
                if kind not in out and name in columns[key]:
                    out[kind] = columns[key]
            if len(out) == len(wanted):
                break
        return out


_NONE = {type(None)}


def _column(names: list[str], states: list[Any], key: str) -> dict[str, torch.Tensor]:
    """``{name: state[key]}`` for the states that hold a tensor under ``key``. The usual optimizer (every state
    holds one, or none does) is judged by the types met, not by an ``isinstance`` per parameter (slow for a
    missing one: torch's ``Tensor`` checks instances in Python)."""
    values = [s.get(key) for s in states]
    types = set(map(type, values))
    if types == _NONE:
        return {}
    if all(issubclass(t, torch.Tensor) for t in types):
        return dict(zip(names, values))
    return {name: t for name, t in zip(names, values) if isinstance(t, torch.Tensor)}

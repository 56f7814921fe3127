"""Router health per MoE layer and step, from each router's own outputs (no second routing).

Routers are found once, when the monitor attaches (``find_routers``):

* HF transformers MoE blocks: a ``*TopKRouter`` module (Qwen3-MoE, Mixtral, ...) or the ``gate`` of a
  ``*SparseMoeBlock`` whose output is ``(router_logits [T, E], router_scores [T, k], router_indices [T, k])``;
* megatron-core ``TopKRouter``: its output ``(probs, routing_map [T, E])``, and the logits its ``gating``
  computed (captured as they are returned; the router is not called again);
* any module the config's ``moe.routers`` names (its expert count: ``num_experts``, ``num_local_experts``
  or its one 2-D weight ``[num_experts, hidden]``), whose output holds its logits (the first float tensor
  whose last dimension is the expert count) and its choice (an int tensor of expert indices, or a bool
  routing map ``[T, E]``).

A forward hook per router adds, per training micro-batch of a monitored step, on the device: the tokens
each expert received (``bincount`` of the indices, or the routing map's column sums), the per-token
entropy of the router probabilities (softmax of the logits), and the tokens dropped over capacity
(megatron-core with ``moe_expert_capacity_factor``). ``RouterTap.flat`` stacks a step's numbers, with the
cosine similarity between the experts' router weight rows, so that ``MoEMonitor`` copies every router of
the step to the host at once. Each rank reports the tokens it routed itself (data-parallel ranks are not
summed).
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from msprobe_core.common.patch import patch
from msprobe_core.common.tool_guard import tool_work
from msprobe_core.errors import ConfigError
from msprobe_core.monitor.module_hooks import ROOT_NAME, in_backward

logger = logging.getLogger("msprobe_core.monitor")

HF = "hf"
MEGATRON = "megatron"
NAMED = "named"
EXTRA = 4
"""Numbers per router after the loads: entropy sum, dropped tokens, cosine max, cosine mean."""


@dataclass(frozen=True)
class RouterStep:
    """One router's health at one step (host numbers)."""

    layer: str
    load: tuple[float, ...]
    """Tokens (token-slot assignments) each expert received."""
    tokens: int
    entropy: float | None
    """Mean per-token entropy of the router probabilities (nats); None when no logits were seen."""
    dropped: float | None
    """Assignments dropped over the experts' capacity (None: the framework has no capacity)."""
    cos_max: float | None
    cos_mean: float | None

    @property
    def num_experts(self) -> int:
        return len(self.load)

    @property
    def max_mean(self) -> float:
        """Imbalance: the most loaded expert's tokens over the mean (1.0 is perfect balance)."""
        mean = sum(self.load) / len(self.load)
        return max(self.load) / mean if mean > 0 else 0.0

    @property
    def cv(self) -> float:
        """Imbalance: the coefficient of variation of the load (standard deviation over mean)."""
        n = len(self.load)
        mean = sum(self.load) / n
        if mean <= 0:
            return 0.0
        return (sum((x - mean) ** 2 for x in self.load) / n) ** 0.5 / mean

    def metrics(self) -> dict[str, float]:
        """Every series of the step: ``load.{expert}`` and the layer's scalars."""
        out = {f"load.{e}": v for e, v in enumerate(self.load)}
        out["imbalance_max_mean"] = self.max_mean
        out["imbalance_cv"] = self.cv
        for key in ("entropy", "dropped", "cos_max", "cos_mean"):
            v = getattr(self, key)
            if v is not None:
                out[{"dropped": "dropped_tokens", "cos_max": "router_cos_max",
                     "cos_mean": "router_cos_mean"}.get(key, key)] = v
        return out


class RouterTap:
    """The forward hook on one router and its per-step accumulators (device tensors)."""

    def __init__(self, name: str, module: nn.Module, kind: str, num_experts: int, is_active: Callable[[], bool]):
        self.name = name
        self.module = module
        self.kind = kind
        self.num_experts = num_experts
        self.is_active = is_active
        self.capacity = (kind == MEGATRON and getattr(getattr(module, "config", None), "moe_expert_capacity_factor",
                                                      None) is not None)
        self.topk = int(getattr(module, "topk", getattr(module, "top_k", 0)) or 0)
        self._logits: torch.Tensor | None = None
        self._warned = False
        self.reset()
        self._handles: list[Any] = [module.register_forward_hook(self._on_forward)]
        if kind == MEGATRON and callable(getattr(module, "gating", None)):
            self._handles.append(patch(module, "gating", self._capture_gating))

    def reset(self) -> None:
        self.load: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        self.tokens = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def weight(self) -> torch.Tensor | None:
        w = router_weight(self.module)
        return w if w is not None and w.shape[0] == self.num_experts else None

    def _capture_gating(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def gating(*args: Any, **kwargs: Any) -> torch.Tensor:
            logits = original(*args, **kwargs)
            if self.is_active():
                self._logits = logits
            return logits
        return gating

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        logits, self._logits = self._logits, None
        if not self.is_active() or not module.training or in_backward():
            return
        with tool_work(), torch.no_grad():
            try:
                self._add(output, logits)
            except Exception as e:  # never break training; say once why this router is not measured
                if not self._warned:
                    self._warned = True
                    logger.warning("monitor: router %s: its output cannot be read (%s); no router statistics "
                                   "for it", self.name, e)

    def _add(self, output: Any, logits: torch.Tensor | None) -> None:
        e = self.num_experts
        items = list(output) if isinstance(output, (tuple, list)) else [output]
        tensors = [t for t in items if isinstance(t, torch.Tensor)]
        if self.kind != MEGATRON:
            logits = next((t for t in tensors if t.is_floating_point() and t.shape[-1] == e), None)
        routing_map = next((t for t in tensors if t.dtype == torch.bool and t.shape[-1] == e), None)
        if routing_map is not None:
            routing_map = routing_map.reshape(-1, e)
            load = routing_map.sum(0, dtype=torch.float64)
            tokens = routing_map.shape[0]
        else:
            index = next((t for t in tensors if not t.is_floating_point() and t.dtype != torch.bool), None)
            if index is None:
                raise ValueError(f"no expert indices (an int tensor) or routing map (a bool [tokens, {e}] tensor)")
            tokens = index.reshape(-1, index.shape[-1]).shape[0] if index.dim() > 0 else 1
            load = torch.bincount(index.reshape(-1).long(), minlength=e)[:e].double()
        self.load = load if self.load is None else self.load + load
        self.tokens += tokens
        if logits is not None:
            p = torch.softmax(logits.detach().reshape(-1, e).float(), dim=-1)
            ent = torch.special.entr(p).sum(dtype=torch.float64)
            self.entropy = ent if self.entropy is None else self.entropy + ent
        if self.capacity and routing_map is not None and self.topk:
            dropped = tokens * self.topk - load.sum()
            self.dropped = dropped if self.dropped is None else self.dropped + dropped

    def flat(self) -> torch.Tensor | None:
        """This step's numbers, float64 ``[E + EXTRA]`` on the router's device (None: nothing routed)."""
        if self.load is None:
            return None
        nan = torch.full((), float("nan"), dtype=torch.float64, device=self.load.device)
        ent = self.entropy / max(self.tokens, 1) if self.entropy is not None else nan
        dropped = self.dropped.double() if self.dropped is not None else nan
        cos_max, cos_mean = nan, nan
        w = self.weight
        if w is not None and self.num_experts > 1:
            with torch.no_grad():
                wn = torch.nn.functional.normalize(w.detach().float(), dim=1)
                sim = wn @ wn.T
                off = ~torch.eye(self.num_experts, dtype=torch.bool, device=sim.device)
                vals = sim[off].double()
                cos_max, cos_mean = vals.max().to(self.load.device), vals.mean().to(self.load.device)
        return torch.cat([self.load, torch.stack([ent.to(self.load.device), dropped.to(self.load.device),
                                                  cos_max, cos_mean])])

    def step(self, values: Sequence[float]) -> RouterStep:
        """The host numbers ``flat`` gave, as a ``RouterStep``."""
        e = self.num_experts
        ent, dropped, cmax, cmean = (None if v != v else float(v) for v in values[e:e + EXTRA])
        return RouterStep(self.name, tuple(float(v) for v in values[:e]), self.tokens, ent, dropped, cmax, cmean)


def find_routers(chunks: Sequence[nn.Module], patterns: Sequence[str], is_active: Callable[[], bool],
                 source: str | None = None) -> list[RouterTap]:
    """Install a tap on every router found automatically and every module ``patterns`` names.

    ``ConfigError`` (field ``moe.routers``) for a pattern that matches no module, or names a module whose
    expert count cannot be told (no ``num_experts``, ``num_local_experts`` or 2-D ``weight``)."""
    multi = len(chunks) > 1
    modules = [((f"{c}:" if multi else "") + (name or ROOT_NAME), m)
               for c, chunk in enumerate(chunks) for name, m in chunk.named_modules()]
    chosen: dict[str, tuple[nn.Module, str]] = {}
    for name, m in modules:
        kind = _auto_kind(m)
        if kind is not None:
            chosen[name] = (m, kind)
    for pattern in patterns:
        hits = [(name, m) for name, m in modules if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            sample = ", ".join(n for n, _ in modules[:6])
            raise ConfigError("moe.routers", pattern, f"names or fnmatch patterns of modules of the model, e.g. {sample}",
                              source)
        for name, m in hits:
            if name not in chosen:
                chosen[name] = (m, NAMED)
    taps: list[RouterTap] = []
    try:
        for name, (m, kind) in chosen.items():
            e = _num_experts(m)
            if e is None:
                raise ConfigError("moe.routers", name, "router modules with num_experts, num_local_experts or one "
                                  "2-D weight [num_experts, hidden]", source)
            taps.append(RouterTap(name, m, kind, e, is_active))
    except Exception:
        for t in taps:
            t.remove()
        raise
    return taps


def _auto_kind(m: nn.Module) -> str | None:
    cls = type(m).__name__
    if cls == "TopKRouter" and type(m).__module__.startswith("megatron."):
        return MEGATRON
    if cls.endswith("TopKRouter") and _num_experts(m) is not None:
        return HF
    return None


def _num_experts(m: nn.Module) -> int | None:
    for attr in ("num_experts", "num_local_experts"):
        v = getattr(m, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    config = getattr(m, "config", None)
    v = getattr(config, "num_moe_experts", None)
    if isinstance(v, int) and v > 0:
        return v
    w = router_weight(m)
    return int(w.shape[0]) if w is not None else None


def router_weight(m: nn.Module) -> torch.Tensor | None:
    """The router's weight ``[num_experts, hidden]``: its own 2-D ``weight``, else its only 2-D parameter."""
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return w
    found = [p for p in m.parameters() if p.dim() == 2]
    return found[0] if len(found) == 1 else None


__all__ = ["RouterStep", "RouterTap", "find_routers"]

"""Router health per MoE layer and step, from each router's own outputs (no second routing).

Routers are found once, when the monitor attaches (``find_routers``):

* HF transformers MoE blocks: a ``*TopKRouter`` module (Qwen3-MoE, Mixtral, ...) or the ``gate`` of a
  ``*SparseMoeBlock`` whose output is ``(router_logits [T, E], router_scores [T, k], router_indices [T, k])``;
* megatron-core ``TopKRouter``: its output ``(probs, routing_map [T, E])``, and the logits its ``gating``
  computed (captured as they are returned; the router is not called again);
* DeepSpeed MoE's ``TopKGate`` (``deepspeed.moe.layer.MoE``): its output (``l_aux, capacity, E, indices
  [k, T]`` with -1 for a route dropped over capacity, ...; or the older ``l_aux, combine_weights,
  dispatch_mask [T, E, C], exp_counts``), and the logits handed to DeepSpeed's gating function
  (``top1gating`` / ``top2gating`` / ``topkgating``, wrapped once per process while a gate is tapped: the
  entropy is taken there, before ``top2gating`` adds its sampling noise to the logits in place);
* any module the config's ``moe.routers`` names (its expert count: ``num_experts``, ``num_local_experts``
  or its one 2-D weight ``[num_experts, hidden]``), whose output holds its logits (the first float tensor
  whose last dimension is the expert count) and its choice (an int tensor of expert indices, or a bool
  routing map ``[T, E]``).

A forward hook per router adds, per training micro-batch of a monitored step, on the device: the tokens
each expert received (``bincount`` of the indices, or the routing map's column sums), the per-token
entropy of the router probabilities, and the tokens dropped over capacity (megatron-core with
``moe_expert_capacity_factor``, DeepSpeed with ``drop_tokens``). ``RouterTap.flat`` stacks a step's
numbers, with the cosine similarity between the experts' router weight rows, so that ``MoEMonitor`` copies
every router of the step to the host at once.

The router probabilities are the router's own score function: a softmax over the experts' logits (HF,
DeepSpeed, megatron-core's default), or, for megatron-core's ``moe_router_score_function == "sigmoid"``
(DeepSeek-V3 style), each expert's sigmoid score normalised over the experts (``s_e / sum(s)``), the
distribution whose top-k the router picks. The entropy is that distribution's, in nats: ``log(E)`` when
the router cannot tell the experts apart, 0 when it puts all weight on one.

Which tokens a router's load counts: each rank routes its own tokens. Under expert parallelism (the
router's or its MoE layer's ``ep_group`` has more than one rank: megatron-core ``MoELayer``, DeepSpeed
``TopKGate``) the loads, token counts, entropy sums and dropped tokens are summed over the expert-parallel
group (one all-reduce per step for all routers), so the load is that of the experts, which receive the
tokens of every rank of the group; without it, each rank reports the tokens it routed itself
(data-parallel ranks are not summed).
"""

from __future__ import annotations

import fnmatch
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from msprobe_core.common.patch import patch
from msprobe_core.common.tool_guard import tool_work
from msprobe_core.errors import ConfigError
from msprobe_core.monitor.module_hooks import ROOT_NAME, in_backward
from msprobe_core.pytorch.wrapper_names import unwrapped_modules

logger = logging.getLogger("msprobe_core.monitor")

HF = "hf"
MEGATRON = "megatron"
DEEPSPEED = "deepspeed"
NAMED = "named"
SUMMED = 4
"""Numbers per router after the loads that add up over ranks: tokens, entropy sum, entropy token count,
dropped tokens."""
EXTRA = SUMMED + 2
"""Numbers per router after the loads: the ``SUMMED`` ones, then router cosine max and mean."""
SCORE_FUNCTIONS = ("softmax", "sigmoid")
_DS_GATING = ("top1gating", "top2gating", "topkgating")


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

    def __init__(self, name: str, module: nn.Module, kind: str, num_experts: int, is_active: Callable[[], bool],
                 owner: nn.Module | None = None):
        self.name = name
        self.module = module
        self.kind = kind
        self.num_experts = num_experts
        self.is_active = is_active
        self.owner = owner
        config = getattr(module, "config", None)
        self.capacity = ((kind == MEGATRON and getattr(config, "moe_expert_capacity_factor", None) is not None)
                         or (kind == DEEPSPEED and bool(getattr(module, "drop_tokens", False))))
        self.topk = int(getattr(module, "topk", getattr(module, "top_k", getattr(module, "k", 0))) or 0)
        self.score = str(getattr(module, "score_function", None) or getattr(config, "moe_router_score_function", None)
                         or "softmax") if kind == MEGATRON else "softmax"
        if self.score not in SCORE_FUNCTIONS:
            logger.warning("monitor: router %s: score function %r is not one of %s; no router entropy for it",
                           name, self.score, SCORE_FUNCTIONS)
        self._warned = False
        self.reset()
        self._handles: list[Any] = [module.register_forward_hook(self._on_forward)]
        if kind == MEGATRON and callable(getattr(module, "gating", None)):
            self._handles.append(patch(module, "gating", self._capture_gating))
        if kind == DEEPSPEED:
            self._handles += [module.register_forward_pre_hook(self._on_ds_gate), _DeepSpeedGating.acquire(module)]

    def reset(self) -> None:
        self.load: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None
        self.entropy_tokens = 0
        self.dropped: torch.Tensor | None = None
        self.tokens = 0
        self.cosine: torch.Tensor | None = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def weight(self) -> torch.Tensor | None:
        w = router_weight(self.module)
        return w if w is not None and w.shape[0] == self.num_experts else None

    @property
    def group(self) -> Any:
        """The expert-parallel group the router's numbers are summed over (None: not expert-parallel)."""
        for m in (self.module, self.owner):
            group = getattr(m, "ep_group", None) if m is not None else None
            if group is not None:
                size = getattr(group, "size", None)
                return group if callable(size) and size() > 1 else None
        return None

    def _counting(self) -> bool:
        return self.is_active() and self.module.training and not in_backward()

    def _capture_gating(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def gating(*args: Any, **kwargs: Any) -> torch.Tensor:
            logits = original(*args, **kwargs)
            if self._counting():
                self._guarded(self._add_entropy, logits)
            return logits
        return gating

    def _on_ds_gate(self, module: nn.Module, args: Any) -> None:
        _DeepSpeedGating.current = self if self._counting() else None

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.kind == DEEPSPEED:
            _DeepSpeedGating.current = None
        if self._counting():
            self._guarded(self._add, output)
            if self.cosine is None:
                self._guarded(self._add_cosine, None)

    def _add_cosine(self, _: Any) -> None:
        """Max and mean cosine similarity between the experts' router-weight rows, as the step's first forward
        used them (FSDP and ZeRO-3 hold the whole weight only around the forward): ``[2]`` on its device."""
        w = self.weight
        if w is None or self.num_experts < 2 or type(w) not in (torch.Tensor, nn.Parameter):
            return  # (a DTensor piece or an empty ZeRO-3 stand-in: the whole weight is not here)
        wn = torch.nn.functional.normalize(w.detach().float(), dim=1)
        vals = (wn @ wn.T)[~torch.eye(self.num_experts, dtype=torch.bool, device=w.device)].double()
        self.cosine = torch.stack([vals.max(), vals.mean()])

    def _guarded(self, fn: Callable[[Any], None], arg: Any) -> None:
        with tool_work(), torch.no_grad():
            try:
                fn(arg)
            except Exception as e:  # never break training; say once why this router is not measured
                if not self._warned:
                    self._warned = True
                    logger.warning("monitor: router %s: its output cannot be read (%s); no router statistics "
                                   "for it", self.name, e)

    def _add_entropy(self, logits: torch.Tensor) -> None:
        """Adds the per-token entropies of the router probabilities (the router's score function)."""
        if self.score not in SCORE_FUNCTIONS:
            return
        x = logits.detach().reshape(-1, self.num_experts).float()
        if self.score == "sigmoid":
            s = torch.sigmoid(x)
            p = s / s.sum(-1, keepdim=True)
        else:
            p = torch.softmax(x, dim=-1)
        ent = torch.special.entr(p).sum(dtype=torch.float64)
        self.entropy = ent if self.entropy is None else self.entropy + ent
        self.entropy_tokens += x.shape[0]

    def _add(self, output: Any) -> None:
        e = self.num_experts
        items = list(output) if isinstance(output, (tuple, list)) else [output]
        if self.kind == DEEPSPEED:
            self._add_deepspeed(items)
            return
        tensors = [t for t in items if isinstance(t, torch.Tensor)]
        if self.kind != MEGATRON:
            logits = next((t for t in tensors if t.is_floating_point() and t.shape[-1] == e), None)
            if logits is not None:
                self._add_entropy(logits)
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
        dropped = tokens * self.topk - load.sum() if self.capacity and routing_map is not None and self.topk else None
        self._accumulate(load, tokens, dropped)

    def _add_deepspeed(self, items: list[Any]) -> None:
        """DeepSpeed ``TopKGate``'s output: sparse routes ``indices [k, T]`` (-1: dropped over capacity), or the
        older dense ``dispatch_mask [T, E, C]``."""
        e = self.num_experts
        index = items[3] if len(items) == 7 else None
        if isinstance(index, torch.Tensor) and index.dim() == 2 and not index.is_floating_point():
            counts = torch.bincount(index.reshape(-1).long() + 1, minlength=e + 1).double()  # slot 0: dropped
            self._accumulate(counts[1:e + 1], index.shape[1], counts[0] if self.capacity else None)
            return
        mask = items[2] if len(items) == 4 else None
        if not (isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[1] == e):
            raise ValueError("not the output of a DeepSpeed TopKGate (sparse routes or a dispatch mask)")
        load = mask.sum((0, 2), dtype=torch.float64)
        tokens = mask.shape[0]
        self._accumulate(load, tokens, tokens * self.topk - load.sum() if self.capacity and self.topk else None)

    def _accumulate(self, load: torch.Tensor, tokens: int, dropped: torch.Tensor | None) -> None:
        self.load = load if self.load is None else self.load + load
        self.tokens += tokens
        if dropped is not None:
            dropped = dropped.double()
            self.dropped = dropped if self.dropped is None else self.dropped + dropped

    def flat(self, device: torch.device | None = None) -> torch.Tensor | None:
        """This step's numbers, float64 ``[E + EXTRA]`` on the router's device (the first ``E + SUMMED`` add up
        over ranks). None when nothing was routed, unless ``device`` is given: then an empty step there (an
        expert-parallel rank still joins the group's all-reduce)."""
        if self.load is None and device is None:
            return None
        dev = self.load.device if self.load is not None else device
        nan = torch.full((), float("nan"), dtype=torch.float64, device=dev)
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        load = self.load if self.load is not None else torch.zeros(self.num_experts, dtype=torch.float64, device=dev)
        ent = self.entropy.to(dev) if self.entropy is not None else zero
        dropped = self.dropped.to(dev) if self.dropped is not None else (zero if self.capacity else nan)
        cos_max, cos_mean = self.cosine.to(dev) if self.cosine is not None else (nan, nan)
        counts = torch.tensor([float(self.tokens), float(self.entropy_tokens)], dtype=torch.float64).to(dev)
        return torch.cat([load, counts[:1], ent.reshape(1), counts[1:], torch.stack([dropped, cos_max, cos_mean])])

    def step(self, values: Sequence[float]) -> RouterStep | None:
        """The host numbers ``flat`` gave (summed over the expert-parallel group), as a ``RouterStep`` (None
        when no token was routed)."""
        e = self.num_experts
        tokens, ent_sum, ent_tokens, dropped, cmax, cmean = values[e:e + EXTRA]
        if tokens <= 0:
            return None
        ent = ent_sum / ent_tokens if ent_tokens > 0 else None
        return RouterStep(self.name, tuple(float(v) for v in values[:e]), int(tokens), ent,
                          *(None if v != v else float(v) for v in (dropped, cmax, cmean)))


class _DeepSpeedGating:
    """DeepSpeed's gating functions (``deepspeed.moe.sharded_moe.top1gating`` ...), wrapped once per process
    while any ``TopKGate`` is tapped: the wrapper hands the logits to the tap whose gate is running
    (``current``, set by the gate's forward pre-hook) before DeepSpeed's function sees them."""

    current: "RouterTap | None" = None
    _users = 0
    _handles: list[Any] = []

    @classmethod
    def acquire(cls, gate: nn.Module) -> "_DeepSpeedGating":
        if cls._users == 0:
            owner = sys.modules[type(gate).__module__]
            cls._handles = [patch(owner, f, cls._wrap) for f in _DS_GATING if callable(getattr(owner, f, None))]
        cls._users += 1
        return cls()

    @staticmethod
    def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def gating(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            tap = _DeepSpeedGating.current
            if tap is not None:
                tap._guarded(tap._add_entropy, logits)
            return original(logits, *args, **kwargs)
        return gating

    def remove(self) -> None:
        """Releases this tap's use (the last one restores DeepSpeed's functions)."""
        cls = type(self)
        cls._users -= 1
        if cls._users == 0:
            while cls._handles:
                cls._handles.pop().remove()
            cls.current = None


def find_routers(chunks: Sequence[nn.Module], patterns: Sequence[str], is_active: Callable[[], bool],
                 source: str | None = None) -> list[RouterTap]:
    """Install a tap on every router found automatically and every module ``patterns`` names.

    ``ConfigError`` (field ``moe.routers``) for a pattern that matches no module, or names a module whose
    expert count cannot be told (no ``num_experts``, ``num_local_experts`` or 2-D ``weight``)."""
    multi = len(chunks) > 1
    modules = [((f"{c}:" if multi else "") + (name or ROOT_NAME), m)
               for c, chunk in enumerate(chunks) for name, m in unwrapped_modules(chunk)]  # FSDP1: names without wrappers
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
        owners = dict(modules)
        for name, (m, kind) in chosen.items():
            e = _num_experts(m)
            if e is None:
                raise ConfigError("moe.routers", name, "router modules with num_experts, num_local_experts or one "
                                  "2-D weight [num_experts, hidden]", source)
            taps.append(RouterTap(name, m, kind, e, is_active, owners.get(name.rpartition(".")[0])))
    except Exception:
        for t in taps:
            t.remove()
        raise
    return taps


def is_router(m: nn.Module) -> bool:
    """Whether ``m`` is a router found automatically (its weight rows are the experts' router rows, not experts)."""
    return _auto_kind(m) is not None


def _auto_kind(m: nn.Module) -> str | None:
    cls = type(m).__name__
    if cls == "TopKRouter" and type(m).__module__.startswith("megatron."):
        return MEGATRON
    if cls == "TopKGate" and type(m).__module__.startswith("deepspeed."):
        return DEEPSPEED
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


__all__ = ["RouterStep", "RouterTap", "find_routers", "is_router"]

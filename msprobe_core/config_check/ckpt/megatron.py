"""Megatron-LM / MindSpeed checkpoints in torch format: ``iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``.

One file per tensor-parallel (TT), pipeline (PPP) and expert-parallel (EEE) rank (with two numbers the
second is the pipeline rank unless the stored ``args`` say the run had expert but no pipeline
parallelism). Each file holds ``model`` (or ``model0``, ``model1``, ... with a virtual pipeline) with
local names; they are merged into one model with global names:

- pipeline stages and virtual-pipeline chunks renumber ``decoder.layers.N`` (``encoder.layers.N`` in
  legacy models) by the number of layers the chunks before them hold, in Megatron's order (chunk 0 of
  every stage, then chunk 1, ...), which also covers uneven stages;
- expert-parallel ranks renumber ``local_experts.N`` (and TransformerEngine's grouped ``weightN``) by
  the experts the ranks before them hold; GroupedMLP's ``weight1``/``weight2`` are concatenated;
- tensor-parallel shards are concatenated along their split dimension: column-parallel layers
  (``linear_qkv``, ``linear_fc1``, embeddings, output layer) along 0, row-parallel weights
  (``linear_proj``, ``linear_fc2``) along 1; gated MLPs (``args.swiglu``) interleave the gate and up
  halves of each shard; replicated tensors (norms, row-parallel biases, router) are taken from rank 0.

Names are canonical across layer specs: TransformerEngine's fused ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight`` are read as ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from msprobe_core.config_check.ckpt import torch_file
from msprobe_core.config_check.ckpt.source import EXTRA_STATE, Checkpoint, Entry
from msprobe_core.config_check.exceptions import CheckpointError

RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
FILES = ("model_optim_rng.pt", "model_rng.pt")
_LAYER = re.compile(r"((?:decoder|encoder)\.layers\.)(\d+)(?=\.)")
_LOCAL_EXPERT = re.compile(r"(local_experts\.)(\d+)(?=\.)")
_TE_EXPERT = re.compile(r"(experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_GROUPED = re.compile(r"experts\.weight([12])$")
COLUMN = re.compile(r"(linear_qkv|linear_fc1|word_embeddings|output_layer|query_key_value|dense_h_to_4h|linear_q_proj|"
                    r"linear_q_up_proj|linear_kv_up_proj|\.query|\.key_value)\.(weight|bias)$")
ROW = re.compile(r"(linear_proj|linear_fc2|dense_4h_to_h|\.dense)\.weight$")
GLU = re.compile(r"(linear_fc1|dense_h_to_4h)\.(weight|bias)$")
REPLICATED = re.compile(r"(norm|layer_norm_weight|layer_norm_bias)(\.weight|\.bias)?$|(linear_proj|linear_fc2|dense_4h_to_h|"
                        r"\.dense)\.bias$|router\.|position_embeddings\.weight$|inv_freq$|expert_bias$")
TE_RENAMES = ((".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
              (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
              (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
              (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias"))


def canonical(name: str) -> str:
    """TransformerEngine's fused layer-norm names read as the local spec's."""
    for te, local in TE_RENAMES:
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def model_config(args: Any) -> dict[str, Any]:
    """What the merge and the Hugging Face mapping need from Megatron's stored ``args``."""
    if args is None:
        return {}
    get = lambda k: getattr(args, k, None)  # noqa: E731
    heads = get("num_attention_heads")
    groups = get("num_query_groups") if get("group_query_attention") else heads
    return {k: v for k, v in {"num_attention_heads": heads, "num_query_groups": groups,
                              "hidden_size": get("hidden_size"), "ffn_hidden_size": get("ffn_hidden_size"),
                              "kv_channels": get("kv_channels"), "num_layers": get("num_layers"),
                              "gated_linear_unit": bool(get("swiglu") or get("gated_linear_unit")),
                              "expert_tensor_parallel_size": get("expert_tensor_parallel_size")}.items()
            if v is not None}


def _chunks(state: dict[str, Any]) -> list[dict[str, Any]]:
    if "model" in state:
        return [state["model"]]
    numbered = sorted((int(k[5:]), v) for k, v in state.items() if re.fullmatch(r"model\d+", str(k)))
    if not numbered:
        raise CheckpointError("checkpoint file holds no 'model' (or 'model0', 'model1', ...) state dict")
    return [v for _, v in numbered]


def _tensors(state: dict[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    out = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor) and not name.endswith(EXTRA_STATE):
            out.append((name, value))
        elif isinstance(value, dict):
            out.extend(_tensors(value, f"{name}."))
    return out


def _rank_of(name: str, args: Any) -> tuple[int, int, int]:
    numbers = [int(g) for g in RANK_DIR.match(name).groups() if g is not None]
    if len(numbers) == 1:
        return numbers[0], 0, 0
    if len(numbers) == 3:
        return numbers[0], numbers[1], numbers[2]
    pp = getattr(args, "pipeline_model_parallel_size", None) or 1
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    return (numbers[0], 0, numbers[1]) if pp == 1 and ep > 1 else (numbers[0], numbers[1], 0)


def rank_files(iter_dir: Path) -> list[Path]:
    """The ``mp_rank_*/model_optim_rng.pt`` files of one iteration folder."""
    files = []
    for d in sorted(p for p in iter_dir.iterdir() if p.is_dir() and RANK_DIR.match(p.name)):
        found = next((d / f for f in FILES if (d / f).is_file()), None)
        if found is None:
            raise CheckpointError(f"{d} holds none of {', '.join(FILES)}")
        files.append(found)
    return files


def open_megatron(iter_dir: Path) -> Checkpoint:
    """The merged model of one ``iter_XXXXXXX`` folder (see the module docstring)."""
    files = rank_files(iter_dir)
    if not files:
        raise CheckpointError(f"{iter_dir} holds no mp_rank_* folders")
    states = {}
    args = None
    for f in files:
        state = torch_file.load(str(f))
        if not isinstance(state, dict):
            raise CheckpointError(f"{f} does not hold a dict (a Megatron checkpoint file has 'model' and 'args')")
        args = args if args is not None else state.get("args")
        states[f] = state
    ranks = {f: _rank_of(f.parent.name, args) for f in files}
    config = model_config(args)
    ckpt = Checkpoint(str(iter_dir), "megatron", config=config)
    if args is None:
        ckpt.notes.append("no 'args' stored: gated-MLP (swiglu) shards are assumed not gated")
    chunks = {ranks[f]: _chunks(s) for f, s in states.items()}
    layer_offset = _layer_offsets(chunks)
    expert_offset = _expert_offsets(chunks)
    shards: dict[str, dict[tuple[int, int], torch.Tensor]] = defaultdict(dict)
    for v in range(max(len(c) for c in chunks.values())):
        for rank in sorted(chunks, key=lambda r: (r[1], r[2], r[0])):
            tp, pp, ep = rank
            if v >= len(chunks[rank]):
                continue
            for local, tensor in _tensors(chunks[rank][v]):
                expert = "experts" in local
                if not expert and ep:
                    continue  # replicas of the dense part on every expert-parallel rank
                name = _global_name(local, layer_offset[(pp, v)], expert_offset[(tp, pp, ep, v)])
                shards[canonical(name)][(ep, tp)] = tensor
    glu = bool(config.get("gated_linear_unit"))
    etp = config.get("expert_tensor_parallel_size")
    for name, parts in shards.items():
        ckpt.entries[name] = merge_shards(name, parts, glu, replicate_experts=etp == 1)
    return ckpt


def _layer_numbers(state: dict[str, Any], pattern: re.Pattern) -> set[int]:
    return {int(m.group(2)) for name, _ in _tensors(state) for m in [pattern.search(name)] if m}


def _layer_offsets(chunks: dict[tuple[int, int, int], list[dict]]) -> dict[tuple[int, int], int]:
    """Global number of each (pipeline stage, virtual chunk)'s first layer, in Megatron's chunk order."""
    stages = sorted({pp for _, pp, _ in chunks})
    vpp = max(len(c) for c in chunks.values())
    offsets, total = {}, 0
    for v in range(vpp):
        for pp in stages:
            ref = next((c for (tp, p, ep), c in sorted(chunks.items()) if p == pp and ep == 0), None)
            offsets[(pp, v)] = total
            if ref is not None and v < len(ref):
                total += len(_layer_numbers(ref[v], _LAYER))
    return offsets


def _expert_offsets(chunks: dict[tuple[int, int, int], list[dict]]) -> dict[tuple[int, int, int, int], int]:
    """Global number of each expert-parallel rank's first local expert (experts per rank counted)."""
    offsets = {}
    for (tp, pp, ep), states in chunks.items():
        for v, state in enumerate(states):
            local = len(_layer_numbers(state, _LOCAL_EXPERT)) or \
                len({int(m.group(2)) for name, _ in _tensors(state) for m in [_TE_EXPERT.search(name)] if m})
            offsets[(tp, pp, ep, v)] = ep * local
    return offsets


def _global_name(name: str, layer_offset: int, expert_offset: int) -> str:
    name = _LAYER.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + layer_offset}", name, count=1)
    if expert_offset:
        name = _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}", name, count=1)
        name = _TE_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}", name, count=1)
    return name


def merge_shards(name: str, parts: dict[tuple[int, int], torch.Tensor], glu: bool, replicate_experts: bool) -> Entry:
    """One parameter from its shards keyed ``(expert-parallel rank, tensor-parallel rank)`` (module docstring)."""
    ordered = [parts[k] for k in sorted(parts)]
    first = ordered[0]
    dtype = str(first.dtype).replace("torch.", "")
    if len(ordered) == 1 or (replicate_experts and "experts" in name) or \
            (REPLICATED.search(name) and not COLUMN.search(name)):
        return Entry(tuple(first.shape), dtype, lambda: first)
    grouped = _GROUPED.search(name)
    note = ""
    if grouped:
        dim = 1 if grouped.group(1) == "1" else 0
        if len({tp for _, tp in parts}) > 1:
            note = "GroupedMLP with tensor parallelism: shards concatenated without regrouping experts"
    elif COLUMN.search(name):
        dim = 0
    elif ROW.search(name):
        dim = 1
    else:
        dim = 0
        note = "split dimension not known for this name: shards concatenated along dim 0"
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in ordered)
    gated = glu and not grouped and GLU.search(name) is not None

    def load() -> torch.Tensor:
        if gated:
            halves = [p.chunk(2, dim=0) for p in ordered]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(ordered, dim=dim)

    return Entry(tuple(shape), dtype, load, note)


"""Checkpoint compare speed and memory on a 1 GB pair (target: under a minute on 2 cores).

Writes a Llama-shaped model of about 1 GB (fp32; hidden 2048, 4 layers, GQA 16 heads / 4 groups, SwiGLU
ffn 5632, vocabulary 16384) twice:

- ``megatron``: Megatron-LM layout with TP=2 (``iter_0000001/mp_rank_00|01/model_optim_rng.pt``), so the
  compare concatenates shards and interleaves the SwiGLU halves;
- ``hf``: its Hugging Face conversion as sharded safetensors, every tensor perturbed by 1e-3 (nothing is
  bitwise equal), so the compare also maps names and splits q/k/v and gate/up;

then runs ``python -m msprobe_core config_check --compare`` on (megatron, hf) and (hf, hf), each in a fresh
process pinned to ``--cpus`` CPUs, ``--repeats`` times, and reports the median wall time and the peak
anonymous memory (RssAnon: what the process allocated; memory-mapped checkpoint pages are file cache)
against the size of the largest parameter.

    python benchmarks/ckpt_compare_speed.py [--repeats 3] [--cpus 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HIDDEN, LAYERS, HEADS, GROUPS, FFN, VOCAB = 2048, 4, 16, 4, 5632, 16384
HEAD_DIM = HIDDEN // HEADS

CHILD = r"""
import threading, time, sys
peak = [0]
def sample():
    while True:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    peak[0] = max(peak[0], int(line.split()[1]))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
from msprobe_core.cli import main
t = time.perf_counter()
code = main(["config_check", "--compare", sys.argv[1], sys.argv[2], "-o", sys.argv[3], "-q"])
print("RESULT", time.perf_counter() - t, peak[0] * 1024, code)
"""


def megatron_state(tp: int, rank: int, g: torch.Generator, full: dict) -> dict:
    """One TP rank's shard of the model (the full tensors are drawn once, into ``full``)."""
    def draw(name, *shape):
        if name not in full:
            full[name] = torch.randn(*shape, generator=g)
        return full[name]

    sd = {"embedding.word_embeddings.weight": draw("emb", VOCAB, HIDDEN).chunk(tp)[rank],
          "output_layer.weight": draw("out", VOCAB, HIDDEN).chunk(tp)[rank],
          "decoder.final_layernorm.weight": draw("norm", HIDDEN)}
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        qkv = draw(f"qkv{i}", (HEADS + 2 * GROUPS) * HEAD_DIM, HIDDEN)
        gate, up = draw(f"gate{i}", FFN, HIDDEN), draw(f"up{i}", FFN, HIDDEN)
        sd.update({p + "input_layernorm.weight": draw(f"ln1{i}", HIDDEN),
                   p + "pre_mlp_layernorm.weight": draw(f"ln2{i}", HIDDEN),
                   p + "self_attention.linear_qkv.weight": qkv.chunk(tp)[rank],
                   p + "self_attention.linear_proj.weight": draw(f"proj{i}", HIDDEN, HIDDEN).chunk(tp, dim=1)[rank],
                   p + "mlp.linear_fc1.weight": torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]),
                   p + "mlp.linear_fc2.weight": draw(f"fc2{i}", HIDDEN, FFN).chunk(tp, dim=1)[rank]})
    return sd


def hf_state(full: dict) -> dict:
    """The Hugging Face (Llama) conversion of the same weights."""
    sd = {"model.embed_tokens.weight": full["emb"], "lm_head.weight": full["out"], "model.norm.weight": full["norm"]}
    per = HEADS // GROUPS
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        qkv = full[f"qkv{i}"].view(GROUPS, per + 2, HEAD_DIM, HIDDEN)
        sd.update({p + "input_layernorm.weight": full[f"ln1{i}"], p + "post_attention_layernorm.weight": full[f"ln2{i}"],
                   p + "self_attn.q_proj.weight": qkv[:, :per].reshape(-1, HIDDEN),
                   p + "self_attn.k_proj.weight": qkv[:, per].reshape(-1, HIDDEN),
                   p + "self_attn.v_proj.weight": qkv[:, per + 1].reshape(-1, HIDDEN),
                   p + "self_attn.o_proj.weight": full[f"proj{i}"], p + "mlp.gate_proj.weight": full[f"gate{i}"],
                   p + "mlp.up_proj.weight": full[f"up{i}"], p + "mlp.down_proj.weight": full[f"fc2{i}"]})
    return sd


def write(root: str) -> tuple[int, int]:
    """Write both checkpoints; returns (bytes of one checkpoint, bytes of the largest parameter)."""
    import argparse as ap

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    full: dict = {}
    args = ap.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, num_attention_heads=HEADS,
                        group_query_attention=True, num_query_groups=GROUPS, hidden_size=HIDDEN, swiglu=True)
    for rank in range(2):
        folder = os.path.join(root, "megatron", "iter_0000001", f"mp_rank_{rank:02d}")
        os.makedirs(folder)
        torch.save({"model": megatron_state(2, rank, g, full), "args": args, "iteration": 1},
                   os.path.join(folder, "model_optim_rng.pt"))
    with open(os.path.join(root, "megatron", "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    hf = {k: (v + 1e-3).contiguous() for k, v in hf_state(full).items()}
    folder = os.path.join(root, "hf")
    os.makedirs(folder)
    weight_map, shard, size, n = {}, {}, 0, 0
    for name, tensor in list(hf.items()) + [(None, None)]:
        if name is None or size + tensor.numel() * 4 > 300 << 20:
            n += 1
            file = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(folder, file))
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0
        if name is not None:
            shard[name] = tensor
            size += tensor.numel() * 4
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"num_attention_heads": HEADS, "num_key_value_heads": GROUPS, "hidden_size": HIDDEN}, f)
    return sum(v.numel() * 4 for v in hf.values()), max(v.numel() * 4 for v in hf.values())


def run(a: str, b: str, out: str, cpus: int) -> tuple[float, int]:
    if os.path.exists(out):
        os.unlink(out)
    cmd = [sys.executable, "-c", CHILD, a, b, out]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", ",".join(str(c) for c in range(cpus))] + cmd
    env = {**os.environ, "OMP_NUM_THREADS": str(cpus)}
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT"))
    _, seconds, peak, code = line.split()
    assert code == "0", res.stderr
    return float(seconds), int(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--keep", default=None, help="write the checkpoints here and keep them")
    args = parser.parse_args()
    root = args.keep or tempfile.mkdtemp(prefix="ckpt_speed_")
    try:
        t = time.perf_counter()
        if os.path.exists(os.path.join(root, "hf")):
            print(f"reusing the checkpoints in {root}")
        else:
            total, largest = write(root)
            print(f"wrote 2 checkpoints of {total / 2**30:.2f} GiB each in {time.perf_counter() - t:.1f} s "
                  f"(largest parameter {largest / 2**20:.0f} MiB)")
        out = os.path.join(root, "o.json")
        for label, a, b in (("megatron TP=2 vs hf (mapped, all differ)", "megatron", "hf"),
                            ("hf vs hf (identical)", "hf", "hf")):
            times, peaks = zip(*(run(os.path.join(root, a), os.path.join(root, b), out, args.cpus)
                                 for _ in range(args.repeats)))
            print(f"{label:<42} median {statistics.median(times):6.2f} s  (min {min(times):.2f}, max {max(times):.2f})"
                  f"  peak RssAnon {max(peaks) / 2**20:.0f} MiB")
        with open(out) as f:
            result = json.load(f)
        print(f"{len(result)} parameters per compare; target: under 60 s on {args.cpus} CPUs")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

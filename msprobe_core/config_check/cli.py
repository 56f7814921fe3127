"""``python -m msprobe_core config_check``: collect a pack, compare two packs, or compare two checkpoints.

    config_check -f pytorch -d run.sh conf.yaml [-o config_check_pack.zip]      static collection
    config_check -c BENCH.zip CMP.zip [-o ./config_check_result]                 compare two packs
    config_check --compare CKPT_A CKPT_B [-o ./ckpt_similarity.json]             compare two checkpoints

``-c``/``--compare`` takes two config_check packs or two checkpoints; which one is told by their content.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

EPILOG = """\
static collection: environment variables, installed packages, and (with -d) the hyperparameters of
  launch scripts (bash: torchrun, python -m torch.distributed.launch, deepspeed, accelerate launch,
  msrun, python train.py ...; variables, arrays, continuations are followed) and YAML/JSON configs.
  What cannot be parsed is reported and recorded, never fatal. An existing output file is an error.
compare packs: OUT is deleted and created again (only an empty folder or a previous result is deleted);
  it receives bench/, cmp/ and result.xlsx (summary sheet + one sheet per check).
  exit status: 0 all checks pass, 1 some check fails, 2 unusable input.
compare checkpoints: Megatron-LM/MindSpeed (latest_checkpointed_iteration.txt or iter_XXXXXXX, TP/PP/EP/
  virtual-pipeline shards merged), megatron-core torch_dist, Hugging Face (safetensors, sharded with an
  index, pytorch_model.bin), DeepSpeed; a Megatron checkpoint and a Hugging Face one are matched through
  the shipped name mapping (or --name-mapping). Output: {name: {l2, cos, numel, shape}}; an existing
  output file is an error.
dynamic collection (per rank and micro-step: weights, batches, random-number call sites, Megatron args):
  from msprobe_core.config_check import ConfigChecker
  ConfigChecker.apply_patches(fmk="pytorch")          # top of the training script
  ConfigChecker(model, shell_path=["run.sh"], output_zip_path="./config_check_pack.zip", fmk="pytorch")
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the config_check options to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("-f", "--framework", choices=("pytorch", "mindspore"), default="pytorch",
                        help="training framework of the runs (default pytorch)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-d", "--data", nargs="+", metavar="FILE",
                      help="launch scripts (.sh) and config files (.yaml/.yml/.json) to take hyperparameters from")
    mode.add_argument("-c", "--compare", nargs=2, metavar=("BENCH", "CMP"),
                      help="two config_check packs, or two checkpoints, to compare")
    parser.add_argument("-o", "--output", default=None,
                        help="static collection: the pack (default config_check_pack.zip); pack compare: the "
                             "result folder (default ./config_check_result); checkpoint compare: the JSON file "
                             "(default ./ckpt_similarity.json)")
    parser.add_argument("--name-mapping", metavar="YAML", default=None,
                        help="checkpoint compare: rules mapping one checkpoint's parameter names to the other's "
                             "(default: the shipped Megatron -> Hugging Face mapping, used when needed)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Dispatch to collection, pack compare or checkpoint compare."""
    logging.getLogger("msprobe_core").setLevel(logging.INFO)
    if args.compare:
        from msprobe_core.config_check import pack

        bench, cmp = args.compare
        packs = [pack.is_pack(p) for p in args.compare]
        if all(packs):
            from msprobe_core.config_check.compare import DEFAULT_OUTPUT, compare_packs, summary_text
            from msprobe_core.config_check.checks import overall_pass

            output = args.output or DEFAULT_OUTPUT
            results = compare_packs(bench, cmp, output)
            print(summary_text(results, output))
            return 0 if overall_pass(results) else 1
        if any(packs):
            from msprobe_core.config_check.exceptions import PackInputError

            which = bench if not packs[0] else cmp
            raise PackInputError(f"'{which}' is not a config_check pack while the other path is one; "
                                 "-c takes two packs or two checkpoints")
        from msprobe_core.config_check.ckpt.compare import DEFAULT_OUTPUT as CKPT_OUTPUT, compare_checkpoints

        output = args.output or CKPT_OUTPUT
        result = compare_checkpoints(bench, cmp, output, mapping=args.name_mapping,
                                     progress=not args.quiet and sys.stderr.isatty())
        differing = sum(1 for v in result.values() if v.get("l2") != 0.0)
        print(f"{len(result)} parameters compared, {differing} differ (or could not be compared); written to {output}")
        return 0
    from msprobe_core.config_check.collect import collect_static
    from msprobe_core.config_check.pack import DEFAULT_PACK, HYPERPARAMETERS

    output = args.output or DEFAULT_PACK
    members = collect_static(args.framework, args.data or [], output)
    doc = members[HYPERPARAMETERS]
    print(f"config_check pack written to {Path(output)}: {len(members['env.json']['process'])} environment "
          f"variables, {len(members['pip.json']['packages'])} packages, {len(doc['normalized'])} normalized "
          f"hyperparameters from {len(args.data or [])} file(s); "
          f"{len(doc['config_check']['unparsed'])} item(s) not parsed")
    return 0

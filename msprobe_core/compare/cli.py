"""``python -m msprobe_core compare -t TARGET -g GOLDEN -o OUT_DIR`` (also ``msprobe-compare``), or with
msprobe's input file ``compare -i compare.json -o OUT_DIR`` (``msprobe_input``); ``--msprobe-columns``
writes the results under msprobe's column names (``msprobe_columns``).

Exit status: 0 when no tensor fails, 1 when the runs diverge (some row is an error), 2 for inputs that
are not comparable dumps (raised as ``DumpInputError`` and printed by ``msprobe_core.cli``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from msprobe_core.compare.thresholds import Thresholds
from msprobe_core.errors import ConfigError

EPILOG = """\
TARGET and GOLDEN may each be a rank folder (step0/rank0), a step folder, or a whole dump_path; with
step folders or dump paths every step and rank is paired (both runs must hold the same ones).
Records pair by name; when one run made extra calls, they align on the sequence of names and parent
modules, and what only one side holds is listed. A MindSpore or MSAdapter dump compares with a PyTorch
dump of the same network: Cells align with Modules by path and class, APIs with their PyTorch
counterparts through a mapping table (extend it with --api-mapping), dtypes by meaning.

verdicts (per tensor; a record takes its worst tensor's):
  tensor dumps:     error   max abs error > MAX_ABS and (cosine < COSINE (ptdbg's rule) or the L2
                            norms differ by more than REL_ERROR relatively (a wrong scale));
                            different shapes; NaN/Inf at different positions
                    warning some of these conditions, or different dtypes
  statistics dumps: error   Max, Min or Norm differs by more than MAX_ABS and by more than
                            REL_ERROR relatively; different shapes; NaN/Inf on one side; md5
                            digests that differ
                    warning any statistic differs by more than MAX_ABS and REL_WARNING relatively
  defaults: COSINE 0.99, MAX_ABS 0.001, REL_ERROR 0.1, REL_WARNING 0.01
The first error in execution order (drilled down to the innermost failing module or API) is named at
the end, with its stack and parent module.

outputs in OUT_DIR: compare_result[_stepN_rankM].csv and .xlsx (errors red, warnings yellow,
unmatched grey), compare_summary.json; with --report compare_report.html. --msprobe-columns names the
columns as msprobe does (NPU Name, Bench Name, NPU Dtype, ..., Cosine, EucDist, MaxAbsErr, ...,
Accuracy Reached or Not / Result, Err_message, NPU_Stack_Info, Data_name).

msprobe's input file (-i compare.json): {"npu_path": TARGET dump.json or folder, "bench_path": GOLDEN,
"stack_path": the npu dump's stack.json (adds the stack column, optional), "is_print_compare_log": true}.
exit status: 0 no error, 1 the runs diverge, 2 unusable input.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the compare options to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    d = Thresholds()
    parser.add_argument("-t", "--target", metavar="TARGET_DUMP",
                        help="dump of the run under test (rank folder, step folder or dump_path)")
    parser.add_argument("-g", "--golden", metavar="GOLDEN_DUMP",
                        help="dump of the trusted run, of the same kind as TARGET_DUMP")
    parser.add_argument("-i", "--input_path", metavar="COMPARE_JSON", default=None,
                        help="msprobe's compare.json instead of -t/-g: npu_path (TARGET), bench_path (GOLDEN), "
                             "stack_path (adds the stack column), is_print_compare_log")
    parser.add_argument("-o", "--output", "--output_path", required=True, metavar="OUT_DIR",
                        help="folder for the results")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes for tensor metrics on large dumps (default: usable CPUs, at most 8)")
    parser.add_argument("--cosine", type=float, default=d.cosine, metavar="COSINE",
                        help=f"cosine similarity below which a tensor may fail (default {d.cosine})")
    parser.add_argument("--max-abs", type=float, default=d.max_abs, metavar="MAX_ABS",
                        help=f"max absolute error above which a tensor may fail (default {d.max_abs})")
    parser.add_argument("--rel-error", type=float, default=d.rel_error, metavar="REL_ERROR",
                        help=f"relative difference of norms (or of Max/Min/Norm) that fails (default {d.rel_error})")
    parser.add_argument("--rel-warning", type=float, default=d.rel_warning, metavar="REL_WARNING",
                        help=f"relative difference of a statistic that warns (default {d.rel_warning})")
    parser.add_argument("-s", "--stack", "--stack_mode", action="store_true",
                        help="add each record's stack to the CSV/xlsx")
    parser.add_argument("--msprobe-columns", action="store_true",
                        help="write the CSV/xlsx under msprobe's column names (NPU Name, Bench Name, ..., "
                             "MaxAbsErr, Accuracy Reached or Not, Err_message) for scripts that read msprobe's "
                             "result files")
    parser.add_argument("--no-xlsx", action="store_true", help="write only the CSV")
    parser.add_argument("--api-mapping", metavar="FILE", default=None,
                        help="YAML entries added to the shipped MindSpore-to-PyTorch mapping (sections api, cell, "
                             "parameter; see msprobe_core/compare/ms_to_pt_mapping.yaml) for comparing a "
                             "MindSpore or MSAdapter dump with a PyTorch dump")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar; one line per rank pair and the first divergence")
    parser.add_argument("--report", action="store_true",
                        help="also write OUT_DIR/compare_report.html (both trees, first divergence highlighted)")


def _inputs(args: argparse.Namespace) -> tuple[str, str, bool, bool]:
    """``(target, golden, with_stack, quiet)`` from -t/-g or from msprobe's compare.json (-i)."""
    if args.input_path is None:
        if not args.target or not args.golden:
            raise ConfigError("target/golden", [args.target, args.golden],
                              "both -t TARGET_DUMP and -g GOLDEN_DUMP, or -i compare.json")
        return args.target, args.golden, args.stack, args.quiet
    if args.target or args.golden:
        raise ConfigError("input_path", args.input_path, "either -i compare.json or -t/-g, not both")
    from msprobe_core.compare.msprobe_input import load_compare_input

    spec = load_compare_input(args.input_path)
    return (str(spec.target), str(spec.golden), args.stack or spec.stack_path is not None,
            args.quiet or not spec.print_log)


def run(args: argparse.Namespace) -> int:
    """Run the comparison; 0 when the runs agree, 1 when they diverge."""
    from msprobe_core.compare.engine import PairResult, compare_dumps
    from msprobe_core.compare.report import summary_text, write_pair_outputs, write_summary

    thresholds = Thresholds(cosine=args.cosine, max_abs=args.max_abs, rel_error=args.rel_error,
                            rel_warning=args.rel_warning)
    output = Path(args.output)
    target, golden, with_stack, quiet = _inputs(args)

    def write(pair: PairResult, total: int) -> None:
        write_pair_outputs(pair, output, single=total == 1, xlsx=not args.no_xlsx, with_stack=with_stack,
                           msprobe_columns=args.msprobe_columns)

    result = compare_dumps(target, golden, thresholds=thresholds, workers=args.workers,
                           progress=not quiet and sys.stderr.isatty(), on_pair=write, keep_rows=False,
                           api_mapping=args.api_mapping)
    write_summary(result, output)
    print(summary_text(result, quiet=quiet))
    return 1 if result.has_errors else 0

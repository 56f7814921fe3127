"""``python -m msprobe_core compare -t TARGET -g GOLDEN -o OUT_DIR`` (also ``msprobe-compare``).

Exit status: 0 when no tensor fails, 1 when the runs diverge (some row is an error), 2 for inputs that
are not comparable dumps (raised as ``DumpInputError`` and printed by ``msprobe_core.cli``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from msprobe_core.compare.thresholds import Thresholds

EPILOG = """\
TARGET and GOLDEN may each be a rank folder (step0/rank0), a step folder, or a whole dump_path; with
step folders or dump paths every step and rank is paired (both runs must hold the same ones).
Records pair by name; when one run made extra calls, they align on the sequence of names and parent
modules, and what only one side holds is listed.

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
unmatched grey), compare_summary.json.
exit status: 0 no error, 1 the runs diverge, 2 unusable input.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the compare options to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    d = Thresholds()
    parser.add_argument("-t", "--target", required=True, metavar="TARGET_DUMP",
                        help="dump of the run under test (rank folder, step folder or dump_path)")
    parser.add_argument("-g", "--golden", required=True, metavar="GOLDEN_DUMP",
                        help="dump of the trusted run, of the same kind as TARGET_DUMP")
    parser.add_argument("-o", "--output", required=True, metavar="OUT_DIR", help="folder for the results")
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
    parser.add_argument("--stack", action="store_true", help="add each record's stack to the CSV/xlsx")
    parser.add_argument("--no-xlsx", action="store_true", help="write only the CSV")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar; one line per rank pair and the first divergence")


def run(args: argparse.Namespace) -> int:
    """Run the comparison; 0 when the runs agree, 1 when they diverge."""
    from msprobe_core.compare.engine import PairResult, compare_dumps
    from msprobe_core.compare.report import summary_text, write_pair_outputs, write_summary

    thresholds = Thresholds(cosine=args.cosine, max_abs=args.max_abs, rel_error=args.rel_error,
                            rel_warning=args.rel_warning)
    output = Path(args.output)

    def write(pair: PairResult, total: int) -> None:
        write_pair_outputs(pair, output, single=total == 1, xlsx=not args.no_xlsx, with_stack=args.stack)

    result = compare_dumps(args.target, args.golden, thresholds=thresholds, workers=args.workers,
                           progress=not args.quiet and sys.stderr.isatty(), on_pair=write, keep_rows=False)
    write_summary(result, output)
    print(summary_text(result, quiet=args.quiet))
    return 1 if result.has_errors else 0

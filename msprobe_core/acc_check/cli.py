"""``python -m msprobe_core acc_check -api_info DUMP_JSON [-o OUT] [-csv_path RESULT_CSV] [-save_error_data]``.

Seed 002's flags, single-dash long options included (``-api_info``/``--api_info_file``, ``-o``/``--out_path``,
``-csv_path``/``--result_csv_path``, ``-save_error_data``).
"""

from __future__ import annotations

import argparse

EPILOG = """\
Replays every API call of an L1 or mix dump on the tested device (CUDA/NPU when present, else the CPU)
in its recorded dtype, forward and backward, against a float64 CPU benchmark. Tensor dumps
(task "tensor") replay the recorded tensors; statistics dumps replay seeded random inputs matching
each tensor's dtype, shape and Max/Min.

pass rule (per compared output):
  float32 and others  cosine > 0.99 and MaxAbsErr < 0.0001 (seed 002)
  float16, bfloat16   RMSE <= 2x and MaxAbsErr <= 4x those of the same call computed in that dtype by
                      a trusted reference (every operation in float32, its result rounded to the
                      dtype), and cosine > 0.99; see msprobe_core/acc_check/standards.py

outputs in OUT: accuracy_checking_result_{timestamp}.csv (one row per API call: pass, error, or skip
with the reason it cannot be replayed) and accuracy_checking_details_{timestamp}.csv (one row per
output and input gradient); with -save_error_data the failing calls' inputs and both outputs go to
OUT/error_data/{timestamp}/. An interrupted run resumes with -csv_path (appends, skips what is done).
"""


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options acc_check and multi_acc_check share."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("-api_info", "--api_info_file", dest="api_info_file", required=True, metavar="DUMP_JSON",
                        help="dump.json of an L1 or mix dump (or the rank folder holding it)")
    parser.add_argument("-o", "--out_path", dest="out_path", default="./", metavar="OUT",
                        help="folder for the result CSV files (default: ./)")
    parser.add_argument("-csv_path", "--result_csv_path", dest="result_csv_path", default=None, metavar="RESULT_CSV",
                        help="accuracy_checking_result_{timestamp}.csv of an interrupted run: append to it (and its "
                             "details file, in their folder; -o is not used) and skip the API calls it lists")
    parser.add_argument("-save_error_data", "--save_error_data", dest="save_error_data", action="store_true",
                        help="save the inputs and both outputs of failing calls under OUT/error_data/")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the acc_check options to ``parser``."""
    add_common_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the check; 0 once every call is checked (failing APIs are results, not a failure of the command)."""
    from msprobe_core.acc_check.runner import acc_check

    summary = acc_check(args.api_info_file, args.out_path, args.result_csv_path, args.save_error_data)
    print(summary.text())
    return 0

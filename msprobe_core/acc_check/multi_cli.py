"""``python -m msprobe_core multi_acc_check -api_info DUMP_JSON [-d 0 1 ...] [-o OUT] [-csv_path RESULT_CSV]
[-save_error_data]``: acc_check with the API calls split over one worker process per device."""

from __future__ import annotations

import argparse

from msprobe_core.acc_check.cli import add_common_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the multi_acc_check options to ``parser``."""
    add_common_arguments(parser)
    parser.add_argument("-d", "--device", dest="device_id", type=int, nargs="+", default=[0], metavar="ID",
                        help="devices to run on, one worker process each (default: 0); without an accelerator "
                             "each ID is a CPU worker process sharing the CPUs")


def run(args: argparse.Namespace) -> int:
    """Run the workers; 0 when every worker finished, 1 when one died (rerun with -csv_path to finish)."""
    from msprobe_core.acc_check.fork_server import start_early

    start_early(args.api_info_file)  # the framework's import in the fork server overlaps the imports below
    from msprobe_core.acc_check.workers import multi_acc_check

    result = multi_acc_check(args.api_info_file, args.device_id, args.out_path, args.result_csv_path,
                             args.save_error_data)
    print(result.text())
    return 0 if result.complete else 1

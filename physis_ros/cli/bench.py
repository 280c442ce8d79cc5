"""``physis-bench SUBCOMMAND``: benchmarks that write JSON (and plots).

Each subcommand lives in ``physis_ros.bench.<name>`` and provides
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "pipeline": "stage pipeline vs the sequential/step/block baselines",
    "timeshare": "time-sharing: batching off vs on vs adaptive, planner prediction",
    "soak": "two streams for minutes: memory, lost chunks, interval drift",
    "streams": "joint scheduling live: admit tiny-wam streams onto local workers until one is rejected",
    "ros": "ROS layer: emit -> subscriber delay and lost chunks through the real node",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, help_text in SUBCOMMANDS.items():
        module = importlib.import_module(f"physis_ros.bench.{name}")
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())

"""``physis-report``: bags/report.py as a command, the latency report of a recorded run (a bag with the server's
/telemetry).

    physis-report BAG --out DIR [--slo-ms 100] [--topic /telemetry]

Prints a summary table (per stream and all) and writes DIR/summary.md,
DIR/summary.json and PNG plots: interval.png, latency.png, stages.png,
observation_age.png, control.png (seam jumps, inference delay and late points,
tracking error over time) and executed.png (the command the robot executed, chunk
by chunk on the control timeline, vs the expert's where the bag holds
expert_actions). Record a run with ``physis-bag record`` (or keep the
outputs of ``physis-bag check --out DIR``).

Exit status: 0 report written; 2 usage or input error (bad flag or value, missing
--out; bag missing, empty, truncated, corrupt or without telemetry; --out not
writable); 70 internal error (a bug; PHYSIS_DEBUG=1 shows the traceback); 130
interrupted. Errors are one line on stderr: 'physis-report: error: <what and the fix>'.
"""

from __future__ import annotations

import sys
from pathlib import Path

from physis_ros.console import ArgumentParser, CliError, cli_main, positive_float


@cli_main("physis-report")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="physis-report", description=__doc__)
    parser.add_argument("bag", help="rosbag2 directory (or .mcap/.db3 file) with the server's telemetry")
    parser.add_argument("--out", required=True, help="directory for summary.md, summary.json and the PNGs")
    parser.add_argument("--topic", default="/telemetry", help="telemetry topic (default /telemetry)")
    parser.add_argument("--slo-ms", type=positive_float, help="draw this output-interval SLO on the interval plot")
    parser.add_argument("--title", help="plot title (default: bag name and counts)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file; give a directory for the report")
    from physis_ros.bags.bagio import bag_info
    from physis_ros.bags.report import summary_table, write_report

    bag_info(args.bag)  # a missing, empty, truncated or corrupt bag: BagError, one line, before plotting starts
    summary = write_report(args.bag, args.out, topic=args.topic, slo_ms=args.slo_ms, title=args.title)
    print(summary_table(summary))
    print(f"wrote {args.out}/summary.md, summary.json, interval.png, latency.png, stages.png, "
          f"observation_age.png, control.png, executed.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``physis-report``: latency report of a recorded run (a bag with the server's /telemetry).

    physis-report BAG --out DIR [--slo-ms 100] [--topic /telemetry]

Prints a summary table (per stream and all) and writes DIR/summary.md,
DIR/summary.json and PNG plots: interval.png, latency.png, stages.png,
observation_age.png. Record a run with ``physis-bag record`` (or keep the
outputs of ``physis-bag check --out DIR``). Exit 2 if the bag is missing,
unreadable or has no telemetry.
"""

from __future__ import annotations

import argparse
import sys

from physis_ros.bags.bagio import BagError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bag", help="rosbag2 directory (or .mcap/.db3 file) with the server's telemetry")
    parser.add_argument("--out", required=True, help="directory for summary.md, summary.json and the PNGs")
    parser.add_argument("--topic", default="/telemetry", help="telemetry topic (default /telemetry)")
    parser.add_argument("--slo-ms", type=float, help="draw this output-interval SLO on the interval plot")
    parser.add_argument("--title", help="plot title (default: bag name and counts)")
    args = parser.parse_args(argv)
    from physis_ros.bags.report import summary_table, write_report
    try:
        summary = write_report(args.bag, args.out, topic=args.topic, slo_ms=args.slo_ms, title=args.title)
    except BagError as exc:
        print(f"physis-report: error: {exc}", file=sys.stderr)
        return 2
    print(summary_table(summary))
    print(f"wrote {args.out}/summary.md, summary.json, interval.png, latency.png, stages.png, "
          f"observation_age.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``physis-keys DIR [--client NAME]``: CurveZMQ keys for engine and workers on other hosts.

Creates DIR/server.key(_secret) once, DIR/NAME.key(_secret) for a client and
copies its public key to DIR/authorized/. Copy DIR to every host (secret
files are mode 600) and set ``curve_keys: DIR`` (engine) / ``--curve-keys DIR``
(physis-worker).
"""

from __future__ import annotations

import argparse
import sys

from physis_ros.runtime.security import generate_keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-keys", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--client", default="client", help="name of the client key pair to add")
    args = parser.parse_args(argv)
    d = generate_keys(args.directory, args.client)
    print(f"keys in {d}: server.key, {args.client}.key (+ _secret), authorized/{args.client}.key")
    return 0


if __name__ == "__main__":
    sys.exit(main())

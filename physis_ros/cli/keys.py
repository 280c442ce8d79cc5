"""``physis-keys DIR [--client NAME]``: CurveZMQ keys for engine and workers on other hosts.

Creates DIR/server.key(_secret) once, DIR/NAME.key(_secret) for a client and
copies its public key to DIR/authorized/. Copy DIR to every host (secret
files are mode 600) and set ``curve_keys: DIR`` (engine) / ``--curve-keys DIR``
(physis-worker). Key files already in DIR are kept, after checking that they load.

Exit status: 0 keys in place; 2 usage or input error (missing DIR, DIR is a file
or not writable, a key file already in DIR is corrupt, bad --client name);
70 internal error (a bug; PHYSIS_DEBUG=1 shows the traceback). Errors are one
line on stderr: 'physis-keys: error: <what and the fix>'.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from physis_ros.console import ArgumentParser, CliError, cli_main


def _client_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", text) or text == "server":
        raise ValueError(text)
    return text


_client_name.__name__ = "client name (letters, digits, _ . -; not 'server')"


def check_existing(directory: Path, client: str) -> None:
    """Key files already in ``directory`` must load; a corrupt one is reported, never overwritten."""
    import zmq.auth

    for name in ("server", client):
        for suffix in (".key", ".key_secret"):
            path = directory / f"{name}{suffix}"
            if not path.exists():
                continue
            try:
                public, secret = zmq.auth.load_certificate(str(path))
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                raise CliError(f"{path} is not a readable CurveZMQ key ({type(exc).__name__}: {exc}); move it "
                               f"away and run physis-keys again (then copy {directory} to every host)") from None
            if suffix == ".key_secret" and not secret:
                raise CliError(f"{path} holds no secret key; move it away and run physis-keys again")


@cli_main("physis-keys")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="physis-keys", description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--client", type=_client_name, default="client", help="name of the client key pair to add")
    args = parser.parse_args(argv)
    d = Path(args.directory)
    if d.exists() and not d.is_dir():
        raise CliError(f"{d} exists and is not a directory; give a new or an existing key directory")
    for part in (d / "authorized", d):
        if part.exists() and not part.is_dir():
            raise CliError(f"{part} exists and is not a directory; move it away or give another key directory")
    if d.is_dir():
        check_existing(d, args.client)
    from physis_ros.runtime.security import generate_keys

    d = generate_keys(d, args.client)
    print(f"keys in {d}: server.key, {args.client}.key (+ _secret), authorized/{args.client}.key")
    return 0


if __name__ == "__main__":
    sys.exit(main())

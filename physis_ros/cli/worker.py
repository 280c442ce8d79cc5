"""``physis-worker``: runtime/worker.py as a command, one worker process (one device).

The engine starts local workers itself; start one by hand on another host
with ``physis-worker --connect tcp://ENGINE:PORT --id wN --bind-host THIS_HOST
--curve-keys DIR``.

Exit status: 0 stopped cleanly; 2 usage or input error (bad flag or value, missing
--connect, bad address, unreadable or corrupt --curve-keys directory, non-loopback
--bind-host without keys); 70 internal error (a bug; PHYSIS_DEBUG=1 shows the
traceback); 130 interrupted. Errors are one line on stderr:
'physis-worker: error: <what and the fix>'.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

from physis_ros.console import ArgumentParser, check_keys_dir, cli_main, device_arg, positive_int

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Linux: get SIGTERM when the process that started us dies, so a crashed engine leaves no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise ValueError(text)
    return level


_level.__name__ = "log level"


@cli_main("physis-worker")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="physis-worker", description=__doc__)
    parser.add_argument("--connect", required=True, help="engine control address, e.g. tcp://10.0.0.2:5555")
    parser.add_argument("--id", default=f"w-{os.getpid()}", help="worker name (unique per engine)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda:N")
    parser.add_argument("--bind-host", default="127.0.0.1",
                        help="interface for this worker's data socket (loopback unless told otherwise)")
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    parser.add_argument("--ipc-dir", default=None)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--curve-keys", default=None,
                        help="physis-keys directory: CurveZMQ on every socket (required off loopback)")
    parser.add_argument("--max-message-mb", type=positive_int, default=256)
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit when this process (the engine that started us) exits")
    parser.add_argument("--log-level", type=_level, default="INFO", help="least level logged (and sent to the engine)")
    parser.add_argument("--no-log-stderr", action="store_true",
                        help="log only through the engine (what the engine uses for the workers it spawns)")
    args = parser.parse_args(argv)
    if not args.connect.startswith(("tcp://", "ipc://")):
        parser.error(f"--connect wants the engine's control address, e.g. tcp://10.0.0.2:5555, got '{args.connect}'")
    if args.curve_keys:
        check_keys_dir(args.curve_keys, "--curve-keys")
    import torch
    import zmq

    from physis_ros.runtime.security import is_loopback
    from physis_ros.runtime.worker import Worker

    if args.parent_pid:
        die_with_parent(args.parent_pid)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.getLogger("physis").setLevel(args.log_level)
    if not args.no_log_stderr:
        logging.basicConfig(format=f"[worker {args.id}] %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.transport == "tcp" and not is_loopback(args.bind_host) and not args.curve_keys:
        parser.error(f"--bind-host {args.bind_host} is not loopback: give --curve-keys DIR (see physis-keys)")
    try:
        worker = Worker(args.connect, args.id, device=args.device, bind_host=args.bind_host,
                        transport=args.transport, ipc_dir=args.ipc_dir, curve_keys=args.curve_keys,
                        max_message_bytes=args.max_message_mb * 1024 * 1024)
    except (ValueError, zmq.ZMQError) as exc:
        parser.error(str(exc))
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())

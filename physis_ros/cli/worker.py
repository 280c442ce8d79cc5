"""``physis-worker``: one worker process (one device).

The engine starts local workers itself; start one by hand on another host
with ``physis-worker --connect tcp://ENGINE:PORT --id wN --bind-host THIS_HOST
--curve-keys DIR``.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

import torch
import zmq

from physis_ros.runtime.security import is_loopback
from physis_ros.runtime.worker import Worker

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Linux: get SIGTERM when the process that started us dies, so a crashed engine leaves no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-worker", description="Run one physis_ros worker process.")
    parser.add_argument("--connect", required=True, help="engine control address, e.g. tcp://10.0.0.2:5555")
    parser.add_argument("--id", default=f"w-{os.getpid()}", help="worker name (unique per engine)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument("--bind-host", default="127.0.0.1",
                        help="interface for this worker's data socket (loopback unless told otherwise)")
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    parser.add_argument("--ipc-dir", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--curve-keys", default=None,
                        help="physis-keys directory: CurveZMQ on every socket (required off loopback)")
    parser.add_argument("--max-message-mb", type=int, default=256)
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit when this process (the engine that started us) exits")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=args.log_level, format=f"[worker {args.id}] %(levelname)s %(message)s")
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

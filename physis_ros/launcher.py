"""Child processes for the demo, the benchmark and the tests: the server and the synthetic robot.

Each child runs in a session of its own, so a Ctrl-C in the terminal reaches
only the parent, which then stops the children in order: SIGINT (the server
stops its engine and workers), then SIGTERM, then SIGKILL to the child's whole
process group, so nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


class Child:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None):
        self.name = name
        self.cmd = cmd
        self.log_path = log
        self._log = open(log, "wb") if log is not None else None
        out = self._log if self._log is not None else None
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT if out is not None else None,
                                     start_new_session=True)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float = 20.0) -> int:
        """SIGINT, wait ``timeout``; then SIGTERM / SIGKILL the process group. Returns the exit code."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    print(f"{self.name} (pid {self.pid}) did not stop within {timeout:.0f} s; terminating",
                          file=sys.stderr)
                    self._signal_group(signal.SIGTERM)
                    try:
                        self.proc.wait(5.0)
                    except subprocess.TimeoutExpired:
                        self._signal_group(signal.SIGKILL)
                        self.proc.wait()
            # Anything the child left in its group (its workers, if it was killed) goes too.
            self._signal_group(signal.SIGKILL)
        finally:
            if self._log is not None:
                self._log.close()
        return self.proc.returncode

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # the child's own session: its pid is the group id
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def serve_command(config: str | Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "physis_ros.cli.serve", "--config", str(config), *extra]


def synthetic_command(config: str | Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "physis_ros.cli.synthetic", "--config", str(config), *extra]

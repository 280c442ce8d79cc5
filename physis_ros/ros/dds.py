"""Process settings of the server for large inputs: DDS reader buffers and the C heap.

Measured (tests/ros/test_heavy_inputs.py): after a burst of 1080p and 4K frames the server's
memory stayed 70-160 MB above its baseline with the defaults, because rmw_fastrtps keeps each
reader's sample buffers at the largest size ever received and glibc keeps what is freed in
per-thread arenas. With readers in Fast DDS's DYNAMIC history mode (``config/fastdds.xml``, which
rmw_fastrtps honours only with ``RMW_FASTRTPS_USE_QOS_FROM_XML=1``), one malloc arena, and the
node's ``malloc_trim`` after a burst (:class:`~physis_ros.heap.HeapTrimmer`), it
returns to within 2 MB. Settings the user already made are kept.
"""

from __future__ import annotations

import os
import sys

from physis_ros.config import repo_config_dir


def process_env() -> dict[str, str]:
    """The environment the server process should run with (what is already set is kept)."""
    env = {}
    if "FASTDDS_DEFAULT_PROFILES_FILE" not in os.environ:
        profile = repo_config_dir() / "fastdds.xml"
        if profile.is_file():
            env["FASTDDS_DEFAULT_PROFILES_FILE"] = str(profile)
            if "RMW_FASTRTPS_USE_QOS_FROM_XML" not in os.environ:
                env["RMW_FASTRTPS_USE_QOS_FROM_XML"] = "1"
    if "MALLOC_ARENA_MAX" not in os.environ:
        env["MALLOC_ARENA_MAX"] = "1"  # read by glibc when the process starts, hence the re-exec below
    return env


def reexec_with_process_env() -> None:
    """Run this command again with :func:`process_env` set, once (a command-line entry point only: it
    replaces the process). glibc reads MALLOC_ARENA_MAX at start-up, and a mallopt() made later
    leaves the arenas already created (measured: +24 MB after the burst instead of +0..2)."""
    env = process_env()
    if env and "PHYSIS_PROCESS_ENV" not in os.environ:
        os.environ.update(env, PHYSIS_PROCESS_ENV="1")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

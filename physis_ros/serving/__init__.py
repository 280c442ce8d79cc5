"""The serving application without ROS: streams joining and leaving, admission over the workers, the
models a server can serve, observations in and chunks out. Front ends (the ROS node, benchmarks, an
embedding program) sit on top of it.

- :mod:`~physis_ros.serving.server`: :class:`Server`, the application's API; a stream joined is a
  :class:`Session` (:mod:`~physis_ros.serving.session`) that takes observations and gives chunks.
- :mod:`~physis_ros.serving.tensors`: observations as the model takes them, from plain arrays.
- :mod:`~physis_ros.serving.config`: the serve config (``config/serve.yaml``), validated once; errors name
  the dotted key.
- :mod:`~physis_ros.serving.capacity`: admission over this server's workers and the reasons a stream is
  refused (:class:`Rejected`).
- :mod:`~physis_ros.serving.catalog`: model references resolved to served models with cost profiles.
- :mod:`~physis_ros.serving.fit`: what a stream needs of its model (fit check, control-timeline interval).
- :mod:`~physis_ros.serving.intake`: a stream's observation buffer (latest or deterministic pairing).
- :mod:`~physis_ros.serving.engine_thread`: the engine's loop in a thread of its own.

The names below load on first use, so that reading a config does not start the engine's imports.
"""

from __future__ import annotations

import importlib

_WHERE = {"Server": "server", "ServerEvent": "server", "Session": "session", "Chunk": "session",
          "Rejected": "capacity", "REASONS": "capacity", "InputRejected": "tensors", "ServeConfig": "config",
          "StreamConfig": "config", "load_serve_config": "config"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'physis_ros.serving' has no attribute '{name}'")
    return getattr(importlib.import_module(f"physis_ros.serving.{_WHERE[name]}"), name)

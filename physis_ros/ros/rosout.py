"""The engine's and workers' Python log lines, through the node's logger to /rosout.

The runtime logs with Python's ``logging`` under ``physis.*`` (it knows nothing of ROS); workers
forward their lines to the engine, which logs them as ``physis.worker`` with the worker's name in
front. Inside the node this handler hands every such record to the node's rclpy logger (a child
per source: ``<node>.engine``, ``<node>.worker``), so they reach /rosout and the console like the
node's own lines, INFO included.
"""

from __future__ import annotations

import logging

_CHILD = {"physis.engine": "engine", "physis.worker": "worker"}


class RosoutHandler(logging.Handler):
    def __init__(self, ros_logger, level: int = logging.INFO):
        super().__init__(level)
        self.ros_logger = ros_logger
        self._children = {}

    def _target(self, name: str):
        child = _CHILD.get(name, name.split(".", 1)[-1] or "physis")
        if child not in self._children:
            self._children[child] = self.ros_logger.get_child(child)
        return self._children[child]

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            target = self._target(record.name)
            if record.levelno >= logging.ERROR:
                target.error(text)
            elif record.levelno >= logging.WARNING:
                target.warning(text)
            elif record.levelno >= logging.INFO:
                target.info(text)
            else:
                target.debug(text)
        except Exception:  # logging must never take the engine down
            self.handleError(record)


def attach(ros_logger, level: int = logging.INFO) -> RosoutHandler:
    """Route ``physis.*`` records at ``level`` and above to ``ros_logger``; detach with :func:`detach`."""
    handler = RosoutHandler(ros_logger, level)
    root = logging.getLogger("physis")
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    return handler


def detach(handler: RosoutHandler) -> None:
    logging.getLogger("physis").removeHandler(handler)

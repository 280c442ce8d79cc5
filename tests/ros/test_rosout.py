"""The runtime's Python log lines (physis.*) through the node's rclpy logger: each source to a child
logger of the node, at its own level, INFO included; detach stops it. (The live check that they reach
/rosout is in test_lifecycle.py.)"""

from __future__ import annotations

import logging

from physis_ros.ros import rosout


class FakeRosLogger:
    def __init__(self, name="physis_server", sink=None):
        self.name, self.sink = name, [] if sink is None else sink

    def get_child(self, child):
        return FakeRosLogger(f"{self.name}.{child}", self.sink)

    def __getattr__(self, level):
        if level in ("debug", "info", "warning", "error"):
            return lambda text: self.sink.append((self.name, level, text))
        raise AttributeError(level)


def test_physis_records_go_to_child_loggers_of_the_node(monkeypatch):
    physis = logging.getLogger("physis")
    monkeypatch.setattr(physis, "level", logging.NOTSET)
    ros = FakeRosLogger()
    handler = rosout.attach(ros)
    try:
        assert physis.level == logging.INFO   # engine INFO lines are not lost to the WARNING default
        logging.getLogger("physis.engine").info("engine started: %d worker(s)", 2)
        logging.getLogger("physis.worker").warning("[w0] hop failed")
        logging.getLogger("physis.hops").error("ring full")
        logging.getLogger("physis.engine").debug("below INFO: not sent")
        assert ros.sink == [("physis_server.engine", "info", "engine started: 2 worker(s)"),
                            ("physis_server.worker", "warning", "[w0] hop failed"),
                            ("physis_server.hops", "error", "ring full")]
    finally:
        rosout.detach(handler)
    assert handler not in physis.handlers
    logging.getLogger("physis.engine").warning("after detach")
    assert len(ros.sink) == 3

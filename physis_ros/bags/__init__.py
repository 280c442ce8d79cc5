"""Rosbag2 tooling without rosbag2: generate, replay, record, check and report.

rosbag2 itself is not installable here, so bags are read and written with the
pure-Python ``rosbags`` library (mcap or sqlite3 storage, real rosbag2 files)
and published or subscribed with rclpy as raw CDR bytes, never deserialized
on the hot path.

- :mod:`~physis_ros.bags.bagio`: opening bags with clear errors, the typestore
  (ROS 2 Kilted + this package's ``msg/``), QoS by type, an independent mcap read.
- :mod:`~physis_ros.bags.serveconf`: a serve config's streams as the tools see them, each by its
  model's kind (world-action model: camera + joints in, action chunks out; world model: camera +
  joints + actions in, predicted frames out), topics and message types.
- :mod:`~physis_ros.bags.scene`: the bundled scene bag (two 7-DoF arms + cameras; a world model's
  actions to imagine when a config asks for them).
- :mod:`~physis_ros.bags.replay` / :mod:`~physis_ros.bags.record`: ``physis-bag replay|record``.
- :mod:`~physis_ros.bags.analysis` / :mod:`~physis_ros.bags.check`: the deterministic
  replay harness (``physis-bag check``).
- :mod:`~physis_ros.bags.report`: ``physis-report`` (summary table + plots).
"""

from physis_ros.bags.bagio import BagError

__all__ = ["BagError"]

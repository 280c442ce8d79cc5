"""Physis ROS 2 integration: chunked action streaming for robot policies."""

__version__ = "0.1.0"

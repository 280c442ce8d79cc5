"""ROS 2 front end: the ``physis_server`` node, message conversion, config, diagnostics.

- :mod:`~physis_ros.ros.config`: ServeConfig (``config/serve.yaml``), errors name the key.
- :mod:`~physis_ros.ros.conversions`: Image/JointState -> model tensors (``observation_from_msgs``),
  chunk -> ActionChunk / JointTrajectory / ChunkTelemetry. Pure functions.
- :mod:`~physis_ros.ros.inputs`: per-stream observation buffer (latest or deterministic pairing).
- :mod:`~physis_ros.ros.node`: the node (a lifecycle node); :mod:`~physis_ros.ros.engine_thread`: the
  engine beside it; :mod:`~physis_ros.ros.parameters`: the config as declared, described ROS parameters.
- :mod:`~physis_ros.ros.diagnostics` (pure verdicts) and :mod:`~physis_ros.ros.health` (gathering),
  :mod:`~physis_ros.ros.qos`, :mod:`~physis_ros.ros.synthetic`.
"""

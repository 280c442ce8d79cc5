"""ROS 2 front end: the ``physis_server`` node, message conversion, parameters, diagnostics. The serving
application it fronts (config, admission, models, observation buffers, the engine thread) is
:mod:`physis_ros.serving`.

- :mod:`~physis_ros.ros.conversions`: Image/JointState -> model tensors (``observation_from_msgs``),
  chunk -> ActionChunk / JointTrajectory / ChunkTelemetry. Pure functions.
- :mod:`~physis_ros.ros.node`: the node (a lifecycle node); :mod:`~physis_ros.ros.parameters`: the config as declared, described ROS parameters.
- :mod:`~physis_ros.ros.diagnostics`: gathers /diagnostics and publishes the serving core's verdicts
  (:mod:`physis_ros.serving.health`); :mod:`~physis_ros.ros.qos`.
"""

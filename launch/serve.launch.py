"""Launch the physis_server action server (ROS 2 distributions with launch_ros).

    ros2 launch physis_ros serve.launch.py
    ros2 launch physis_ros serve.launch.py config:=/path/serve.yaml model:=tiny-wam workers:=2

The config file (default: the package's config/serve.yaml) is a ROS 2
parameters file and is handed to the node as its parameters. Each stream in it
has its own namespace (one per robot: /robot0/..., /robot1/...), so a single
server node serves all robots; `namespace:=` additionally pushes the server
and all its topics under one namespace. `model:=` / `workers:=` override the
file ('' / 0: keep the file's values). Without launch_ros (pip-based setup),
`physis-serve --config config/serve.yaml` runs the same node.

physis_server is a lifecycle node: `autostart:=true` (the default) configures and activates it at
once; `autostart:=false` leaves it unconfigured for a lifecycle manager (`ros2 lifecycle set
/physis_server configure`, then `activate`; `deactivate` disarms the outputs). `trajectory_topic:=`
sends the JointTrajectory of a single-stream config to a controller's topic, e.g.
`trajectory_topic:=/arm_controller/joint_trajectory` (several streams: set
streams.<name>.topics.joint_trajectory in the config).
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare


def generate_launch_description():
    default_config = PathJoinSubstitution([FindPackageShare("physis_ros"), "config", "serve.yaml"])
    config = LaunchConfiguration("config")
    return LaunchDescription([
        DeclareLaunchArgument("config", default_value=default_config,
                              description="serve YAML (ROS 2 parameters file with the streams, one per robot)"),
        DeclareLaunchArgument("model", default_value="",
                              description="model preset or YAML path (empty: from the config)"),
        DeclareLaunchArgument("workers", default_value="0",
                              description="local worker processes (0: from the config)"),
        DeclareLaunchArgument("namespace", default_value="",
                              description="namespace for the server node and all its topics"),
        DeclareLaunchArgument("use_sim_time", default_value="false",
                              description="stamp from /clock (bag replay with simulated time)"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="configure and activate the lifecycle node at start (false: wait for "
                                          "lifecycle transitions)"),
        DeclareLaunchArgument("trajectory_topic", default_value="",
                              description="JointTrajectory topic of a single-stream config, e.g. "
                                          "/arm_controller/joint_trajectory (empty: from the config)"),
        Node(
            package="physis_ros",
            executable="physis-serve",
            name="physis_server",
            namespace=LaunchConfiguration("namespace"),
            parameters=[config, {"use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"),
                                                                value_type=bool)}],
            arguments=["--model", LaunchConfiguration("model"), "--workers", LaunchConfiguration("workers"),
                       "--autostart", LaunchConfiguration("autostart"),
                       "--trajectory-topic", LaunchConfiguration("trajectory_topic")],
            output="screen",
            emulate_tty=True,
        ),
    ])

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
        Node(
            package="physis_ros",
            executable="physis-serve",
            name="physis_server",
            namespace=LaunchConfiguration("namespace"),
            parameters=[config, {"use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"),
                                                                value_type=bool)}],
            arguments=["--model", LaunchConfiguration("model"), "--workers", LaunchConfiguration("workers")],
            output="screen",
            emulate_tty=True,
        ),
    ])

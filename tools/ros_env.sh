# Source this after `make setup` to use the venv's ROS 2 (pip-installed Kilted) from this shell:
# colcon finds ament and the rosidl generators, ros2-aware tools find the install space.
#   . tools/ros_env.sh        (bash or zsh; from anywhere)
_physis_root="$(cd "$(dirname "${BASH_SOURCE[0]:-${(%):-%x}}")/.." && pwd)"
if [ ! -x "$_physis_root/.venv/bin/python" ]; then
    echo "tools/ros_env.sh: no venv at $_physis_root/.venv: run 'make setup' first" >&2
else
    export VIRTUAL_ENV="$_physis_root/.venv"
    export PATH="$VIRTUAL_ENV/bin:$PATH"
    export AMENT_PREFIX_PATH="$VIRTUAL_ENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
    export CMAKE_PREFIX_PATH="$VIRTUAL_ENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
fi
unset _physis_root

"""pip packaging of physis_ros.

The Python dependencies that are not ROS are listed here.  torch and the ROS 2
wheels (rclpy, message packages, rosidl build tools) are pinned in
requirements.txt and installed by `make setup`, which also generates the
message code (physis_ros/msg, see tools/build_msgs.sh).  A colcon build uses
CMakeLists.txt instead and ignores this file.
"""

from glob import glob
import os

from setuptools import find_packages, setup

MODEL_FAMILIES = """
wam=physis_ros.model.dit_family:WAM
acwm=physis_ros.model.dit_family:ACWM
wan=physis_ros.model.wan_family:WAN
wan_wam=physis_ros.model.wan_family:WAN_WAM
wan_acwm=physis_ros.model.wan_family:WAN_ACWM
"""

PACKAGE = "physis_ros"
HERE = os.path.dirname(os.path.abspath(__file__))


def _files(pattern):
    return sorted(
        os.path.relpath(p, HERE)
        for p in glob(os.path.join(HERE, pattern))
        if os.path.isfile(p) and not os.path.basename(p).startswith(".")
    )


def _data_files():
    share = os.path.join("share", PACKAGE)
    entries = [
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (share, ["package.xml"]),
        (os.path.join(share, "launch"), _files("launch/*")),
        (os.path.join(share, "config"), _files("config/*.yaml")),
        (os.path.join(share, "config", "models"), _files("config/models/*.yaml")),
        (os.path.join(share, "config", "profiles"), _files("config/profiles/*.json")),
        (os.path.join(share, "config", "checkpoints"), _files("config/checkpoints/*")),
    ]
    # checkpoint directories (a Wan model's transformer/, vae/, adapter and physis_model.yaml), every level
    for root, _dirs, _names in sorted(os.walk(os.path.join(HERE, "config", "checkpoints"))):
        rel = os.path.relpath(root, HERE)
        if rel != os.path.join("config", "checkpoints"):
            entries.append((os.path.join(share, rel), _files(os.path.join(rel, "*"))))
    return [(dest, files) for dest, files in entries if files]


setup(
    name=PACKAGE,
    version="0.1.0",
    description="Physis ROS 2 integration: chunked action streaming for robot policies",
    license="Apache-2.0",
    maintainer="Physis Team",
    maintainer_email="physis-team@physis-robotics.org",
    python_requires=">=3.10",
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    # Generated message code (physis_ros/msg, type support extension modules)
    # is included when present so that a regular (non-editable) wheel works
    # too, provided tools/build_msgs.sh ran first.
    package_data={PACKAGE: ["*.so"], f"{PACKAGE}.msg": ["*.py"], f"{PACKAGE}.srv": ["*.py"],
                  f"{PACKAGE}.action": ["*.py"]},
    include_package_data=False,
    data_files=_data_files(),
    install_requires=[
        "numpy",
        "pyzmq",
        "msgpack",
        "pyyaml",
        "safetensors",
    ],
    zip_safe=False,
    entry_points={
        "console_scripts": [
            "physis-rollout=physis_ros.cli.rollout:main",
            "physis-sim=physis_ros.cli.sim:main",
            "physis-worker=physis_ros.cli.worker:main",
            "physis-bench=physis_ros.cli.bench:main",
            "physis-profile=physis_ros.cli.profile:main",
            "physis-keys=physis_ros.cli.keys:main",
            "physis-bag=physis_ros.cli.bag:main",
            "physis-report=physis_ros.cli.report:main",
            "physis-serve=physis_ros.cli.serve:main",
            "physis-demo=physis_ros.cli.demo:main",
            "physis-synthetic=physis_ros.cli.synthetic:main",
            "physis-stream=physis_ros.cli.stream:main",
            "physis-train=physis_ros.cli.train:main",
        ],
        # Model families (physis_ros/model/families.py). Written unquoted, one per line: CMakeLists.txt reads
        # every quoted "name=module:attr" line of this file as a console script.
        "physis_ros.models": MODEL_FAMILIES.split(),
    },
)

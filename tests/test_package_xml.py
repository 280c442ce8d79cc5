"""package.xml declares every ROS package the code and the interfaces use (offline: no rosdep, no ROS).

Every ROS message/interface package imported by the Python sources under physis_ros/ (``from X_msgs ...``,
``import X_interfaces``; rclpy.lifecycle needs lifecycle_msgs) is a <depend> or <exec_depend>, and every
package an interface file (msg/, srv/, action/) uses is a <depend> (needed at build and run time).
Code rosidl generates into physis_ros/ (msg/, srv/, action/: git-ignored) is not ours and is skipped:
its imports (service_msgs, unique_identifier_msgs) come with action_msgs and rosidl_default_runtime.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][A-Za-z0-9_]*(?:_msgs|_interfaces))\b", re.M)
FIELD = re.compile(r"^\s*([a-z][a-z0-9_]*)/[A-Z][A-Za-z0-9]*", re.M)
GENERATED = "# generated from rosidl_generator_py"


def declared() -> dict[str, set[str]]:
    root = ET.parse(REPO / "package.xml").getroot()
    out: dict[str, set[str]] = {}
    for tag in ("depend", "exec_depend", "build_depend", "test_depend"):
        out[tag] = {el.text.strip() for el in root.findall(tag) if el.text}
    return out


def imported_by_sources() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "physis_ros").rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.startswith(GENERATED):
            continue
        rel = str(path.relative_to(REPO))
        for pkg in IMPORT.findall(text):
            found.setdefault(pkg, []).append(rel)
        if re.search(r"^\s*from rclpy\.lifecycle import|^\s*import rclpy\.lifecycle", text, re.M):
            found.setdefault("lifecycle_msgs", []).append(rel)
    return found


def used_by_interfaces() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder, ext in (("msg", "msg"), ("srv", "srv"), ("action", "action")):
        for path in sorted((REPO / folder).glob(f"*.{ext}")):
            for pkg in FIELD.findall(path.read_text()):
                found.setdefault(pkg, []).append(str(path.relative_to(REPO)))
            if ext == "action":
                found.setdefault("action_msgs", []).append(str(path.relative_to(REPO)))
    return found


def test_the_scan_finds_what_the_sources_are_known_to_import():
    """Guards the regexes: a scan that found nothing would pass the tests below vacuously."""
    srcs = imported_by_sources()
    assert {"trajectory_msgs", "sensor_msgs", "diagnostic_msgs", "rosgraph_msgs", "lifecycle_msgs"} <= set(srcs)
    assert {"std_msgs", "builtin_interfaces", "action_msgs"} <= set(used_by_interfaces())


def test_every_imported_message_package_is_a_run_dependency():
    deps = declared()
    run = deps["depend"] | deps["exec_depend"]
    missing = {pkg: where[:3] for pkg, where in imported_by_sources().items() if pkg not in run}
    assert not missing, f"imported but not a <depend>/<exec_depend> in package.xml: {missing}"


def test_every_package_the_interfaces_use_is_a_depend():
    deps = declared()
    missing = {pkg: where for pkg, where in used_by_interfaces().items()
               if pkg not in deps["depend"] and not (pkg in deps["build_depend"] and pkg in deps["exec_depend"])}
    assert not missing, f"used by msg/srv/action files but not a <depend> in package.xml: {missing}"


def test_run_dependencies_include_the_client_library_and_the_generated_code_runtime():
    deps = declared()
    run = deps["depend"] | deps["exec_depend"]
    assert {"rclpy", "rosidl_default_runtime"} <= run
    assert "rosidl_default_generators" in deps["build_depend"] | deps["depend"]

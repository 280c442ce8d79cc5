#!/usr/bin/env python3
"""Check every dependency key of package.xml against a copy of ros/rosdistro.

    tools/check_rosdep_keys.py ROSDISTRO [--distros humble,jazzy,kilted,rolling]

ROSDISTRO is a checkout of https://github.com/ros/rosdistro, or a bare git
directory of it (files are then read from HEAD). A key passes when it is a
rosdep key of rosdep/python.yaml or rosdep/base.yaml, or a ROS package
released in every distribution given. Exit status 1 when any key fails, so
`rosdep install --from-paths .` would not resolve it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml
from catkin_pkg.package import parse_package

ROOT = Path(__file__).resolve().parents[1]


def _reader(rosdistro: Path):
    if (rosdistro / "rosdep").is_dir():
        return lambda rel: (rosdistro / rel).read_text()

    def git_show(rel):
        return subprocess.run(["git", "-C", str(rosdistro), "show", f"HEAD:{rel}"],
                              capture_output=True, text=True, check=True).stdout
    return git_show


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rosdistro", type=Path)
    ap.add_argument("--distros", default="humble,jazzy,kilted,rolling")
    ap.add_argument("--package-xml", type=Path, default=ROOT / "package.xml")
    args = ap.parse_args(argv)

    read = _reader(args.rosdistro)
    keys: dict = {}
    for rel in ("rosdep/python.yaml", "rosdep/base.yaml"):
        keys.update(yaml.safe_load(read(rel)))
    released: dict[str, set[str]] = {}
    for distro in args.distros.split(","):
        repos = yaml.safe_load(read(f"{distro}/distribution.yaml"))["repositories"]
        names: set[str] = set()
        for repo_name, repo in repos.items():
            release = repo.get("release") or {}
            if release:
                names.update(release.get("packages", [repo_name]))
        released[distro] = names

    pkg = parse_package(str(args.package_xml))
    deps = {d.name for group in (pkg.buildtool_depends, pkg.build_depends, pkg.build_export_depends,
                                 pkg.exec_depends, pkg.test_depends, pkg.doc_depends)
            for d in group}
    bad = 0
    for name in sorted(deps):
        if name in keys:
            rule = keys[name]
            print(f"ok   rosdep key   {name}: ubuntu={rule.get('ubuntu')!r} debian={rule.get('debian')!r}")
            continue
        missing = [d for d, names in released.items() if name not in names]
        if missing:
            bad += 1
            print(f"FAIL {name}: neither a rosdep key nor released in {', '.join(missing)}")
        else:
            print(f"ok   ROS package  {name}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

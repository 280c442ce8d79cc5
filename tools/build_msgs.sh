#!/usr/bin/env bash
# Build the msg/ interfaces of physis_ros with the pip-installed ROS 2 tools
# of a venv and make them importable as `physis_ros.msg` from that venv.
#
#   tools/build_msgs.sh [VENV]        (default: .venv)
#
# Steps:
#   1. cmake configure/build/install (PHYSIS_MSGS_ONLY=ON) into build/msgs,
#      install prefix build/msgs-stage (never straight into the venv: the
#      generated Python package `physis_ros` would shadow our source package).
#   2. Copy the generated Python into the source tree (git-ignored):
#        physis_ros/msg/*.py
#        physis_ros/physis_ros_s__rosidl_typesupport_*.so   (extension modules)
#      The editable install of physis_ros then finds them.
#   3. Copy the C libraries libphysis_ros__*.so into VENV/lib, which the
#      ros-wheels-bootstrapper puts on LD_LIBRARY_PATH (it re-executes Python
#      with LD_LIBRARY_PATH=sys.prefix/lib:... on first import), and the
#      ament index entries, .msg/.idl files and package.xml into VENV/share,
#      plus symlinks VENV/share/physis_ros/{launch,config} -> source tree, so
#      the venv looks like a ROS prefix with physis_ros in it (for
#      AMENT_PREFIX_PATH=VENV).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$(cd "${1:-.venv}" && pwd)"
PY="$VENV/bin/python"
BUILD="$ROOT/build/msgs"
STAGE="$ROOT/build/msgs-stage"
PKG=physis_ros

[ -x "$PY" ] || { echo "build_msgs: no python at $PY" >&2; exit 1; }

# Environment for cmake: the venv is the (only) ament/CMake prefix.  Drop any
# sourced ROS environment so that a half-sourced /opt/ros does not mix in.
export VIRTUAL_ENV="$VENV"
export AMENT_PREFIX_PATH="$VENV"
export CMAKE_PREFIX_PATH="$VENV"
export PATH="$VENV/bin:$PATH"
unset PYTHONPATH COLCON_PREFIX_PATH ROS_DISTRO || true

JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

rm -rf "$STAGE"
mkdir -p "$BUILD"
cmake -S "$ROOT" -B "$BUILD" \
  -DPHYSIS_MSGS_ONLY=ON \
  -DBUILD_TESTING=OFF \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_INSTALL_PREFIX="$STAGE" \
  -DCMAKE_PREFIX_PATH="$VENV" \
  -DPython3_EXECUTABLE="$PY" \
  -DPython3_FIND_VIRTUALENV=ONLY \
  >"$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log" >&2; exit 1; }
cmake --build "$BUILD" -j "$JOBS" >"$BUILD.build.log" 2>&1 \
  || { tail -n 60 "$BUILD.build.log" >&2; exit 1; }
cmake --install "$BUILD" >"$BUILD.install.log" 2>&1 \
  || { cat "$BUILD.install.log" >&2; exit 1; }

PYVER="$("$PY" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')"
GEN="$STAGE/lib/$PYVER/site-packages/$PKG"
[ -f "$GEN/msg/__init__.py" ] || { echo "build_msgs: generated package missing at $GEN" >&2; exit 1; }

# 2. generated Python -> source tree (replace stale copies)
rm -f "$ROOT/$PKG"/${PKG}_s__*.so
for kind in msg srv action; do
  rm -rf "$ROOT/$PKG/$kind"
  if [ -d "$GEN/$kind" ]; then
    mkdir -p "$ROOT/$PKG/$kind"
    cp "$GEN/$kind"/*.py "$ROOT/$PKG/$kind/"
  fi
done
cp "$GEN"/${PKG}_s__*.so "$ROOT/$PKG/"
[ -f "$ROOT/$PKG/__init__.py" ] || { echo "build_msgs: $PKG/__init__.py missing" >&2; exit 1; }

# 3. C libraries and ament index -> venv
rm -f "$VENV"/lib/lib${PKG}__*.so
cp -P "$STAGE"/lib/lib${PKG}__*.so "$VENV/lib/"
for res in "$STAGE"/share/ament_index/resource_index/*/"$PKG"; do
  kind="$(basename "$(dirname "$res")")"
  [ "$kind" = parent_prefix_path ] && continue   # names the stage dir
  mkdir -p "$VENV/share/ament_index/resource_index/$kind"
  cp "$res" "$VENV/share/ament_index/resource_index/$kind/$PKG"
done
mkdir -p "$VENV/share/$PKG"
for kind in msg srv action; do
  rm -rf "$VENV/share/$PKG/$kind"
  if [ -d "$STAGE/share/$PKG/$kind" ]; then cp -r "$STAGE/share/$PKG/$kind" "$VENV/share/$PKG/$kind"; fi
done
cp "$ROOT/package.xml" "$VENV/share/$PKG/package.xml"
# launch/ and config/ of the source tree, linked so that edits take effect
# (ament_index_python.get_package_share_directory('physis_ros') -> VENV/share/physis_ros)
for d in launch config; do
  if [ -d "$ROOT/$d" ]; then ln -sfn "$ROOT/$d" "$VENV/share/$PKG/$d"; fi
done

echo "build_msgs: $PKG.msg/srv/action built ($(ls "$ROOT/$PKG"/msg "$ROOT/$PKG"/srv "$ROOT/$PKG"/action | grep -c '^_[a-z].*\.py$') modules)"

# physis_ros development environment.
#
#   make setup      .venv with pinned deps, msg code generated, package editable
#   make test       run the test suite (PYTEST_ARGS="-k foo -x" to pass options)
#   make test-fast  the pure-logic tier for the edit loop (no programs, workers or ROS nodes; ~1 min)
#   make demo       the main job: action server (tiny-wam, 2 CPU workers) fed by synthetic
#                   robots, live table; 20 s (DEMO_ARGS="--duration 0": until Ctrl-C)
#   make clean      remove build/ and generated msg code (keeps .venv)
#   make distclean  clean + remove .venv
#
# Every step is guarded by a stamp, so `make setup` with nothing changed is a
# no-op:
#   .venv/.stamps/requirements   <- requirements.txt requirements-nodeps.txt
#   physis_ros/msg/.built        <- msg/*.msg srv/*.srv action/*.action CMakeLists.txt package.xml tools/build_msgs.sh
#   .venv/.stamps/editable       <- setup.py
# The msg stamp lives inside the generated (git-ignored) physis_ros/msg/, so
# deleting that directory also triggers a rebuild.

SHELL  := /bin/bash
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMPS := $(VENV)/.stamps

REQ_STAMP      := $(STAMPS)/requirements
MSG_STAMP      := physis_ros/msg/.built
EDITABLE_STAMP := $(STAMPS)/editable

MSG_FILES := $(wildcard msg/*.msg srv/*.srv action/*.action)

PYTEST_ARGS ?=
# Test files run this many at a time (pytest-xdist; a file's tests stay together, so a module's server
# fixture starts once). Each test process has ROS domains of its own (tests/domains.py). 0: one at a time.
TEST_JOBS   ?= 2
DEMO_ARGS   ?= --duration 20

.PHONY: setup test test-fast demo clean distclean

setup: $(REQ_STAMP) $(MSG_STAMP) $(EDITABLE_STAMP)

$(REQ_STAMP): requirements.txt requirements-nodeps.txt
	@test -x $(VPY) || { \
	  echo ">> creating $(VENV) with $(PYTHON)"; \
	  $(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
	    || { echo "error: Python 3.11 required (torch/ROS wheels are pinned for cp311); set PYTHON=" >&2; exit 1; }; \
	  $(PYTHON) -m venv $(VENV); }
	@echo ">> installing requirements.txt into $(VENV)"
	$(VPY) -m pip install --disable-pip-version-check -q -r requirements.txt
	@echo ">> installing requirements-nodeps.txt (without their declared dependencies)"
	$(VPY) -m pip install --disable-pip-version-check -q --no-deps -r requirements-nodeps.txt
	@mkdir -p $(STAMPS) && touch $@

$(MSG_STAMP): $(REQ_STAMP) $(MSG_FILES) CMakeLists.txt package.xml tools/build_msgs.sh
	@echo ">> generating msg interfaces"
	tools/build_msgs.sh $(VENV)
	@touch $@

$(EDITABLE_STAMP): $(REQ_STAMP) setup.py
	@echo ">> installing physis_ros (editable) into $(VENV)"
	$(VPY) -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	@mkdir -p $(STAMPS) && touch $@

test: setup
	$(VPY) -m pytest -q -rs -n $(TEST_JOBS) --dist loadfile tests $(PYTEST_ARGS)

# Tests marked `slow` start programs, workers or ROS nodes; with PHYSIS_TEST_FAST=1 anything else that
# tries to start one fails naming itself (tests/conftest.py).
test-fast: setup
	PHYSIS_TEST_FAST=1 $(VPY) -m pytest -q -rs -m "not slow" tests $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/physis-demo $(DEMO_ARGS)

clean:
	rm -rf build physis_ros/msg physis_ros/srv physis_ros/action
	rm -f physis_ros/physis_ros_s__*.so
	rm -f $(VENV)/lib/libphysis_ros__*.so

distclean: clean
	rm -rf $(VENV) *.egg-info

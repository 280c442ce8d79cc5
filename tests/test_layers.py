"""One-way layers (docs/ARCHITECTURE.md): model contract -> wire/transport -> runtime -> scheduling ->
serving -> front ends. Every module's imports are parsed (those inside functions and TYPE_CHECKING blocks
too); an import that goes up a layer, or a circle between subpackages, fails here unless it is one of the
known exceptions listed below with the issue that removes it. And no two modules share a name across
subpackages unless they are the same concept at two layers, which the first line of one says by naming
the other."""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "physis_ros"

# Each subpackage or top-level module, and its layer: a module may import only its own layer's or lower ones.
LAYERS = {
    # shared by every layer: typed configs, logging, heap, telemetry records, control-timeline arithmetic
    "config": 0, "logs": 0, "heap": 0, "telemetry": 0, "timeline": 0,
    "cdr": 0,                                     # plain CDR bytes (ROS 2's wire format), no ROS
    "model": 1,                                   # the model contract and the reference models
    "observations": 1.5, "reference": 1.5,        # the bundled scene, the sequential reference (on the models)
    "recompute": 1.5,                             # the full-recompute reference of the history rules
    "runtime": 2,                                 # wire/transport, workers, engine
    "scheduling": 3,                              # cost model, placement, admission
    "serving": 4,                                 # the serving application (Server, Session)
    "msg": 4.5, "action": 4.5, "srv": 4.5,        # the ROS interfaces (generated)
    "console": 4.8,                               # what every console command shares
    "launcher": 4.8,                              # child processes (server, synthetic robot) for demo, bench, tests
    "ros": 5, "train": 5, "openpi": 5,            # front ends
    "bags": 6, "bench": 6,
    "cli": 7,
}
# Imports that go up a layer today: (importing module, imported module) -> the issue that removes them.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path) -> set[str]:
    """The physis_ros modules ``path`` imports (a ``from X import name`` of a submodule counts as that one)."""
    known = modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "physis_ros" or n.startswith("physis_ros."))
    return found


def part(module: str) -> str:
    """The subpackage or top-level module a module belongs to (``physis_ros.ros.node`` -> ``ros``)."""
    return module.split(".")[1] if "." in module else ""


def edges() -> dict[tuple[str, str], set[str]]:
    out = defaultdict(set)
    for module, path in modules().items():
        for target in imports(path):
            if part(target) and part(module) and part(target) != part(module):
                out[(module, target)].add(path.name)
    return out


def test_every_subpackage_and_top_level_module_has_a_layer():
    parts = {part(m) for m in modules() if part(m)}
    assert parts == set(LAYERS), f"give these a layer: {sorted(parts - set(LAYERS))}; gone: " \
                                 f"{sorted(set(LAYERS) - parts)}"


def test_no_import_goes_up_a_layer():
    upward = {(m, t) for m, t in edges() if LAYERS[part(t)] > LAYERS[part(m)]}
    new = sorted(upward - set(KNOWN_UPWARD))
    assert not new, "imports that go up a layer (docs/ARCHITECTURE.md): " + \
        "; ".join(f"{m} imports {t}" for m, t in new)
    gone = sorted(set(KNOWN_UPWARD) - upward)
    assert not gone, f"no longer imported, remove from KNOWN_UPWARD: {gone}"


def test_no_circle_between_subpackages():
    graph = defaultdict(set)
    for m, t in edges():
        graph[part(m)].add(part(t))
    circles = set()
    for a, b in itertools.combinations(sorted(graph), 2):
        if reaches(graph, a, b) and reaches(graph, b, a):
            circles.add((a, b))
    assert not circles, f"circles between subpackages: {sorted(circles)}"


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def test_a_shared_module_name_says_which_concept_it_shares():
    """``bench/handoff.py`` measures ``model/handoff.py``: fine, if its first line says so. Two unrelated
    modules of one name are not."""
    by_name = defaultdict(list)
    for module, path in modules().items():
        if path.name != "__init__.py":
            by_name[path.name].append(path)
    for name, paths in by_name.items():
        if len(paths) < 2:
            continue
        rel = {p: str(p.relative_to(PACKAGE)) for p in paths}
        unnamed = [p for p in paths if not any(rel[o] in first_line(p) for o in paths if o != p)]
        assert len(unnamed) <= 1, (f"modules named {name}: {sorted(rel.values())}; the first line of all but one "
                                   f"must name another ({sorted(rel[p] for p in unnamed)} do not), or rename them")


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.splitlines()[0] if doc else ""


def test_the_serving_core_imports_no_ros():
    """``physis_ros.serving`` (and everything below it) imports neither rclpy nor a ROS message package."""
    ros_packages = ("rclpy", "builtin_interfaces", "sensor_msgs", "std_msgs", "trajectory_msgs", "diagnostic_msgs",
                    "rosbag2_py", "rosidl_runtime_py")
    for module, path in modules().items():
        if LAYERS.get(part(module), 0) > LAYERS["serving"]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.split(".")[0] in ros_packages]
            assert not bad, f"{module} imports {bad}"


# Private attributes read on objects that are not ours: library objects (torch.distributed's Gloo options,
# which have no public setter for devices and timeout; openpi-client's WebsocketClientPolicy, which has no
# close of its own; diffusers' list of the modules a model keeps in fp32, which it reads the same way).
LIBRARY_PRIVATE = {("runtime/hops.py", "opts._devices"), ("runtime/hops.py", "opts._timeout"),
                   ("runtime/hops.py", "dist.ProcessGroupGloo._Options"), ("bench/openpi.py", "policy._ws"),
                   ("model/wan.py", "WanTransformer3DModel._keep_in_fp32_modules")}
GENERATED = ("msg", "srv", "action")   # rosidl's generated message code


def test_no_module_reads_another_objects_private_state():
    """``x._name`` only on ``self``, ``cls`` or ``super()``: a module that needs another's state asks its
    public interface (the engine's recovery read ``engine._feed`` and ``engine._started``)."""
    found = []
    for module, path in modules().items():
        if part(module) in GENERATED:
            continue
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if (rel, ast.unparse(node)) not in LIBRARY_PRIVATE:
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, "private state read from outside its object: " + "; ".join(found)


def test_modules_sharing_a_name_are_one_concept_and_say_so():
    """Two modules of one file name in different subpackages are the same concept at two layers (a command and
    what it runs, a benchmark and what it measures), and one of them names the other in its first line; a
    name shared by two concepts (three admission.py, three streams.py) is not allowed."""
    by_name = defaultdict(list)
    for module, path in modules().items():
        if path.name != "__init__.py" and part(module) not in GENERATED:
            by_name[path.name].append(path)
    for name, paths in by_name.items():
        if len(paths) < 2:
            continue
        rels = [str(p.relative_to(PACKAGE)) for p in paths]
        first = {rel: p.read_text().lstrip('"').splitlines()[0] for rel, p in zip(rels, paths)}
        named = any(other in first[rel] or other.replace(f"{PACKAGE.name}/", "") in first[rel]
                    for rel in rels for other in rels if other != rel)
        assert named, \
            f"{name} is shared by {rels}: rename one, or say in its first line which module it is the same concept as"

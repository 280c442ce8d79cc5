"""No module of physis_ros reads a private attribute (``x._name``) of an object other than ``self``/``cls``
(issue 52): a module works with another's object through its public interface. Allowed: the ROS interfaces
rosidl generates (physis_ros/msg, srv, action: their ``_TYPE_SUPPORT`` hooks are how rclpy binds them), a
``super()._method`` call (the object is still ``self``), and the library objects listed with the reason they
have no public way (:data:`LIBRARY`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "physis_ros"
GENERATED = {"msg", "srv", "action"}   # rosidl_generator_py's output (make setup generates the interfaces)
# (file, expression) -> why a library object is read there by a private name
LIBRARY = {
    ("runtime/hops.py", "dist.ProcessGroupGloo._Options"): "torch.distributed: the gloo group's options type",
    ("runtime/hops.py", "opts._devices"): "torch.distributed: the gloo devices of a group built by hand",
    ("runtime/hops.py", "opts._timeout"): "torch.distributed: the group's timeout (no public setter)",
}


def private_reads(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_module_reads_another_objects_private_attributes():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in GENERATED:
            continue
        for line, expr in private_reads(path):
            if (rel.as_posix(), expr) not in LIBRARY:
                found.append(f"physis_ros/{rel.as_posix()}:{line}: {expr}")
    assert not found, "private attributes read from outside their object:\n" + "\n".join(found)


def test_the_walk_finds_what_it_forbids(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class A:\n"
                   "    def f(self, other):\n"
                   "        self._own = super()._apply(cls._spec)\n"
                   "        return other._hidden, other.engine._feed\n")
    assert sorted(e for _, e in private_reads(src)) == ["other._hidden", "other.engine._feed"]
    for (rel, expr) in LIBRARY:   # every allowance is still needed (a stale one would hide a new read)
        assert expr in {e for _, e in private_reads(PACKAGE / rel)}, (rel, expr)

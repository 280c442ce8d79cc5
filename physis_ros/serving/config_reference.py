"""docs/config.md: every key of a serve config, from the config dataclasses themselves.

    python -m physis_ros.serving.config_reference > docs/config.md

One table per section (node-wide keys, ``engine.*``, ``admission.*``, ``streams.<name>.*``): the dotted
key (the ROS parameter's name), its default, its range or choices, whether it changes at run time, and
what it means (the field's description). ``tests/ros/test_ros_config.py`` checks that the committed file
is what this writes, so the reference cannot drift from the code.
"""

from __future__ import annotations

import math
import sys

from physis_ros.serving.config import ServeConfig, StreamConfig
from physis_ros.serving.config_keys import ConfigLeaf, is_runtime, leaves, stream_leaves, unset_value

HEADER = """# Serve config reference

Every key of a serve config (`config/serve.yaml`, a ROS 2 parameters file: nested keys become the dotted
parameter names below). The bundled file sets only what a user usually changes; every other key keeps
the default listed here. Generated from the config dataclasses by
`python -m physis_ros.serving.config_reference > docs/config.md`; a test keeps it current.
Changes at run time: `ros2 param set` takes effect on the running server (the others are read-only, or
for a stream fixed while it is served). Optional keys left unset read as the value their row names.
"""

SECTIONS = (("Node", ""), ("Engine", "engine."), ("Admission", "admission."))


def _value(leaf: ConfigLeaf) -> str:
    value = leaf.value
    if value is None:
        unset = unset_value(leaf.type, leaf.meta)
        return "unset" if unset is None else f"unset (reads {unset!r})"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    return f"{value}" if not isinstance(value, str) else (f'"{value}"' if value == "" else value)


def _range(leaf: ConfigLeaf) -> str:
    meta = leaf.meta
    if meta.get("choices"):
        return " \\| ".join(map(str, meta["choices"]))
    parts = []
    if meta.get("ge") is not None:
        parts.append(f">= {meta['ge']:g}")
    if meta.get("gt") is not None:
        parts.append(f"> {meta['gt']:g}")
    if meta.get("le") is not None:
        parts.append(f"<= {meta['le']:g}")
    return ", ".join(parts)


def _doc(leaf: ConfigLeaf) -> str:
    doc = leaf.meta.get("doc", "") or leaf.section_doc
    return doc.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[ConfigLeaf], strip: str = "") -> list[str]:
    out = ["| key | default | range | run time | meaning |", "|---|---|---|---|---|"]
    for leaf in rows:
        runtime = "yes" if is_runtime(leaf.name) else ""
        key = leaf.name[len(strip):] if strip else leaf.name
        out.append(f"| `{key}` | {_value(leaf)} | {_range(leaf)} | {runtime} | {_doc(leaf)} |")
    return out


def reference() -> str:
    """The whole reference, as docs/config.md holds it."""
    node = leaves(ServeConfig())
    lines = [HEADER]
    for title, prefix in SECTIONS:
        if prefix:
            rows = [leaf for leaf in node if leaf.name.startswith(prefix)]
        else:
            rows = [leaf for leaf in node if "." not in leaf.name]
        lines += [f"## {title}", "", *_table(rows), ""]
    rest = [leaf for leaf in node if "." in leaf.name and not leaf.name.startswith(tuple(p for _, p in SECTIONS[1:]))]
    if rest:
        lines += ["## Other", "", *_table(rest), ""]
    stream = stream_leaves(StreamConfig(joint_names=[], inputs={"<input>": ""}), "<name>")
    lines += ["## Streams (`streams.<name>.*`, one section per robot)", "",
              *_table(stream, "streams.<name>."), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(reference())

#!/usr/bin/env python3
"""Regenerate the bundled scene bag, tests/data/scene_bag (or check that it is up to date).

    .venv/bin/python tools/make_scene_bag.py            # rewrite tests/data/scene_bag
    .venv/bin/python tools/make_scene_bag.py --check    # exit 1 if the bundled bag's messages differ

Two 7-DoF arms (namespaces robot0, robot1, joints joint1..joint7 as in
config/serve.yaml), each with joint_states and a 64x48 rgb8 camera view of a
moving target, 4 s at 10 Hz: 160 messages, under 1 MB, mcap storage. The same
as ``physis-bag generate tests/data/scene_bag --force`` with the defaults;
generation is deterministic (fixed stamps), so the output is byte-for-byte stable.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "tests" / "data" / "scene_bag"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=BUNDLED)
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)

    from physis_ros.bags.bagio import read_all
    from physis_ros.bags.scene import SceneSpec, scene_messages, write_scene_bag
    from physis_ros.bags.serveconf import load_serve_info

    serve = load_serve_info()
    spec = SceneSpec(namespaces=tuple(s.namespace for s in serve.streams), joint_names=serve.streams[0].joint_names)
    if args.check:
        expected = scene_messages(spec)
        actual = read_all(args.out)
        if [(t, ty, ns, raw) for t, ty, ns, raw in actual] != expected:
            print(f"{args.out} differs from what tools/make_scene_bag.py generates; rerun it", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date ({len(actual)} messages)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / args.out.name
        counts = write_scene_bag(staged, spec)
        if args.out.exists():
            shutil.rmtree(args.out)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staged, args.out)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out}: {sum(counts.values())} messages on {len(counts)} topics, {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

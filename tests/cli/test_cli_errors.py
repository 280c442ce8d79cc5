"""Every physis-* command fails cleanly on bad input: ONE line on stderr, a documented exit code, no traceback.

``CASES`` is the contract as a table: (command line, input file content, expected exit code, words the
error line must hold). In the command line ``{input}`` is a file (or directory) holding the row's
content, ``{tmp}`` a scratch directory of the row's own and ``{bag}`` the bundled scene bag. Every row
runs as a real subprocess of the installed console script (so argument parsing, imports and the
top-level error handling are the user's), all rows in parallel: each start imports rclpy or torch.

The one line is ``<prog>: error: <what is wrong and how to fix it>`` (``physis-bag check: error: ...``
for a subcommand's flags): argparse's errors too, since physis_ros.console.ArgumentParser prints
no usage block (``--help`` shows the usage). Exit codes (physis_ros/console.py, README "Commands"):
0 success, 1 the run failed, 2 usage or input error, 3 physis-bag replay skipped unknown types,
70 internal error, 130 interrupted.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from domains import domain

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCENE_BAG = ROOT / "tests" / "data" / "scene_bag"
SERVE_YAML = ROOT / "config" / "serve.yaml"

def wrong_schema_mcap(kind: str) -> bytes:
    """The scene bag with /robot0/camera/image_raw recorded with the wrong schema: ``type``, as
    std_msgs/msg/String; ``definition``, as sensor_msgs/msg/Image whose definition is String's."""
    import tempfile

    from rosbags.rosbag2 import Writer
    from rosbags.rosbag2.enums import StoragePlugin

    from physis_ros.bags.bagio import iter_messages, open_bag, typestore

    store = typestore()
    with open_bag(SCENE_BAG) as reader:
        types = {c.topic: c.msgtype for c in reader.connections}
        messages = list(iter_messages(reader))
    camera = "/robot0/camera/image_raw"
    text = store.serialize_cdr(store.types["std_msgs/msg/String"](data="not an image"), "std_msgs/msg/String")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bag"
        with Writer(out, version=Writer.VERSION_LATEST, storage_plugin=StoragePlugin.MCAP) as writer:
            conns = {}
            for topic, msgtype in types.items():
                if topic == camera and kind == "type":
                    conns[topic] = writer.add_connection(topic, "std_msgs/msg/String", typestore=store)
                elif topic == camera:
                    conns[topic] = writer.add_connection(topic, msgtype, msgdef="string data",
                                                         rihs01="RIHS01_" + "0" * 64)
                else:
                    conns[topic] = writer.add_connection(topic, msgtype, typestore=store)
            for topic, _, stamp, raw in messages:
                writer.write(conns[topic], stamp, text if topic == camera else raw)
        return next(out.glob("*.mcap")).read_bytes()


BINARY = bytes(range(256)) * 16                       # NUL bytes and invalid UTF-8
_MCAP = (SCENE_BAG / "scene_bag.mcap").read_bytes()
TRUNCATED_MCAP = _MCAP[: len(_MCAP) // 2]               # a recorder killed mid-write
BAD_YAML = "streams: [unclosed\n  - x: {\n"
CORRUPT_KEYS = {"server.key_secret": BINARY, "server.key": b"not a key", "client.key_secret": b"garbage",
                "authorized/": None}


def serve_yaml(model: str = "", **engine) -> str:
    """The bundled serve config (plain format) with ``engine`` keys (and the model) changed; ``{tmp}`` is
    filled in later."""
    data = yaml.safe_load(SERVE_YAML.read_text())["/**"]["ros__parameters"]
    data["engine"].update(engine)
    if model:
        data["model"] = model
    return yaml.safe_dump(data, sort_keys=False)


BAD_CHECKPOINT_CONFIG = serve_yaml(checkpoint="{tmp}/model.safetensors")   # {tmp}/model.safetensors: BINARY
# issue 48 item 5: a checkpoint of another model was found by the workers, every stream failed, exit 0
OTHER_MODELS_CHECKPOINT_CONFIG = serve_yaml(model="tiny-acwm",
                                            checkpoint=str(SERVE_YAML.parent / "checkpoints" / "tiny-wam-demo.safetensors"))
BAD_PROFILE_CONFIG = serve_yaml(profile="{tmp}/profile.json")               # {tmp}/profile.json: "{not json"
BAD_KEYS_CONFIG = serve_yaml(curve_keys="{tmp}/keys")                       # {tmp}/keys: CORRUPT_KEYS


@dataclass(frozen=True, eq=False)     # identity hash: rows are dict keys
class Case:
    cmd: str
    content: str | bytes | dict | None = None       # of {input}; dict: a directory {name: bytes, "sub/": None}
    suffix: str = ""
    code: int = 2
    words: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)        # more files in {tmp}: name -> content

    @property
    def prog(self) -> str:
        return self.cmd.split()[0]


OPEN_OPENPI_CONFIG = yaml.safe_dump({"openpi": {"host": "0.0.0.0", "api_key_env": "PHYSIS_TEST_UNSET_KEY"}})


def case(cmd, content=None, code=2, words=(), suffix="", **extra):
    words = (words,) if isinstance(words, str) else tuple(words)
    return pytest.param(Case(cmd, content, suffix, code, words, extra), id=cmd.replace("{", "").replace("}", ""))


CASES = [
    # ---- physis-rollout
    case("physis-rollout --model no-such-model --chunks 1", None, 2, ["unknown model preset", "no-such-model"]),
    case("physis-rollout --model {input} --chunks 1", BINARY, 2, ["binary"], ".yaml"),
    case("physis-rollout --model {input} --chunks 1", BAD_YAML, 2, ["not valid YAML", "line 2"], ".yaml"),
    case("physis-rollout --model {input} --chunks 1", "", 2, ["empty"], ".yaml"),
    case("physis-rollout --chunks 0", None, 2, ["--chunks", "> 0"]),
    case("physis-rollout --bogus", None, 2, ["unrecognized arguments", "--bogus"]),
    case("physis-rollout --device tpu --chunks 1", None, 2, ["--device", "tpu", "cpu or cuda:N"]),
    # ---- physis-worker
    case("physis-worker", None, 2, ["required", "--connect"]),
    case("physis-worker --connect nonsense", None, 2, ["--connect", "tcp://"]),
    case("physis-worker --connect tcp://127.0.0.1:1 --curve-keys {input}", CORRUPT_KEYS, 2, ["CurveZMQ", "physis-keys"]),
    case("physis-worker --connect tcp://127.0.0.1:1 --threads many", None, 2, ["--threads", "integer"]),
    case("physis-worker --connect tcp://127.0.0.1:1 --device tpu", None, 2, ["--device", "tpu", "cpu or cuda:N"]),
    # ---- physis-bench, each subcommand
    case("physis-bench", None, 2, ["required"]),
    case("physis-bench pipeline --workers 0", None, 2, ["--workers", ">= 1"]),
    case("physis-bench pipeline --plans bogus", None, 2, ["unknown plan", "bogus"]),
    case("physis-bench pipeline --device tpu", None, 2, ["--device", "tpu", "cpu or cuda:N"]),
    case("physis-bench timeshare --device tpu", None, 2, ["--device", "tpu", "cpu or cuda:N"]),
    case("physis-bench device --device tpu --json {tmp}/d.json", None, 2, ["--device", "tpu", "cpu or cuda:N"]),
    case("physis-bench device --device cuda:64 --json {tmp}/d.json", None, 2, ["--device", "cuda:64", "not available"]),
    case("physis-bench device --workers 0 --json {tmp}/d.json", None, 2, ["--workers", ">= 1"]),
    case("physis-bench timeshare --profile {input}", "{not json", 2, ["--profile", "not valid JSON"], ".json"),
    case("physis-bench timeshare --profile {input}", BINARY, 2, ["--profile", "binary"], ".json"),
    case("physis-bench soak --minutes soon", None, 2, ["--minutes"]),
    case("physis-bench streams --model no-such", None, 2, ["unknown model preset"]),
    case("physis-bench ros --config {input}", "", 2, ["--config", "empty"], ".yaml"),
    case("physis-bench handoff --modes none,smooth", None, 2, ["--modes", "smooth"]),
    case("physis-bench handoff --robots 0", None, 2, ["--robots", ">= 1"]),
    case("physis-bench admission --modes sometimes", None, 2, ["--modes", "adaptive, on, off"]),
    case("physis-bench hop --sizes 64K,lots", None, 2, ["--sizes", "lots", "64K,1M"]),
    case("physis-bench hop --sizes 2G", None, 2, ["--sizes", "(0, 1G]"]),
    case("physis-train --out x.pt", None, 2, ["--out", ".safetensors"]),
    # ---- physis-profile
    case("physis-profile --model tiny-wam", None, 2, ["required", "--json"]),
    case("physis-profile --model {input} --json {tmp}/p.json", "- 1\n- 2\n", 2, ["mapping"], ".yaml"),
    case("physis-profile --batch-sizes a,b --json {tmp}/p.json", None, 2, ["--batch-sizes"]),
    case("physis-profile --device tpu --json {tmp}/p.json", None, 2, ["--device", "tpu", "cpu or cuda:N"]),
    # ---- physis-sim
    case("physis-sim --devices 0 --slo-ms 100 --models wan2.1-1.3b", None, 2, ["--devices", "> 0"]),
    case("physis-sim --devices 4 --slo-ms -5 --models wan2.1-1.3b", None, 2, ["--slo-ms", "positive"]),
    case("physis-sim --devices 4 --slo-ms 100 --models wan2.1-1.3b --profile wan2.1-1.3b={input}", BINARY, 2,
         ["--profile", "binary"], ".json"),
    case("physis-sim --scenario report24 --config {input}", BAD_YAML, 2, ["--config", "not valid YAML"], ".yaml"),
    case("physis-sim --models no-such --slo-ms 100", None, 2, ["unknown model", "no-such"]),
    # ---- physis-keys
    case("physis-keys", None, 2, ["required", "directory"]),
    case("physis-keys {input}", "a file", 2, ["not a directory"]),
    case("physis-keys {input}", CORRUPT_KEYS, 2, ["not a readable CurveZMQ key", "move it away"]),
    # ---- physis-bag, each subcommand
    case("physis-bag", None, 2, ["required"]),
    case("physis-bag bogus", None, 2, ["invalid choice", "bogus"]),
    case("physis-bag info /nonexistent", None, 2, ["/nonexistent", "does not exist"]),
    case("physis-bag info {input}", b"", 2, ["empty"], ".mcap"),
    case("physis-bag info {input}", BINARY, 2, ["corrupt"], ".mcap"),
    case("physis-bag info {input}", {"metadata.yaml": BINARY, "x.mcap": _MCAP}, 2, ["cannot read bag"]),
    case("physis-bag replay {input}", TRUNCATED_MCAP, 2, ["truncated"], ".mcap"),
    case("physis-bag replay {bag} --rate 0", None, 2, ["--rate", "> 0"]),
    case("physis-bag record", None, 2, ["required", "out"]),
    case("physis-bag record {tmp}/out --config {input}", BINARY, 2, ["--config", "binary"], ".yaml"),
    case("physis-bag check {input}", TRUNCATED_MCAP, 2, ["truncated"], ".mcap"),
    # a topic with the wrong schema (issue 47 item 5: check exited 70, replay 0 publishing garbage)
    *[case(f"physis-bag {sub} {{input}}", wrong_schema_mcap("type"), 2,
           ["/robot0/camera/image_raw", "std_msgs/msg/String", "sensor_msgs/msg/Image"], ".mcap")
      for sub in ("info", "check", "replay")],
    *[case(f"physis-bag {sub} {{input}}", wrong_schema_mcap("definition"), 2,
           ["/robot0/camera/image_raw", "another definition", "fields data"], ".mcap")
      for sub in ("info", "check", "replay")],
    case("physis-bag check {bag} --config {input}", BAD_YAML, 2, ["--config", "not valid YAML"], ".yaml"),
    case("physis-bag check {bag} --config {input}", BAD_CHECKPOINT_CONFIG, 2, ["checkpoint", "safetensors"],
         ".yaml", **{"model.safetensors": BINARY}),
    case("physis-bag generate {tmp}/gen --fault nan@1", None, 2, ["--fault", "KIND@TICK"]),
    case("physis-bag generate {tmp}/gen --size big", None, 2, ["--size", "64x48"]),
    # ---- physis-report
    case("physis-report {input} --out {tmp}/report", TRUNCATED_MCAP, 2, ["truncated"], ".mcap"),
    case("physis-report {bag}", None, 2, ["required", "--out"]),
    case("physis-report {bag} --out {tmp}/report", None, 2, ["/telemetry"]),
    # ---- physis-serve
    case("physis-serve --config /nonexistent.yaml --duration 1", None, 2, ["/nonexistent.yaml", "does not exist"]),
    case("physis-serve --ros-args --duration 1", None, 2, ["--duration", "before --ros-args"]),
    case("physis-serve --duration -1", None, 2, ["--duration", ">= 0"]),
    case("physis-serve --config {input} --duration 1", BINARY, 2, ["--config", "binary"], ".yaml"),
    case("physis-serve --config {input} --duration 1", serve_yaml(workers=0), 2, ["workers"], ".yaml"),
    case("physis-serve --config {input} --duration 1", BAD_CHECKPOINT_CONFIG, 2, ["checkpoint", "safetensors"],
         ".yaml", **{"model.safetensors": BINARY}),
    case("physis-serve --config {input} --duration 1", OTHER_MODELS_CHECKPOINT_CONFIG, 2,
         ["engine.checkpoint", "holds model 'tiny-wam'", "not the configured model 'tiny-acwm'"], ".yaml"),
    case("physis-demo --config {input} --duration 1", OTHER_MODELS_CHECKPOINT_CONFIG, 2,
         ["engine.checkpoint", "holds model 'tiny-wam'"], ".yaml"),
    case("physis-serve --config {input} --duration 1", BAD_PROFILE_CONFIG, 2, ["engine.profile", "JSON"],
         ".yaml", **{"profile.json": "{not json"}),
    case("physis-serve --config {input} --duration 1", BAD_KEYS_CONFIG, 2, ["curve_keys", "physis-keys"],
         ".yaml", **{"keys": CORRUPT_KEYS}),
    case("physis-serve --no-ros --duration 1", None, 2, ["openpi.port", "--openpi PORT"]),
    case("physis-serve --openpi 70000 --duration 1", None, 2, ["--openpi", "TCP port"]),
    case("physis-serve --no-ros --openpi 0 --ros-args -p a:=1", None, 2, ["--no-ros", "--ros-args"]),
    case("physis-serve --no-ros --openpi 0 --config {input} --duration 1", OPEN_OPENPI_CONFIG, 2,
         ["openpi.api_key_env", "PHYSIS_TEST_UNSET_KEY", "not loopback"], ".yaml"),
    # ---- physis-demo
    case("physis-demo --config {input}", "", 2, ["empty"], ".yaml"),
    case("physis-demo --rate 0", None, 2, ["--rate", "> 0"]),
    case("physis-demo --config {input}", BAD_CHECKPOINT_CONFIG, 2, ["checkpoint"], ".yaml",
         **{"model.safetensors": b""}),
    # ---- physis-synthetic
    case("physis-synthetic --ros-args --rate 5", None, 2, ["--rate", "before --ros-args"]),
    case("physis-synthetic --rate 0", None, 2, ["--rate", "> 0"]),
    case("physis-synthetic --config {input}", BAD_YAML, 2, ["--config", "not valid YAML"], ".yaml"),
    # ---- physis-stream (no server runs in this table's ROS domain)
    case("physis-stream", None, 2, ["required", "command"]),
    case("physis-stream add --name r", None, 2, ["required", "--joints"]),
    case("physis-stream add --name r --joints a --slo-ms -1", None, 2, ["--slo-ms", ">= 0"]),
    case("physis-stream add --name r --joints ,", None, 2, ["--joints", "comma-separated"]),
    case("physis-stream list --bogus", None, 2, ["unrecognized arguments", "--bogus"]),
    case("physis-stream remove", None, 2, ["required", "name"]),
    case("physis-stream --timeout 0 list", None, 2, ["--timeout", "> 0"]),
    case("physis-stream --ros-args --timeout 1 list", None, 2, ["before --ros-args"]),
    case("physis-stream --timeout 1 --server /nobody add --name r --joints a,b", None, 2,
         ["no server answers", "/nobody/serve_stream"]),
    case("physis-stream --timeout 1 --server /nobody list", None, 2, ["no server answers", "/nobody/list_streams"]),
    case("physis-stream --timeout 1 --server /nobody remove r", None, 2, ["no server answers", "/nobody/remove_stream"]),
]

COMMANDS = ["physis-rollout", "physis-worker", "physis-bench pipeline", "physis-bench timeshare", "physis-bench soak",
            "physis-bench streams", "physis-bench ros", "physis-bench device", "physis-bench handoff",
            "physis-bench admission", "physis-bench hop", "physis-profile", "physis-sim", "physis-keys",
            "physis-bag info", "physis-bag replay", "physis-bag record", "physis-bag check", "physis-bag generate",
            "physis-report", "physis-serve", "physis-demo", "physis-synthetic", "physis-stream add", "physis-stream list",
            "physis-stream remove"]


def _write(path: Path, content, tmp: Path) -> None:
    if isinstance(content, dict):
        path.mkdir(parents=True)
        for name, data in content.items():
            if name.endswith("/"):
                (path / name).mkdir()
            else:
                _write(path / name, data, tmp)
    elif isinstance(content, str):
        path.write_text(content.replace("{tmp}", str(tmp)))
    else:
        path.write_bytes(content)


@dataclass
class Outcome:
    code: int | None
    stdout: str
    stderr: str
    seconds: float


def _run(c: Case, tmp: Path, env: dict) -> Outcome:
    tmp.mkdir(parents=True)
    target = tmp / f"input{c.suffix}"
    if c.content is not None:
        _write(target, c.content, tmp)
    for name, content in c.extra.items():
        _write(tmp / name, content, tmp)
    line = c.cmd.replace("{input}", str(target)).replace("{tmp}", str(tmp)).replace("{bag}", str(SCENE_BAG))
    argv = shlex.split(line)
    argv[0] = str(BIN / argv[0])
    start = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=240,
                           stdin=subprocess.DEVNULL)
        return Outcome(p.returncode, p.stdout, p.stderr, time.monotonic() - start)
    except subprocess.TimeoutExpired as exc:
        return Outcome(None, str(exc.stdout or ""), str(exc.stderr or ""), time.monotonic() - start)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every row at once, in parallel; {case: Outcome}."""
    env = {k: v for k, v in os.environ.items() if k != "PHYSIS_DEBUG"}
    env.update(ROS_DOMAIN_ID=str(domain("cli")), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")
    base = tmp_path_factory.mktemp("cli-errors")
    cases = [p.values[0] for p in CASES]
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(4, 2 * (os.cpu_count() or 2))) as pool:
        results = list(pool.map(lambda ic: _run(ic[1], base / f"case{ic[0]}", env), enumerate(cases)))
    wall = time.monotonic() - start
    slowest = max(r.seconds for r in results)
    print(f"\n{len(cases)} command lines in {wall:.1f} s wall (slowest {slowest:.1f} s)")
    return dict(zip(cases, results))


@pytest.mark.slow
@pytest.mark.parametrize("c", CASES)
def test_error_contract(c: Case, outcomes):
    out = outcomes[c]
    where = f"{c.cmd}\n--- exit {out.code}, stdout:\n{out.stdout[-2000:]}\n--- stderr:\n{out.stderr[-4000:]}"
    assert out.code is not None, "timed out: " + where
    assert "Traceback" not in out.stdout + out.stderr, where
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, where
    line = lines[0]
    assert line.startswith(c.prog) and ": error: " in line, where
    for word in c.words:
        assert word.lower() in line.lower(), f"'{word}' not in the error line: {where}"
    assert out.code == c.code, where


def test_every_command_and_subcommand_is_in_the_table():
    covered = {" ".join(p.values[0].cmd.split()[:2]) for p in CASES} | {p.values[0].prog for p in CASES}
    assert set(COMMANDS) <= covered, sorted(set(COMMANDS) - covered)


@pytest.mark.parametrize("command", COMMANDS + ["physis-bench", "physis-bag"])
def test_help_documents_the_exit_codes(command, capsys):
    import importlib

    prog, *sub = command.split()
    module = f"physis_ros.cli.{prog[len('physis-'):]}"
    main = importlib.import_module(module).main
    assert main([*sub, "--help"]) == 0       # argparse's SystemExit(0) becomes main's return value
    text = capsys.readouterr().out
    assert "Exit" in text and "2" in text and "70 internal error" in " ".join(text.split()), text


def test_an_unexpected_exception_is_one_line_exit_70(capsys, monkeypatch):
    from physis_ros.console import EXIT_INTERNAL, run_main

    def body(argv):
        raise TypeError("boom")

    monkeypatch.delenv("PHYSIS_DEBUG", raising=False)
    assert run_main("physis-x", body, []) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("physis-x: error: internal error: TypeError: boom")
    assert "PHYSIS_DEBUG=1" in err
    monkeypatch.setenv("PHYSIS_DEBUG", "1")
    with pytest.raises(TypeError):
        run_main("physis-x", body, [])


def test_interrupt_is_130_and_input_errors_are_2(capsys, monkeypatch):
    from physis_ros.console import EXIT_INTERRUPTED, EXIT_USAGE, run_main

    monkeypatch.delenv("PHYSIS_DEBUG", raising=False)

    def interrupted(argv):
        raise KeyboardInterrupt

    def missing(argv):
        open("/nonexistent/file")

    def bad_bytes(argv):
        BINARY.decode("utf-8")

    assert run_main("physis-x", interrupted, []) == EXIT_INTERRUPTED
    assert run_main("physis-x", missing, []) == EXIT_USAGE
    assert run_main("physis-x", bad_bytes, []) == EXIT_USAGE
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "physis-x: interrupted"
    assert lines[1] == "physis-x: error: /nonexistent/file: No such file or directory"
    assert lines[2].startswith("physis-x: error: an input file is not UTF-8 text")


@pytest.mark.slow
def test_a_server_whose_config_streams_all_fail_exits_1_with_each_reason(tmp_path):
    """Issue 48 item 5: a server none of whose configured robots could start served nothing and exited 0.
    Here every config stream is refused (h3-33b does not fit two CPU workers' memory): exit 1, each stream's
    reason on stderr, no traceback."""
    config = tmp_path / "serve.yaml"
    config.write_text(serve_yaml(model="h3-33b"))
    env = {k: v for k, v in os.environ.items() if k != "PHYSIS_DEBUG"}
    env.update(ROS_DOMAIN_ID=str(domain("cli")), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")
    p = subprocess.run([str(BIN / "physis-serve"), "--config", str(config), "--duration", "30"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    where = f"exit {p.returncode}\n{p.stderr[-4000:]}"
    assert p.returncode == 1, where
    assert "Traceback" not in p.stdout + p.stderr, where
    for name in ("robot0", "robot1"):
        assert f"physis-serve: error: config stream {name} did not start (memory: model 'h3-33b' needs" in p.stderr
    assert "none of the config's streams started" in p.stderr, where

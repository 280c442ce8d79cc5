"""The bag tools on the Wan streams of config/serve_wan_tiny.yaml (issue 57): robot0 (tiny-wam), wan_wam (a Wan
world-action model: actions and predicted frames) and wan_wm (a Wan world model) generated, replayed into the
real server and checked bit for bit against the sequential reference, the WAM's actions and its frames both.
wan_wm imagines what wan_wam commands live; a replay cannot feed a server's own output, so the check points it
at the actions the bag holds (/wan_wm/actions), and a frame of the WAM that differs fails the check."""

from __future__ import annotations

import pytest
import yaml

from physis_ros.bags.analysis import load_outputs
from physis_ros.bags.serveconf import load_serve_info
from physis_ros.cli import bag as bag_cli
from physis_ros.config import repo_config_dir

pytestmark = pytest.mark.slow
TICKS = 8


@pytest.fixture(scope="module")
def wan_check(tmp_path_factory, ros_domain):
    from physis_ros.bags.check import CheckOptions, run_check

    d = tmp_path_factory.mktemp("wanbag")
    doc = yaml.safe_load((repo_config_dir() / "serve_wan_tiny.yaml").read_text())
    params = doc["/**"]["ros__parameters"]
    assert params["streams"]["wan_wm"]["topics"]["actions"] == "/wan_wam/action_chunk"
    params["streams"]["wan_wm"]["topics"]["actions"] = "actions"         # what the bag holds
    params["admission"] = {"profiles": str(repo_config_dir() / "profiles")}
    config = d / "serve.yaml"
    config.write_text(yaml.safe_dump(doc))
    bag = d / "bag"
    assert bag_cli.main(["generate", str(bag), "--config", str(config), "--duration", str(TICKS / 10)]) == 0
    result = run_check(CheckOptions(bag=bag, config=str(config), out=str(d / "out"), timeout_s=240.0))
    return result, config, bag


def test_the_three_streams_pass_the_deterministic_check_bit_for_bit(wan_check):
    result, _, _ = wan_check
    print("\n" + result.summary())
    assert result.ok, result.summary()
    items = {i.name: i for i in result.analysis.items}
    for name in ("robot0", "wan_wam", "wan_wm"):
        assert "bit-for-bit" in items[f"{name}: equals reference"].detail
        assert result.analysis.stats[name]["chunks"] == TICKS
    assert "actions and predicted frames" in items["wan_wam: equals reference"].detail
    assert "2x4x8x8" in items["wan_wm: chunk fields"].detail


def test_a_wam_frame_that_differs_fails_the_check(wan_check):
    """The recorded outputs, one latent of one of wan_wam's predicted frames changed: the reference comparison
    fails on that chunk (the frames beside the actions are checked, not only the actions)."""
    from physis_ros.bags.analysis import analyse
    from physis_ros.bags.inputs import collect_inputs

    result, config, bag = wan_check
    serve = load_serve_info(str(config))
    inputs = collect_inputs(bag, serve)
    outputs = load_outputs(result.recorded, serve)
    assert sorted(outputs.frames["wan_wam"]) == list(range(TICKS))
    items = {i.name: i for i in analyse(inputs, outputs, serve).items}
    assert items["wan_wam: equals reference"].ok
    outputs.frames["wan_wam"][3] = outputs.frames["wan_wam"][3].copy()
    outputs.frames["wan_wam"][3][1, 2, 3, 4] += 1e-3
    items = {i.name: i for i in analyse(inputs, outputs, serve).items}
    assert not items["wan_wam: equals reference"].ok
    assert "1 of 8 chunks differ" in items["wan_wam: equals reference"].detail
    assert "first chunk 3" in items["wan_wam: equals reference"].detail
    del outputs.frames["wan_wam"][5]                     # a chunk whose frames never came
    items = {i.name: i for i in analyse(inputs, outputs, serve).items}
    assert "2 of 8 chunks differ" in items["wan_wam: equals reference"].detail

"""What a stream needs of its model: the fit check (every observation fed by a topic or a file, joint names
that match its columns), the chunk's horizon, and the control timeline that sets the stream's interval
(execution horizon ``s`` steps at ``control_rate_hz``; DESIGN.md section 8)."""

from __future__ import annotations

from physis_ros.config import ConfigError
from physis_ros.model.spec import ModelConfig
from physis_ros.serving.capacity import Rejected
from physis_ros.serving.config import StreamConfig
from physis_ros.timeline import ControlTimeline, release_steps

TIMELINE_KEYS = ("slo_interval_ms", "execution_horizon", "extra_delay_steps")   # checked against the timeline
OBSERVATION_TOPICS = {"image": "topics.image", "state": "topics.joint_states", "actions": "topics.actions"}


def check_stream_model(key: str, stream: StreamConfig, model: ModelConfig) -> None:
    """A stream must fit its model: every observation the model takes has a topic that feeds it (camera,
    joint states, actions to imagine), and the joint names cover its state and action columns.
    ``key``: the stream's dotted config key, for the error."""
    shapes = model.observation_shapes
    for name in stream.inputs:
        if name in OBSERVATION_TOPICS and name in shapes:
            raise ConfigError(f"{key}.inputs.{name}", f"'{name}' is fed by {OBSERVATION_TOPICS[name]}; a file "
                                                      f"feeds only inputs no topic does")
    unsupported = sorted(set(shapes) - set(OBSERVATION_TOPICS) - set(stream.inputs))
    if unsupported:
        raise ConfigError(f"{key}.inputs", f"model '{model.name}' needs inputs {unsupported} that no ROS topic "
                                           f"feeds: give each a file, inputs: {{{unsupported[0]}: "
                                           f"FILE.safetensors}}")
    if set(shapes) - set(stream.inputs) and "image" not in shapes:
        raise ConfigError(f"{key}.model", f"model '{model.name}' takes no camera image; the server's streams are "
                                          f"driven by their camera (or, with every input from a file, by their "
                                          f"control timeline)")
    n = len(stream.joint_names)
    for name, shape in shapes.items():
        width = {"state": shape[0], "actions": shape[-1]}.get(name)
        if width is not None and width != n:
            raise ConfigError(f"{key}.joint_names", f"{n} joint names but model '{model.name}' takes {name} of "
                                                    f"{width} columns")
    if model.produces == "actions" and model.spec.actions_shape[-1] != n:
        raise ConfigError(f"{key}.joint_names", f"{n} joint names but model '{model.name}' outputs "
                                                f"{model.spec.actions_shape[-1]} action columns")
    horizon = model.control_horizon
    if stream.execution_horizon > horizon:
        raise ConfigError(f"{key}.execution_horizon", f"{stream.execution_horizon} steps but model '{model.name}' "
                                                      f"plans {horizon}; use 1..{horizon}")
    s = execution_steps(stream, model)
    if stream.extra_delay_steps > min(s, horizon - s):
        raise ConfigError(f"{key}.extra_delay_steps", f"{stream.extra_delay_steps} steps, but a chunk executed for "
                                                      f"{s} of its {horizon} steps can hand off at most "
                                                      f"{min(s, horizon - s)} (d <= s <= H - d)")
    timeline = timeline_interval_ms(stream, model)
    if stream.slo_interval_ms is not None and stream.slo_interval_ms > timeline + 1e-9:
        raise ConfigError(f"{key}.slo_interval_ms", f"{stream.slo_interval_ms:g} ms is longer than the control "
                                                    f"timeline allows: a chunk every {execution_steps(stream, model)} "
                                                    f"steps at {stream.control_rate_hz:g} Hz is {timeline:g} ms "
                                                    f"(lower it, or raise execution_horizon)")



def whole_steps(stream: StreamConfig, model: ModelConfig) -> bool:
    """Whether the stream is released on whole control steps of its timeline (cadence ``timeline`` with a model
    that plans control steps: actions out, or actions to imagine in); a model that plans none (a video trunk)
    is released every SLO interval less the pace margin."""
    plans = model.produces == "actions" or "actions" in model.observation_shapes
    return stream.cadence == "timeline" and plans


def execution_steps(stream: StreamConfig, model: ModelConfig) -> int:
    """s: the control steps each chunk is executed for."""
    return stream.execution_horizon or max(1, model.control_horizon // 2)


def timeline_interval_ms(stream: StreamConfig, model: ModelConfig) -> float:
    """The interval the control timeline needs: s / control_rate."""
    return execution_steps(stream, model) / stream.control_rate_hz * 1e3


def slo_interval_ms(stream: StreamConfig, model: ModelConfig) -> float:
    """The stream's SLO interval: as configured, else its control timeline's."""
    return stream.slo_interval_ms if stream.slo_interval_ms is not None else timeline_interval_ms(stream, model)


def model_label(ref: str, config: ModelConfig) -> str:
    """A model as its config names it (a bundled checkpoint's name, a YAML, a preset), with the network's own
    name where that differs: ``tiny-wam-demo (tiny-wam)``."""
    return ref if not ref or ref == config.name else f"{ref} ({config.name})"


def stream_timeline(stream: StreamConfig, model: ModelConfig, deterministic: bool, slo_ms: float,
                    pace_margin: float) -> ControlTimeline:
    """The stream's control timeline, its SLO interval ``slo_ms`` released ``pace_margin`` early (with cadence
    timeline: whole control steps apart). Deterministic serving (replay equal to the reference) takes no
    hand-off: it depends on measured delays."""
    steps = release_steps(slo_ms, pace_margin, stream.control_rate_hz) if whole_steps(stream, model) else 0
    return ControlTimeline(stream.control_rate_hz, model.control_horizon, execution_steps(stream, model),
                           handoff="none" if deterministic else stream.handoff, extra_delay=stream.extra_delay_steps,
                           lead_s=stream.trajectory_min_lead_s, capture_margin=stream.capture_margin_steps,
                           release_steps=steps)


def check_fit(name: str, stream: StreamConfig, model: ModelConfig) -> None:
    """The stream against its model: Rejected ``timeline`` if its SLO interval or execution horizon does
    not fit the model's control timeline, ``model-mismatch`` if its joints or inputs do not fit."""
    try:
        check_stream_model(f"streams.{name}", stream, model)
    except ConfigError as exc:
        timeline = exc.key.rsplit(".", 1)[-1] in TIMELINE_KEYS
        raise Rejected("timeline" if timeline else "model-mismatch", str(exc)) from None

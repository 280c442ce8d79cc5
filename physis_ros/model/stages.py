"""Running one stage ``(k, b)`` of any servable model, for one task or a batch of tasks.

A task's travelling state is a dict of tensors with a leading batch dimension:
``obs/<name>`` (before the chunk's first stage), ``cond`` (condition tokens),
``x`` (the noisy chunk) and ``h`` (hidden state, between blocks of one step).
Only this state moves between workers; KV caches stay with their stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from physis_ros.model.handoff import Handoff, guide
from physis_ros.model.interface import ServableModel
from physis_ros.model.kv import KVBatch
from physis_ros.model.spec import ModelConfig

OBS_PREFIX = "obs/"


def chunk_input(obs: dict[str, torch.Tensor], noise: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state that enters stage ``(K, 0)``: batched observation tensors and the initial noise."""
    state = {OBS_PREFIX + name: value for name, value in obs.items()}
    state["x"] = noise
    return state


def observation_payload(obs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One unbatched observation as the arrays a chunk's first task carries (float32, batch 1); numpy, so that
    the engine sends it without a torch op (the worker receives tensors)."""
    return {OBS_PREFIX + k: np.ascontiguousarray(v, dtype=np.float32)[None] for k, v in obs.items()}


def first_state(payload: Mapping[str, torch.Tensor], noise: torch.Tensor,
                to_device: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state of stage ``(K, 0)`` from a first task's payload and the chunk's noise."""
    return chunk_input({k[len(OBS_PREFIX):]: to_device(v) for k, v in payload.items()}, noise)


def expected_payload(config: ModelConfig, first: bool, block: int) -> dict[str, tuple[int, ...] | None]:
    """Tensor names a task carries into a stage, with their shapes (None: any shape of batch 1).
    The first task carries the observation; later ones the travelling state."""
    if first:
        return {OBS_PREFIX + k: (1, *shape) for k, shape in config.observation_shapes.items()}
    state: dict[str, tuple[int, ...] | None] = {"cond": None, "x": (1, *config.output_shape)}
    if block > 0:
        state["h"] = (1, config.tokens_per_chunk, config.hidden)
    return state


def check_payload(config: ModelConfig, first: bool, block: int, tensors: Mapping[str, torch.Tensor],
                  dtype: torch.dtype | None = None) -> None:
    """ValueError naming what is wrong unless ``tensors`` is exactly what the stage expects (the travelling
    state in ``dtype``, when given: the model's)."""
    want = expected_payload(config, first, block)
    if set(tensors) != set(want):
        raise ValueError(f"carries tensors {sorted(tensors)}, stage expects {sorted(want)}")
    for name, shape in want.items():
        got = tuple(tensors[name].shape)
        if (shape is None and (len(got) != 3 or got[0] != 1 or got[2] != config.hidden)) or \
                (shape is not None and got != shape):
            raise ValueError(f"tensor '{name}' has shape {list(got)}, expected {list(shape or (1, '*', config.hidden))}")
        if tensors[name].dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"tensor '{name}' has dtype {tensors[name].dtype}, expected a float type")
        if dtype is not None and not first and tensors[name].dtype != dtype:
            raise ValueError(f"tensor '{name}' has dtype {tensors[name].dtype}, the model's states are {dtype}")


def _encode_pending(model: ServableModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if "cond" in state:
        return state
    obs = {k[len(OBS_PREFIX):]: v for k, v in state.items() if k.startswith(OBS_PREFIX)}
    return {"cond": model.encode(obs), "x": state["x"]}


def stack_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if len(states) == 1:
        return states[0]
    return {key: torch.cat([s[key] for s in states], dim=0) for key in states[0]}


def split_state(state: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    if n == 1:
        return [state]
    return [{key: value[i:i + 1] for key, value in state.items()} for i in range(n)]


def denoise_update(model: ServableModel, x: torch.Tensor, v: torch.Tensor, k: torch.Tensor, kv: KVBatch,
                   handoffs: list[Handoff | None] | None) -> torch.Tensor:
    """The Euler step at the end of a denoising step, with the hand-off for the tasks that carry one:
    their chunks are guided towards the clean estimate their slot's previous chunk left at this step,
    and leave theirs for the next (``kv.table.actions``)."""
    x_next = model.timesteps.update(x, v, k)
    if not handoffs or model.action_rows() is None:
        return x_next
    spec = model.config.spec
    actions = spec.actions_of        # the action rows of a chunk (the chunk itself, or its actions part)
    ts = model.timesteps.t
    rows = []
    for i, h in enumerate(handoffs):
        if h is None or h.mode == "none":
            rows.append(x_next[i])
            continue
        slot, step = kv.slots[i], int(k[i])
        new, clean = guide(actions(x[i]), actions(v[i]), float(ts[step]), float(ts[step - 1]),
                           kv.table.actions.get((slot, step)), h, len(ts) - 1)
        kv.table.actions[slot, step] = clean
        if spec.parts:                # the other parts take the plain Euler step
            new = torch.cat([new.flatten(), x_next[i, new.numel():]])
        rows.append(new)
    return torch.stack(rows)


@torch.no_grad()
def run_stage(model: ServableModel, b: int, steps: list[int], states: list[dict[str, torch.Tensor]],
              kv: KVBatch, handoffs: list[Handoff | None] | None = None) -> list[dict[str, torch.Tensor]]:
    """Run block ``b`` for tasks at denoising steps ``steps`` (one per task, any mix of steps; step 0 is the
    clean pass of a model with the ``clean`` history rule: the finished chunk at t = 0, writing the K/V later
    chunks read, with no head).

    Each task's state has batch size 1; ``kv.slots[i]`` is task i's slot; ``handoffs[i]`` its
    chunk's hand-off (applied where block ``b`` is the last, the head of a step).
    With one task this performs exactly the operations of the sequential
    reference loop, so results are bit-identical to it.
    """
    last = model.config.blocks - 1
    if b == 0:
        states = [_encode_pending(model, s) for s in states]
    state = stack_states(states)
    k = torch.tensor(steps, dtype=torch.long, device=state["x"].device)
    t = model.timesteps.timestep(k)
    cfg = model.config
    if cfg.history == "clean":      # denoising steps read the clean K/V; only the clean pass (step 0) writes
        kv = KVBatch(kv.table, kv.slots, [s == 0 for s in steps])
    elif cfg.history == "latest":   # each step writes its own slot and reads older chunks' later versions
        kv = kv.with_latest_sources(steps, cfg.latest_version, cfg.window)
    h = model.embed(state["cond"], state["x"], t) if b == 0 else state["h"]
    h = model.block(b, h, t, kv)
    if b < last:
        return split_state({"cond": state["cond"], "x": state["x"], "h": h}, len(states))
    noisy = [i for i, s in enumerate(steps) if s > 0]     # the clean pass ends with no head: its chunk is done
    x = state["x"]
    if len(noisy) == len(steps):
        x = denoise_update(model, x, model.head(h, t), k, kv, handoffs)
    elif noisy:
        rows = torch.tensor(noisy, device=x.device)
        x = x.clone()
        x[rows] = denoise_update(model, x[rows], model.head(h[rows], t[rows]), k[rows],
                                 KVBatch(kv.table, [kv.slots[i] for i in noisy]),
                                 [handoffs[i] for i in noisy] if handoffs else None)
    return split_state({"cond": state["cond"], "x": x}, len(states))

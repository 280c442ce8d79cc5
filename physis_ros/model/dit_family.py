"""physis_ros's own model families, the tiny DiT with a world-action head (``wam``) or an action-conditioned
world-model head (``acwm``), as setup.py registers them under the entry point group ``physis_ros.models``.
Torch-free: the model classes are imported when a model is first built."""

from __future__ import annotations

from physis_ros.model.families import ModelFamily
from physis_ros.model.spec import ModelConfig, ModelSpec, section_spec


def dit_block_params(config: ModelConfig) -> int:
    """Parameters of one DiT block: attention (qkv, projection), MLP, adaLN modulation (6 vectors)."""
    d, f = config.hidden, config.ffn_dim
    return (4 * d * d + 4 * d) + (2 * d * f + f + d) + (6 * d * d + 6 * d)


def dit_spec(config: ModelConfig) -> ModelSpec:
    """The DiT's spec: the I/O of its ``wam:``/``acwm:`` section, its block's parameters, the same_step rule."""
    return section_spec(config, block_params=dit_block_params(config))


WAM = ModelFamily("wam", "physis_ros.model.wam:WAMModel", dit_spec,
                  "tiny DiT world-action model: camera image and joint state in, an action chunk [horizon, dof] out")
ACWM = ModelFamily("acwm", "physis_ros.model.acwm:ACWMModel", dit_spec,
                   "tiny DiT action-conditioned world model: camera image, joint state and an action chunk in, "
                   "predicted latent frames out")

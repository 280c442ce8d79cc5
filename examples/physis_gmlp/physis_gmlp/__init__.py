"""physis-gmlp: a model family of its own, served by physis_ros through its plug-in contract.

A gated-MLP transformer policy: the camera image cut into patches by a linear map, the joint state one token,
the noisy action chunk one token per row; the denoising timestep is added to every token once, in
:meth:`GatedPolicy.embed` (no per-block modulation, unlike physis_ros's DiT); each block is an RMS-normed
attention over the chunk's own tokens and its stage's cached K/V of earlier chunks, then an RMS-normed
SwiGLU MLP. What physis_ros needs from a family (``physis_ros.model.interface.ServableModel``):

- ``encode(obs)``: observation tensors (``config.observation_shapes``, batched) -> condition tokens [B, Tc, D]
- ``embed(cond, x, t)``: condition tokens + noisy chunk [B, *output_shape] at timesteps t [B] -> hidden [B, T, D]
- ``block(b, h, t, kv)``: block b on the hidden state, reading then appending each sample's K/V slot
- ``head(h, t)``: hidden -> velocity [B, *output_shape] (the server integrates it over ``config.steps``)
- ``new_block(b)``, ``attach_blocks``, ``release_blocks``: a worker builds only the blocks placed on it (the
  base class's ``build_blocks`` calls ``new_block``), while others run; each module is initialised from its
  own seed, so any subset has the full model's weights
- ``action_rows()``: leading output rows that are control actions (the hand-off between chunks applies to them)

``FAMILY`` is what the entry point ``physis_ros.models: gmlp`` names (pyproject.toml). This module stays
light (no torch): physis_ros reads a family's ``spec`` (``physis_ros.model.spec.ModelSpec``: inputs and output,
tokens per chunk, K/V per slot, parameters and FLOPs per block, history rule) whenever it loads a config, and
imports the model class (``physis_gmlp.model``) only to build one.
"""

from __future__ import annotations

from physis_ros.model.families import ModelFamily
from physis_ros.model.spec import section_spec


def gmlp_block_params(config) -> int:
    """Parameters of one GatedBlock: two RMS norms, qkv and projection (no biases), the SwiGLU MLP."""
    d, f = config.hidden, config.ffn_dim
    return 2 * d + 4 * d * d + 3 * d * f


def gmlp_spec(config):
    """Image and state in, ``[horizon, dof]`` actions out (the config's ``wam:`` section); one token per image
    patch, one for the state, one per action row; the GatedBlock's parameters; history by the same_step rule."""
    io = config.wam
    tokens = (io.image_size // io.patch) ** 2 + 1 + io.horizon
    return section_spec(config, block_params=gmlp_block_params(config), tokens_per_chunk=tokens)


FAMILY = ModelFamily("gmlp", "physis_gmlp.model:GatedPolicy", gmlp_spec,
                     "gated-MLP transformer policy (physis-gmlp): image + state in, actions out")

"""Tiny Wan transformers that diffusers itself builds and saves, for the tests of the Wan family: every parameter
random (the scale-shift tables included, which diffusers' init leaves near zero), seeded; and diffusers' own
attention processor with a mask and per-chunk conditioning, for whole-sequence recomputes of served Wan models."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, cross_attn_norm=True, rope_max_seq_len=32)


def tiny_wan(seed: int = 0, **config):
    """A ``WanTransformer3DModel`` of the TINY config (``config`` overrides keys), in eval mode."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**TINY, **config}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def save_tiny_wan(path: Path, seed: int = 0, **config):
    """:func:`tiny_wan` saved by diffusers' ``save_pretrained`` at ``path``; returns the model."""
    model = tiny_wan(seed, **config)
    model.save_pretrained(path)
    return model


class MaskedProcessor:
    """diffusers' own Wan attention processor with an attention mask over the whole sequence (the block
    passes none to its self-attention)."""

    def __init__(self, mask):
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        self.inner, self.mask = WanAttnProcessor(), mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.inner(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


class PerChunkCross:
    """diffusers' own cross-attention processor, each chunk's tokens to that chunk's own conditioning."""

    def __init__(self, contexts: list, per_chunk: int):
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        self.inner, self.contexts, self.per_chunk = WanAttnProcessor(), contexts, per_chunk

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        import torch

        parts = hidden_states.split(self.per_chunk, dim=1)
        return torch.cat([self.inner(attn, part, ctx) for part, ctx in zip(parts, self.contexts)], dim=1)


@contextmanager
def recompute_processors(blocks, mask, contexts: list, per_chunk: int):
    """``blocks`` with diffusers' own processors for a whole-sequence recompute (self-attention under ``mask``,
    each chunk's cross-attention to its own conditioning) while in the block; their own processors after."""
    saved = [(blk.attn1.processor, blk.attn2.processor) for blk in blocks]
    for blk in blocks:
        blk.attn1.set_processor(MaskedProcessor(mask))
        blk.attn2.set_processor(PerChunkCross(contexts, per_chunk))
    try:
        yield
    finally:
        for blk, (a, b) in zip(blocks, saved):
            blk.attn1.set_processor(a)
            blk.attn2.set_processor(b)


class StagedStreams:
    """Streams of ``model`` run stage by stage through ``run_stage`` (the workers' code) over K/V tables of
    their own, the tasks of the streams given to :meth:`run` batched in each call (time-sharing): chunk ``c`` of
    stream ``s`` reads ``observe(s, c)`` and the noise of ``seed``; ``outputs[s]`` collects each chunk."""

    def __init__(self, model, streams: list[str], observe, seed: int):
        cfg = model.config
        self.model, self.observe, self.seed = model, observe, seed
        self.clean = cfg.clean_pass
        self.per_stream = 1 if self.clean else cfg.steps
        self.tables = [model.new_kv_table(b, self.per_stream * len(streams)) for b in range(cfg.blocks)]
        self.index = {s: i for i, s in enumerate(streams)}
        self.chunk = dict.fromkeys(streams, 0)
        self.outputs: dict[str, list] = {s: [] for s in streams}

    def run(self, streams: list[str]) -> None:
        from physis_ros.model.kv import KVBatch
        from physis_ros.model.stages import chunk_input, run_stage

        model, cfg = self.model, self.model.config
        states = {s: chunk_input(model.observation_tensors(self.observe(s, self.chunk[s])),
                                 model.noise(self.seed, s, self.chunk[s])) for s in streams}
        for k in list(range(cfg.steps, 0, -1)) + ([0] if self.clean else []):
            for b in range(cfg.blocks):
                slots = [self.index[s] * self.per_stream + (0 if self.clean else k - 1) for s in streams]
                states = dict(zip(streams, run_stage(model, b, [k] * len(streams), [states[s] for s in streams],
                                                     KVBatch(self.tables[b], slots))))
        for s in streams:
            self.outputs[s].append(states[s]["x"][0])
            self.chunk[s] += 1

    def check_staggered(self, expected: dict[str, list]) -> None:
        """Streams "b" alone for one chunk, then "a" and "b" batched twice (a batch of chunks 0 and 1, then 1 and
        2): b's chunk 0 equals ``expected["b"][0]`` bit for bit, every batched chunk ``expected`` within 1e-5."""
        import torch

        self.run(["b"])
        assert torch.equal(self.outputs["b"][0], expected["b"][0])
        for _ in range(2):
            self.run(["a", "b"])
        for s, offset in (("a", 0), ("b", 1)):
            for c in range(2):
                got, want = self.outputs[s][c + offset], expected[s][c + offset]
                assert torch.allclose(got, want, rtol=0, atol=1e-5), (s, c, float((got - want).abs().max()))

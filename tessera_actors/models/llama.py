"""Llama-3.1 architecture (GQA, RoPE with optional llama3 scaling, SwiGLU,
RMSNorm, static KV cache), own code.

Inputs (see ``example_inputs``):
  ``input_ids`` int64 [B, T]; ``positions`` int64 [B] (decode, T == 1) or
  [B, T] - the absolute position of every input token. Output: logits
  float [B, T, vocab] in the model dtype.
State: ``layers.{i}.attn.k_cache`` / ``v_cache`` [max_batch, max_seq, kv, hd].
Prefilling a prompt token by token with decode steps and prefilling it at once
give the same cache and the same last logits.
Serving inputs (optional): ``rows`` int64 [B], the KV-cache row of each batch
row (default: rows 0..B-1), and ``last`` int64 [B], the index within T of the
one token per row whose logits are wanted (output [B, 1, vocab]; the LM head
runs on that token only, as a prompt chunk needs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tessera_actors.models.attention import CachedAttention
from tessera_actors.models.common import (ReferenceModel, RMSNorm, SwiGLU, add_lm_stack, example_ids, lm_positions,
                     rope_full_width, rope_inv_freq, rope_tables)


@dataclass
class LlamaConfig:
    """Llama decoder hyper-parameters. ``max_batch`` x ``max_seq`` sizes the
    static KV cache (and ``max_seq`` the RoPE table)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None
    ffn_dim: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_embeddings: bool = False
    max_batch: int = 4
    max_seq: int = 64

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                     "head_dim", "ffn_dim", "max_batch", "max_seq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        return cls(**overrides)

    @classmethod
    def llama_3_1_8b(cls, **overrides) -> "LlamaConfig":
        cfg = dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                   ffn_dim=14336, norm_eps=1e-5, rope_theta=500000.0,
                   rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position=8192),
                   max_batch=8, max_seq=2048)
        cfg.update(overrides)
        return cls(**cfg)

    @classmethod
    def llama_2_7b(cls, **overrides) -> "LlamaConfig":
        cfg = dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                   ffn_dim=11008, norm_eps=1e-5, rope_theta=10000.0, max_batch=8, max_seq=2048)
        cfg.update(overrides)
        return cls(**cfg)

    @classmethod
    def smollm2_135m(cls, **overrides) -> "LlamaConfig":
        cfg = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                   ffn_dim=1536, norm_eps=1e-5, rope_theta=100000.0, tie_embeddings=True,
                   max_batch=4, max_seq=512)
        cfg.update(overrides)
        return cls(**cfg)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = CachedAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                    cfg.max_batch, cfg.max_seq)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                rows: Tensor | None = None, masks: dict | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, rows, masks)
        return x + self.ffn(self.ffn_norm(x))


class LlamaDecoder(nn.Module):
    """The decoder stack on embeddings: ``forward(h [B,T,D], positions [B,T])
    -> logits [B,T,V]``. Used by ``Llama`` and by the VLM (which feeds image
    tokens as embeddings).  With ``pool`` set (a capture-time constant, as
    the serving engine's embedding buckets set it) it returns instead the
    final-norm hidden states summed over the tokens up to ``last`` [B, 1, D]
    (the engine divides by their count: a mean-pooled embedding).
    ``fewest_ops`` (``common.use_fewest_ops``): the rotary tables of a step
    at full width, for the four-op rotary of every layer."""

    fewest_ops = False

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        add_lm_stack(self, cfg, lambda: LlamaBlock(cfg))
        cos, sin = rope_tables(cfg.max_seq, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.pool = False

    def forward(self, h: Tensor, positions: Tensor, rows: Tensor | None = None,
                last: Tensor | None = None) -> Tensor:
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if self.fewest_ops:
            cos, sin = rope_full_width(cos, sin)
        masks: dict = {}   # what the layers of this step share (its attention mask), made by the first layer
        for layer in self.layers:
            h = layer(h, cos, sin, positions, rows, masks)
        if self.pool:
            real = torch.arange(h.shape[1], device=h.device)[None, :] <= last.view(-1, 1)
            return (self.norm(h) * real[..., None].to(h.dtype)).sum(dim=1, keepdim=True)
        if last is not None:
            B, _, D = h.shape
            h = h.gather(1, last.view(B, 1, 1).expand(B, 1, D))
        return self.lm_head(self.norm(h))


def normalize_positions(positions: Tensor, batch: int, seq: int) -> Tensor:
    """Accept [B] (decode) or [B, T]; return [B, T] (shape logic only)."""
    if positions.dim() == 1:
        positions = positions[:, None]
    if tuple(positions.shape) != (batch, seq):
        raise ValueError(f"positions shape {tuple(positions.shape)} does not match tokens ({batch}, {seq})")
    return positions


class Llama(ReferenceModel):
    """Llama causal LM with a static KV cache; see the module docstring."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.decoder = LlamaDecoder(cfg)

    def forward(self, input_ids: Tensor, positions: Tensor, rows: Tensor | None = None,
                last: Tensor | None = None) -> Tensor:
        B, T = input_ids.shape
        positions = normalize_positions(positions, B, T)
        return self.decoder(self.decoder.embed(input_ids), positions, rows, last)

    def example_inputs(self, kind: str, batch: int, seq: int = 1, pos: int = 0) -> dict[str, Tensor]:
        """``decode``: input_ids [B,1], positions [B] (= pos);
        ``prefill``: input_ids [B,seq], positions [B,seq] (= pos..pos+seq-1)."""
        tokens = 1 if kind == "decode" else seq
        if pos + tokens > self.cfg.max_seq:
            raise ValueError(f"positions up to {pos + tokens - 1} exceed max_seq={self.cfg.max_seq}")
        device = self.decoder.embed.weight.device
        positions = lm_positions(kind, batch, seq, pos, device)
        return {"input_ids": example_ids(self.cfg.vocab_size, (batch, tokens), device),
                "positions": positions}

"""Vision-language model (LLaVA-1.5 style), own code: a ViT encoder whose patch
features go through a 2-layer MLP projector into a Llama decoder as image tokens.

Inputs:
  prefill: ``pixel_values`` float [B, 3, H, W], ``input_ids`` [B, T],
    ``positions`` [B, n_image_tokens + T]. The sequence is the image tokens
    followed by the text tokens; positions cover both (usually pos..).
  decode: ``input_ids`` [B, 1], ``positions`` [B] - plain Llama decode over the
    KV cache that the prefill filled.
Output: logits [B, n_image_tokens + T, vocab] (prefill) or [B, 1, vocab].
State: the decoder's KV caches (``decoder.layers.{i}.attn.k_cache`` ...).
The ViT is CLIP-like (pre-norm LayerNorm blocks with biases, class token,
learned position embedding, quick-GELU); all its layers run and the patch
tokens of the last layer (class token dropped) are projected.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tessera_actors.models.common import ReferenceModel, example_ids, lm_positions
from tessera_actors.models.llama import LlamaConfig, LlamaDecoder, normalize_positions


@dataclass
class VLMConfig:
    image_size: int = 16
    patch: int = 4
    vis_dim: int = 32
    vis_layers: int = 2
    vis_heads: int = 2
    vis_mlp: int = 64
    text: LlamaConfig = field(default_factory=LlamaConfig.tiny)

    def __post_init__(self):
        if self.image_size % self.patch:
            raise ValueError(f"image_size={self.image_size} is not a multiple of patch={self.patch}")
        if self.vis_dim % self.vis_heads:
            raise ValueError(f"vis_dim={self.vis_dim} is not a multiple of vis_heads={self.vis_heads}")

    @property
    def n_image_tokens(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def vocab_size(self) -> int:
        """The text decoder's vocabulary (what the serving engine samples from)."""
        return self.text.vocab_size

    @classmethod
    def tiny(cls, **overrides) -> "VLMConfig":
        """Tiny ViT + tiny Llama; the decoder's fields (``max_batch``,
        ``max_seq``, ``n_layers``, ...) go to the decoder."""
        return cls(text=_text(LlamaConfig.tiny, overrides), **overrides)

    @classmethod
    def llava_1_5_7b(cls, **overrides) -> "VLMConfig":
        """CLIP ViT-L/14 at 336 px (576 image tokens) + Llama-2-7B (Vicuna)
        decoder; the decoder's fields (``max_batch``, ``max_seq``,
        ``n_layers``, ...) go to the decoder."""
        text = _text(LlamaConfig.llama_2_7b, overrides)
        cfg = dict(image_size=336, patch=14, vis_dim=1024, vis_layers=24, vis_heads=16, vis_mlp=4096)
        cfg.update(overrides)
        return cls(text=text, **cfg)


def _text(make, overrides: dict) -> LlamaConfig:
    """The text decoder's config: ``overrides["text"]`` or ``make()``, with
    the fields of ``overrides`` that are the decoder's (not the VLM's own)
    popped and applied - so the engine's ``max_batch``/``max_seq`` and a
    user's ``n_layers`` size the decoder."""
    own = {f.name for f in dataclasses.fields(VLMConfig)}
    mine = {k: overrides.pop(k) for k in list(overrides)
            if k not in own and k in {f.name for f in dataclasses.fields(LlamaConfig)}}
    text = overrides.pop("text", None)
    return dataclasses.replace(text, **mine) if text is not None else make(**mine)


class VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, N, D = x.shape
        hd = D // self.heads
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        probs = torch.softmax((torch.matmul(q, k.transpose(-1, -2)) * hd ** -0.5).float(), dim=-1)
        attn = torch.matmul(probs.to(v.dtype), v).transpose(1, 2).reshape(B, N, D)
        x = x + self.proj(attn)
        h = self.fc1(self.norm2(x))
        return x + self.fc2(h * torch.sigmoid(1.702 * h))  # quick-GELU


class VisionEncoder(nn.Module):
    """``forward(pixels [B,3,H,W]) -> patch features [B, n_patches, vis_dim]``."""

    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(3 * cfg.patch * cfg.patch, cfg.vis_dim, bias=False)
        self.cls = nn.Parameter(torch.empty(cfg.vis_dim))
        self.pos_embed = nn.Parameter(torch.empty(cfg.n_image_tokens + 1, cfg.vis_dim))
        self.pre_norm = nn.LayerNorm(cfg.vis_dim, eps=1e-5)
        self.blocks = nn.ModuleList(VitBlock(cfg.vis_dim, cfg.vis_heads, cfg.vis_mlp)
                                    for _ in range(cfg.vis_layers))

    def forward(self, pixels: Tensor) -> Tensor:
        B, C, H, W = pixels.shape
        p = self.cfg.patch
        if H != self.cfg.image_size or W != self.cfg.image_size:
            raise ValueError(f"expected {self.cfg.image_size}px images, got {H}x{W}")
        patches = pixels.view(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_embed(patches.reshape(B, (H // p) * (W // p), C * p * p))
        x = torch.cat([self.cls.view(1, 1, -1).expand(B, 1, -1), x], dim=1) + self.pos_embed
        x = self.pre_norm(x)
        for block in self.blocks:
            x = block(x)
        return x[:, 1:]


class VLM(ReferenceModel):
    """ViT -> MLP projector -> Llama decoder; see the module docstring."""

    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionEncoder(cfg)
        self.projector = nn.Sequential(nn.Linear(cfg.vis_dim, cfg.text.dim), nn.GELU(),
                                       nn.Linear(cfg.text.dim, cfg.text.dim))
        self.decoder = LlamaDecoder(cfg.text)

    def forward(self, input_ids: Tensor, positions: Tensor, rows: Tensor | None = None, last: Tensor | None = None,
                pixel_values: Tensor | None = None) -> Tensor:
        """``rows``/``last`` as ``Llama.forward`` (serving: text steps; an image
        prefix comes with ``pixel_values``)."""
        h = self.decoder.embed(input_ids)
        if pixel_values is not None:  # structural (input present), not a value branch
            image = self.projector(self.vision(pixel_values.to(h.dtype)))
            h = torch.cat([image, h], dim=1)
        B, T = h.shape[:2]
        return self.decoder(h, normalize_positions(positions, B, T), rows, last)

    def example_inputs(self, kind: str, batch: int, seq: int = 1, pos: int = 0,
                       image: bool = True) -> dict[str, Tensor]:
        """``prefill``: pixel_values + ``seq`` text tokens, positions over
        n_image_tokens + seq from ``pos`` (``image=False``: the ``seq`` text
        tokens alone, as the serving engine's prompt chunks); ``decode``: as
        Llama."""
        device = self.decoder.embed.weight.device
        vocab = self.cfg.text.vocab_size
        if kind == "decode" or (kind == "prefill" and not image):
            tokens = 1 if kind == "decode" else seq
            return {"input_ids": example_ids(vocab, (batch, tokens), device),
                    "positions": lm_positions(kind, batch, seq, pos, device)}
        if kind != "prefill":
            raise ValueError(f"unknown input kind {kind!r} (expected 'decode' or 'prefill')")
        total = self.cfg.n_image_tokens + seq
        if pos + total > self.cfg.text.max_seq:
            raise ValueError(f"{total} tokens from position {pos} exceed max_seq={self.cfg.text.max_seq}")
        gen = torch.Generator(device="cpu").manual_seed(4321)
        size = self.cfg.image_size
        pixels = torch.randn(batch, 3, size, size, generator=gen).to(device=device, dtype=self.dtype)
        return {"input_ids": example_ids(vocab, (batch, seq), device),
                "positions": lm_positions("prefill", batch, total, pos, device),
                "pixel_values": pixels}

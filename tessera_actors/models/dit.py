"""Diffusion transformer (DiT, class-conditional, adaLN-zero blocks), own code.

``forward(latents [B,C,H,W], timestep [B] float, labels [B] int64)
-> [B, C_out, H, W]`` with ``C_out = 2C`` when ``learn_sigma`` (noise and
variance prediction, as DiT). One forward is one denoising step; a sampler
loop calls it repeatedly. No state (``state_names() == []``).

Structure: patchify (linear on p x p patches) + fixed 2-D sin-cos position
embedding (a float32 constant); conditioning ``c = MLP(sinusoid(t)) +
embed(label)`` (label ``num_classes`` is the classifier-free-guidance null
class); each block modulates LayerNorm outputs with shift/scale/gate from
``Linear(silu(c))`` ("adaLN"); a final adaLN layer and a linear unpatchify.
DiT initialises the modulation and output layers to zero ("adaLN-zero");
with ``zero_init=False`` (default here) they are random like everything else,
so every op influences the output - better for checking captured programs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera_actors.models.common import ReferenceModel


@dataclass
class DiTConfig:
    input_size: int = 8
    patch: int = 2
    in_channels: int = 4
    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: float = 4.0
    num_classes: int = 10
    learn_sigma: bool = True
    freq_dim: int = 256
    zero_init: bool = False

    def __post_init__(self):
        if self.input_size % self.patch:
            raise ValueError(f"input_size={self.input_size} is not a multiple of patch={self.patch}")
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} is not a multiple of heads={self.heads}")
        if self.dim % 4:
            raise ValueError(f"dim={self.dim} must be a multiple of 4 (2-D sin-cos embedding)")

    @property
    def out_channels(self) -> int:
        return self.in_channels * (2 if self.learn_sigma else 1)

    @classmethod
    def tiny(cls, **overrides) -> "DiTConfig":
        return cls(**overrides)

    @classmethod
    def dit_xl_2(cls, **overrides) -> "DiTConfig":
        """DiT-XL/2 at 256 px (32x32x4 latents, 256 tokens)."""
        cfg = dict(input_size=32, patch=2, in_channels=4, dim=1152, depth=28, heads=16,
                   num_classes=1000)
        cfg.update(overrides)
        return cls(**cfg)


def sincos_2d(dim: int, grid: int) -> Tensor:
    """Fixed 2-D sin-cos position embedding [grid*grid, dim] (float32)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    coords = torch.arange(grid, dtype=torch.float64)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")

    def embed(pos: Tensor) -> Tensor:
        angles = pos.reshape(-1)[:, None] * omega[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([embed(ys), embed(xs)], dim=1).float()


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d, hidden = cfg.dim, int(cfg.dim * cfg.mlp_ratio)
        self.heads = cfg.heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.adaln = nn.Linear(d, 6 * d)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        B, N, D = x.shape
        hd = D // self.heads
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(F.silu(c)).chunk(6, dim=-1)
        h = modulate(F.layer_norm(x, (D,), eps=1e-6), shift1, scale1)
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        probs = torch.softmax((torch.matmul(q, k.transpose(-1, -2)) * hd ** -0.5).float(), dim=-1)
        attn = torch.matmul(probs.to(v.dtype), v).transpose(1, 2).reshape(B, N, D)
        x = x + gate1[:, None] * self.proj(attn)
        h = modulate(F.layer_norm(x, (D,), eps=1e-6), shift2, scale2)
        return x + gate2[:, None] * self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class DiT(ReferenceModel):
    """DiT denoiser; see the module docstring."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        d, p = cfg.dim, cfg.patch
        self.patch_embed = nn.Linear(cfg.in_channels * p * p, d)
        self.t_fc1 = nn.Linear(cfg.freq_dim, d)
        self.t_fc2 = nn.Linear(d, d)
        self.label_embed = nn.Embedding(cfg.num_classes + 1, d)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.final_adaln = nn.Linear(d, 2 * d)
        self.final = nn.Linear(d, p * p * cfg.out_channels)
        half = cfg.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("t_freqs", freqs, persistent=False)
        self.register_buffer("pos_embed", sincos_2d(d, cfg.input_size // p), persistent=False)

    @torch.no_grad()
    def _init_special(self, gen: torch.Generator) -> None:
        if self.cfg.zero_init:
            for block in self.blocks:
                block.adaln.weight.zero_()
                block.adaln.bias.zero_()
            for layer in (self.final_adaln, self.final):
                layer.weight.zero_()
                layer.bias.zero_()

    def forward(self, latents: Tensor, timestep: Tensor, labels: Tensor) -> Tensor:
        cfg, p = self.cfg, self.cfg.patch
        B, C, H, W = latents.shape
        gh, gw = H // p, W // p
        dtype = self.patch_embed.weight.dtype
        patches = latents.view(B, C, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1).reshape(B, gh * gw, p * p * C)
        x = self.patch_embed(patches.to(dtype)) + self.pos_embed.to(dtype)

        args = timestep.float()[:, None] * self.t_freqs[None]
        t_freq = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(dtype)
        c = self.t_fc2(F.silu(self.t_fc1(t_freq))) + self.label_embed(labels)

        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_adaln(F.silu(c)).chunk(2, dim=-1)
        x = self.final(modulate(F.layer_norm(x, (cfg.dim,), eps=1e-6), shift, scale))
        out = x.view(B, gh, gw, p, p, cfg.out_channels).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(B, cfg.out_channels, H, W)

    def example_inputs(self, kind: str, batch: int, seq: int = 1, pos: int = 0) -> dict[str, Tensor]:
        """``denoise``: latents [B, C, S, S] (model dtype), timestep [B] float32
        in [0, 1000), labels [B] int64 (``seq``/``pos`` are ignored)."""
        if kind != "denoise":
            raise ValueError(f"unknown input kind {kind!r} for DiT (expected 'denoise')")
        gen = torch.Generator(device="cpu").manual_seed(2024)
        cfg, device = self.cfg, self.patch_embed.weight.device
        s = cfg.input_size
        return {"latents": torch.randn(batch, cfg.in_channels, s, s, generator=gen).to(device, self.dtype),
                "timestep": (torch.rand(batch, generator=gen) * 1000).to(device),
                "labels": torch.randint(0, cfg.num_classes, (batch,), generator=gen).to(device)}

"""GPT-oss-20B-like mixture-of-experts decoder, own code.

Architecture (as GPT-oss): GQA attention with biases and learned attention
sinks, sliding-window attention on every other layer, RMSNorm, a linear router
with bias choosing ``top_k`` of ``n_experts`` experts per token, softmax over
the chosen logits, experts with the clamped GPT-oss SwiGLU
(``(up + 1) * gate * sigmoid(alpha * gate)``). RoPE uses plain theta (GPT-oss'
YaRN context extension is left out: it only changes the constant table).

Static-shape expert dispatch (``MoEConfig.dispatch``):
  ``"grouped"`` (default): real top-k dispatch.  The N*k (token, expert)
    pairs are sorted by expert (stable sort), the tokens gathered in that
    order, and each expert's rows multiplied by its weights with one grouped
    GEMM (``torch._grouped_mm``, offsets = running count of rows per
    expert) for gate/up and one for down; the rows are put back in token
    order by the inverse permutation and combined with the softmax weights.
    Shapes are static ([N*k, ...] whatever the routing); only offsets and
    indices carry the routing, as values.  Each expert's weights are read
    once, and only the FLOPs of the chosen experts are spent.  Needs rows
    16-byte aligned (``dim``, ``expert_dim`` multiples of 8); on CUDA the
    grouped GEMM is a bf16 kernel, so other dtypes there (and on the meta
    device) take ``"gather"``.
  ``"dense"``: every expert runs on every token as one batched matmul over
    the expert dimension, combined with a sparse gate matrix [N, E]; wastes
    E/k x FLOPs (kept as a baseline).
  ``"gather"``: the top-k experts' weights are gathered per token
    (``W[topk_idx]``: [N, k, ...]) and applied with batched matmuls. Reads
    N*k expert matrices: fine for batch-1 decode, worse beyond E/k tokens.
Inputs/outputs/state are those of ``Llama`` (see ``llama.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tessera_actors.models.attention import CachedAttention
from tessera_actors.models.common import ReferenceModel, RMSNorm, example_ids, lm_positions, rope_inv_freq, rope_tables
from tessera_actors.models.llama import normalize_positions


@dataclass
class MoEConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    n_experts: int = 8
    top_k: int = 2
    expert_dim: int = 64
    sliding_window: int | None = 8
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    dispatch: str = "grouped"
    expert_parts: int = 1       # > 1: each layer's routed experts as that many stacked tensors (placed apart)
    max_batch: int = 4
    max_seq: int = 64

    def __post_init__(self):
        if self.dispatch not in ("grouped", "dense", "gather"):
            raise ValueError(f"MoEConfig.dispatch must be 'grouped', 'dense' or 'gather', got {self.dispatch!r}")
        if self.dispatch == "grouped" and (self.dim % 8 or self.expert_dim % 8):
            raise ValueError(f"grouped dispatch needs dim and expert_dim multiples of 8 (16-byte rows), "
                             f"got {self.dim}, {self.expert_dim}")
        if self.expert_parts < 1 or self.n_experts % self.expert_parts:
            raise ValueError(f"expert_parts={self.expert_parts} must divide n_experts={self.n_experts}")
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")

    @classmethod
    def tiny(cls, **overrides) -> "MoEConfig":
        return cls(**overrides)

    @classmethod
    def gpt_oss_20b(cls, **overrides) -> "MoEConfig":
        cfg = dict(vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
                   n_experts=32, top_k=4, expert_dim=2880, sliding_window=128,
                   rope_theta=150000.0, max_batch=8, max_seq=2048)
        cfg.update(overrides)
        return cls(**cfg)

    @classmethod
    def qwen3_235b_a22b(cls, **overrides) -> "MoEConfig":
        """Qwen3-235B-A22B's shapes (94 layers, 128 experts, 8 active, GQA
        64/4 heads of 128) on this GPT-oss-style block: for planning at the
        paper's 16-GPU scale, not a Qwen3 implementation (no sinks or biases
        there, and no sliding window: every layer attends to the whole cache)."""
        cfg = dict(vocab_size=151936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
                   n_experts=128, top_k=8, expert_dim=1536, sliding_window=None,
                   rope_theta=1000000.0, max_batch=8, max_seq=2048)
        cfg.update(overrides)
        return cls(**cfg)


class Experts(nn.Module):
    """Router + ``n_experts`` GPT-oss experts; ``forward(x [B,T,D]) -> [B,T,D]``.

    With ``expert_parts`` P > 1 the routed experts' matrices are P stacked
    tensors of ``n_experts / P`` consecutive experts each (``gate_up.0`` ..,
    ``down.0`` .., their biases likewise): each part is its own pair of
    grouped GEMMs, so a planner can keep one part on the GPU, stream
    another and compute a third on the CPU (:mod:`.moe_load` gives each
    part's share of the tokens)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        E, D, I, P = cfg.n_experts, cfg.dim, cfg.expert_dim, cfg.expert_parts
        self.router = nn.Linear(D, E, bias=True)
        # gate/up interleaved along the last dim: gate = [..., 0::2], up = [..., 1::2]
        def stacked(*shape: int):   # [E, *shape], or P parts of [E / P, *shape]
            if P == 1:
                return nn.Parameter(torch.empty(E, *shape))
            return nn.ParameterList(nn.Parameter(torch.empty(E // P, *shape)) for _ in range(P))
        self.gate_up = stacked(D, 2 * I)
        self.gate_up_bias = stacked(2 * I)
        self.down = stacked(I, D)
        self.down_bias = stacked(D)

    def _whole(self, name: str) -> Tensor:
        """The stacked [E, ...] tensor of ``gate_up``, ``down`` or a bias (a copy when in parts)."""
        w = getattr(self, name)
        return w if isinstance(w, Tensor) else torch.cat(list(w))

    def _activation(self, h: Tensor) -> Tensor:
        limit, alpha = self.cfg.swiglu_limit, self.cfg.swiglu_alpha
        gate = h[..., 0::2].clamp(max=limit)
        up = h[..., 1::2].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def _grouped(self, flat: Tensor, top_idx: Tensor, weights: Tensor) -> Tensor:
        N, D = flat.shape
        E, k = self.cfg.n_experts, self.cfg.top_k
        experts = top_idx.reshape(N * k)
        expert_sorted, perm = torch.sort(experts, stable=True)               # pairs grouped by expert
        counts = (experts[:, None] == torch.arange(E, device=flat.device)).sum(0)
        offs = counts.cumsum(0).to(torch.int32)                              # end row of each expert
        rows = flat[perm // k]                                               # [N*k, D]
        h = torch._grouped_mm(rows, self.gate_up, offs) + self.gate_up_bias[expert_sorted]
        y = torch._grouped_mm(self._activation(h), self.down, offs) + self.down_bias[expert_sorted]
        inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(N * k, device=flat.device))
        y = y[inverse].view(N, k, D)                                         # back in (token, choice) order
        return (y * weights[:, :, None]).sum(dim=1)

    def _grouped_parts(self, flat: Tensor, top_idx: Tensor, weights: Tensor) -> Tensor:
        """Grouped dispatch over the experts' parts: per part, its pairs
        sorted to the front (by expert; the other parts' pairs after them,
        past the last offset, where the grouped GEMM leaves its rows
        unwritten and the mask zeroes them), its two grouped GEMMs, and its
        rows' weighted sum added to the output."""
        N, D = flat.shape
        k, per = self.cfg.top_k, self.cfg.n_experts // self.cfg.expert_parts
        experts = top_idx.reshape(N * k)
        wflat = weights.reshape(N * k)
        local = torch.arange(per, device=flat.device)
        out = torch.zeros_like(flat)
        parts = zip(self.gate_up, self.gate_up_bias, self.down, self.down_bias)
        for j, (gate_up, gate_up_bias, down, down_bias) in enumerate(parts):
            e = experts - j * per
            key = torch.where((e >= 0) & (e < per), e, per)           # the other parts' pairs sort last
            key_sorted, perm = torch.sort(key, stable=True)
            offs = (key[:, None] == local).sum(0).cumsum(0).to(torch.int32)
            mine = key_sorted < per
            local_e = key_sorted.clamp(max=per - 1)
            h = torch._grouped_mm(flat[perm // k], gate_up, offs) + gate_up_bias[local_e]
            y = torch._grouped_mm(self._activation(h), down, offs) + down_bias[local_e]
            y = y.masked_fill(~mine[:, None], 0.0) * wflat[perm][:, None]   # rows past the offsets: unwritten
            out = out.index_add(0, perm // k, y)
        return out

    def _gather(self, flat: Tensor, idx: Tensor, gate_up: Tensor, gate_up_bias: Tensor, down: Tensor,
                down_bias: Tensor) -> Tensor:
        """Gather dispatch: the experts ``idx`` [N, k] of each token applied to it -> [N, k, D]."""
        w_gu, b_gu = gate_up[idx], gate_up_bias[idx]                          # [N,k,D,2I], [N,k,2I]
        h = torch.matmul(flat[:, None, None, :], w_gu).squeeze(2) + b_gu      # [N, k, 2I]
        w_d, b_d = down[idx], down_bias[idx]                                  # [N,k,I,D], [N,k,D]
        return torch.matmul(self._activation(h)[:, :, None, :], w_d).squeeze(2) + b_d  # [N, k, D]

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        logits = self.router(flat)                                    # [N, E]
        top_val, top_idx = torch.topk(logits, self.cfg.top_k, dim=-1)  # [N, k]
        weights = torch.softmax(top_val.float(), dim=-1).to(x.dtype)
        dispatch = self.cfg.dispatch
        if dispatch == "grouped" and (flat.is_cuda or flat.is_meta) and flat.dtype != torch.bfloat16:
            dispatch = "gather"  # CUDA grouped GEMMs (and their meta shapes) are bf16 only
        parts = self.cfg.expert_parts > 1
        if dispatch == "grouped":
            out = (self._grouped_parts if parts else self._grouped)(flat, top_idx, weights)
        elif dispatch == "dense":
            gate = torch.zeros_like(logits).scatter(1, top_idx, weights)  # [N, E], k nonzeros/row
            h = torch.matmul(flat[None], self._whole("gate_up")) + self._whole("gate_up_bias")[:, None, :]  # [E,N,2I]
            y = torch.matmul(self._activation(h), self._whole("down")) + self._whole("down_bias")[:, None, :]  # [E,N,D]
            out = (y * gate.t()[:, :, None]).sum(dim=0)
        elif parts:   # each part's own gathers, so that its weights stay its kernels' alone
            per = self.cfg.n_experts // self.cfg.expert_parts
            out = torch.zeros_like(flat)
            for j, part in enumerate(zip(self.gate_up, self.gate_up_bias, self.down, self.down_bias)):
                e = top_idx - j * per
                mine = (e >= 0) & (e < per)
                y = self._gather(flat, e.clamp(0, per - 1), *part)
                out = out + (y.masked_fill(~mine[:, :, None], 0.0) * weights[:, :, None]).sum(dim=1)
        else:
            y = self._gather(flat, top_idx, self.gate_up, self.gate_up_bias, self.down, self.down_bias)
            out = (y * weights[:, :, None]).sum(dim=1)
        return out.view(B, T, D)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, sliding: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = CachedAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                    cfg.max_batch, cfg.max_seq, bias=True,
                                    sliding_window=cfg.sliding_window if sliding else None, sinks=True)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.experts = Experts(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, rows: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, rows)
        return x + self.experts(self.ffn_norm(x))


class MoE(ReferenceModel):
    """GPT-oss-like MoE causal LM (even layers use the sliding window)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(MoEBlock(cfg, sliding=(i % 2 == 0)) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq, rope_inv_freq(cfg.head_dim, cfg.rope_theta))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: Tensor, positions: Tensor, rows: Tensor | None = None,
                last: Tensor | None = None) -> Tensor:
        """Serving inputs as ``Llama.forward``: ``rows`` (the KV row of each
        batch row) and ``last`` (the one token per row whose logits are wanted)."""
        B, T = input_ids.shape
        positions = normalize_positions(positions, B, T)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, positions, rows)
        if last is not None:
            h = h.gather(1, last.view(B, 1, 1).expand(B, 1, h.shape[-1]))
        return self.lm_head(self.norm(h))

    def example_inputs(self, kind: str, batch: int, seq: int = 1, pos: int = 0) -> dict[str, Tensor]:
        """Same as ``Llama.example_inputs``."""
        tokens = 1 if kind == "decode" else seq
        if pos + tokens > self.cfg.max_seq:
            raise ValueError(f"positions up to {pos + tokens - 1} exceed max_seq={self.cfg.max_seq}")
        device = self.embed.weight.device
        return {"input_ids": example_ids(self.cfg.vocab_size, (batch, tokens), device),
                "positions": lm_positions(kind, batch, seq, pos, device)}

"""Grouped-query attention over a static KV cache (shared by Llama, MoE, VLM).

Cache layout: ``k_cache``/``v_cache`` are state buffers of shape
``[max_batch, max_seq, n_kv_heads, head_dim]``. A forward with ``B`` rows uses
the first ``B`` cache rows; token ``t`` of row ``b`` is written at
``positions[b, t]`` with ``index_put_`` (unique indices -> deterministic), and
attends to every cache slot ``s`` with ``s <= positions[b, t]`` (and, with a
sliding window ``W``, ``s > positions[b, t] - W``). The mask is computed from
``positions`` with tensor ops, so one recorded program serves every position;
stale slots beyond the current position are masked, never read. Rows are
independent sequences, so rows may sit at different positions.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .common import apply_rope, register_state


class CachedAttention(nn.Module):
    """GQA with RoPE and a static KV cache.

    ``forward(x [B,T,D], cos/sin [B,T,hd/2], positions [B,T]) -> [B,T,D]``.
    Query head ``h`` uses KV head ``h // (n_heads // n_kv_heads)``.
    ``sinks`` (GPT-oss) adds a learned per-head logit to the softmax
    denominator: the head may attend to "nothing".
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 max_batch: int, max_seq: int, bias: bool = False,
                 sliding_window: int | None = None, sinks: bool = False):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.row_base = 0
        register_state(self, "k_cache", torch.zeros(max_batch, max_seq, n_kv_heads, head_dim))
        register_state(self, "v_cache", torch.zeros(max_batch, max_seq, n_kv_heads, head_dim))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                rows: Tensor | None = None) -> Tensor:
        B, T, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        G = H // KV
        max_batch, S = self.k_cache.shape[0], self.k_cache.shape[1]
        q = apply_rope(self.wq(x).view(B, T, H, hd), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, KV, hd), cos, sin)
        v = self.wv(x).view(B, T, KV, hd)

        if rows is None:
            base = self.row_base
            if base + B > max_batch:
                raise ValueError(f"rows {base}..{base + B - 1} exceed the KV cache's max_batch {max_batch}")
            k_cache, v_cache = self.k_cache[base:base + B], self.v_cache[base:base + B]
            where = torch.arange(B, device=x.device)[:, None].expand(B, T)
            k_cache.index_put_((where, positions), k.to(k_cache.dtype))
            v_cache.index_put_((where, positions), v.to(v_cache.dtype))
        else:
            where = rows[:, None].expand(B, T)
            self.k_cache.index_put_((where, positions), k.to(self.k_cache.dtype))
            self.v_cache.index_put_((where, positions), v.to(self.v_cache.dtype))
            k_cache, v_cache = self.k_cache.index_select(0, rows), self.v_cache.index_select(0, rows)

        # [B, KV, G*T, hd] @ [B, KV, hd, S] -> [B, KV, G*T, S]
        qh = q.view(B, T, KV, G, hd).permute(0, 2, 3, 1, 4).reshape(B, KV, G * T, hd)
        keys = k_cache.permute(0, 2, 3, 1).to(q.dtype)
        scores = torch.matmul(qh, keys) * (hd ** -0.5)
        scores = scores.view(B, KV, G, T, S)

        slots = torch.arange(S, device=x.device)
        pos = positions[:, None, None, :, None]
        mask = slots <= pos
        if self.sliding_window is not None:
            mask = mask & (slots > pos - self.sliding_window)
        if self.sinks is None:
            probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1)
        else:
            sink = self.sinks.float().view(1, KV, G, 1, 1).expand(B, KV, G, T, 1)
            logits = torch.cat([scores.float().masked_fill(~mask, float("-inf")), sink], dim=-1)
            probs = torch.softmax(logits, dim=-1)[..., :S]
        probs = probs.to(q.dtype).reshape(B, KV, G * T, S)
        out = torch.matmul(probs, v_cache.permute(0, 2, 1, 3).to(q.dtype))  # [B, KV, G*T, hd]
        out = out.view(B, KV, G, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, H * hd)
        return self.wo(out)

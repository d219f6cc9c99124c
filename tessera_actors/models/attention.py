"""Grouped-query attention over a static KV cache (shared by Llama, MoE, VLM),
through ``F.scaled_dot_product_attention`` - the library kernels a user runs
(flash / memory-efficient / cuDNN attention on GPUs, the fused CPU kernel).

Cache layout: ``k_cache``/``v_cache`` are state buffers of shape
``[max_batch, n_kv_heads, max_seq, head_dim]`` (with attention sinks,
``max_seq`` rounded up to the next multiple of 16 above it: slot ``max_seq``
carries the sink, the spare slots stay zero and masked, see below).  A forward with ``B``
rows uses the first ``B`` cache rows (rows ``row_base`` .. when ``row_base`` is set, or the rows named by ``rows``); token
``t`` of row ``b`` is written at ``positions[b, t]`` with ``index_put_``
(unique indices -> deterministic), and attends to every cache slot ``s``
with ``s <= positions[b, t]`` (and, with a sliding window ``W``,
``s > positions[b, t] - W``).  The mask is computed from ``positions`` with
tensor ops, so one recorded program serves every position, chunked prefill
included (a prompt chunk at positions p..p+T-1 is causal within itself and
sees the cache before it); stale slots are masked, never read.  Rows are
independent sequences, so rows may sit at different positions.
``kv_window`` (an attribute, 0 = the whole cache; serving sets it while
capturing a bucket) limits what is read to the first ``kv_window`` slots:
a step whose positions all lie below it needs no more, so a short context
costs a short attention.  Writes still go to the whole cache.

GQA (``gqa``):
  ``"fold"`` (default): the ``G = n_heads / n_kv_heads`` query heads of a KV
    head become ``G * T`` query rows of that head ([B, KV, G*T, hd] against
    [B, KV, S, hd]); each KV head is read once and the cache is never
    repeated, on every backend (in decode the fold is a free view).
  ``"enable_gqa"``: [B, H, T, hd] queries with ``enable_gqa=True``; backends
    without native GQA for masked attention fall back to a path that repeats
    the cache per query head.
``fewest_ops`` (``common.use_fewest_ops``, CPU deployments): the cache row
indices of a step are made once for every layer's cache write.  (The mask
stays bool: made additive once it would hold four times the bytes through
the step, and a CPU's attention call takes either as fast.)
Attention sinks (GPT-oss): a learned per-head logit in the softmax
denominator.  Implemented as an extra, always-zero cache slot whose
additive mask entry is the sink logit: it adds ``exp(sink)`` to the
denominator and nothing to the output.  Positions must stay below
``max_seq`` (the slots above it are the sink's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera_actors.models.common import apply_rope, register_state

GQA_MODES = ("fold", "enable_gqa")


class CachedAttention(nn.Module):
    """GQA with RoPE and a static KV cache.

    ``forward(x [B,T,D], cos/sin [B,T,hd/2], positions [B,T], rows [B] | None)
    -> [B,T,D]``.  Query head ``h`` uses KV head ``h // (n_heads // n_kv_heads)``.
    ``rows`` (serving): the cache row of each batch row (default 0..B-1).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 max_batch: int, max_seq: int, bias: bool = False,
                 sliding_window: int | None = None, sinks: bool = False, gqa: str = "fold"):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        if gqa not in GQA_MODES:
            raise ValueError(f"gqa must be one of {GQA_MODES}, got {gqa!r}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.sliding_window, self.gqa, self.max_seq = sliding_window, gqa, max_seq
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.row_base = 0  # without ``rows``: the batch uses cache rows row_base .. row_base+B-1
        self.kv_window = 0  # > 0: read only the first kv_window slots (every position of the step is below it)
        self.fewest_ops = False
        # sinks: one zero slot for the sink logit, padded so rows stay 16-element aligned for the kernels
        slots = max_seq + ((16 - max_seq % 16) if sinks else 0)
        register_state(self, "k_cache", torch.zeros(max_batch, n_kv_heads, slots, head_dim))
        register_state(self, "v_cache", torch.zeros(max_batch, n_kv_heads, slots, head_dim))

    def _write(self, k: Tensor, v: Tensor, positions: Tensor, rows: Tensor | None,
               masks: dict | None = None) -> tuple[Tensor, Tensor]:
        """Store the new keys/values; return the cache rows of this batch."""
        B, T = positions.shape
        if rows is None:
            base = self.row_base
            if base + B > self.k_cache.shape[0]:
                raise ValueError(f"rows {base}..{base + B - 1} exceed the KV cache's max_batch {self.k_cache.shape[0]}")
            k_cache, v_cache = self.k_cache[base:base + B], self.v_cache[base:base + B]
            shared = masks if self.fewest_ops and masks is not None else {}
            key = ("rows", B, base, k.device)
            where = shared.get(key)
            if where is None:
                where = shared[key] = torch.arange(B, device=k.device) + base
            where = where[:, None].expand(B, T)
        else:
            k_cache, v_cache = self.k_cache, self.v_cache
            where = rows[:, None].expand(B, T)
        # (row, position) index pairs address [KV, hd] slices of the whole cache.  Without ``rows`` the
        # batch's rows are a slice of it: written into the buffer itself (indices on dims 0 and 2), as a
        # write through the sliced, transposed view becomes a copy of the whole cache under a compiler
        # (slice_scatter: about 2 ms of a 3.7 ms compiled Llama-8B decode step on an H200); with ``rows``
        # (serving) through the transposed whole cache, the form eager CUDA scatters fastest (the other
        # made an engine decode step 7% slower)
        if rows is None:
            self.k_cache[where, :, positions] = k.to(self.k_cache.dtype)
            self.v_cache[where, :, positions] = v.to(self.v_cache.dtype)
        else:
            self.k_cache.transpose(1, 2).index_put_((where, positions), k.to(self.k_cache.dtype))
            self.v_cache.transpose(1, 2).index_put_((where, positions), v.to(self.v_cache.dtype))
        W = self._window()
        if rows is not None:
            k_cache, v_cache = (self.k_cache[:, :, :W].index_select(0, rows),
                                self.v_cache[:, :, :W].index_select(0, rows))
        elif W < self.k_cache.shape[2]:
            k_cache, v_cache = k_cache[:, :, :W], v_cache[:, :, :W]
        return k_cache, v_cache

    def _window(self) -> int:
        if not self.kv_window:
            return self.k_cache.shape[2]
        if self.sinks is not None:
            raise ValueError("kv_window is not supported with attention sinks")
        return min(self.kv_window, self.max_seq)

    def _mask(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """[B, 1, T, S] bool (True = attend), or additive with the sink column."""
        S = self.max_seq if not self.kv_window else self._window()
        slots = torch.arange(S, device=positions.device)
        pos = positions[:, None, :, None]
        mask = slots <= pos
        if self.sliding_window is not None:
            mask = mask & (slots > pos - self.sliding_window)
        if self.sinks is None:
            return mask
        B, T = positions.shape
        H, pad = self.n_heads, self.k_cache.shape[2] - S - 1
        add = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        add = add.expand(B, H, T, S)                                                            # [B,H,T,S]
        sink = self.sinks.to(dtype).view(1, H, 1, 1).expand(B, H, T, 1)
        unused = torch.full((1, 1, 1, 1), float("-inf"), dtype=dtype, device=mask.device).expand(B, H, T, pad)
        return torch.cat([add, sink, unused], dim=-1)                                           # [B,H,T,slots]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                rows: Tensor | None = None, masks: dict | None = None) -> Tensor:
        B, T, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        G = H // KV
        q = apply_rope(self.wq(x).view(B, T, H, hd), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, KV, hd), cos, sin)
        v = self.wv(x).view(B, T, KV, hd)
        k_cache, v_cache = self._write(k, v, positions, rows, masks)
        k_cache, v_cache = k_cache.to(q.dtype), v_cache.to(q.dtype)
        # ``masks``: one dict per forward, shared by the layers - the mask of a step is the same in every
        # layer of one shape (sinks are per layer: never shared)
        key = (self.gqa, G, T, self.max_seq, self._window(), self.sliding_window, q.dtype)
        shared = masks is not None and self.sinks is None
        if shared and key in masks:
            mask = masks[key]
        else:
            mask = self._attention_mask(positions, q.dtype, B, T)
            if shared:
                masks[key] = mask
        return self._attend(q, k_cache, v_cache, mask, B, T)

    def _attention_mask(self, positions: Tensor, dtype: torch.dtype, B: int, T: int) -> Tensor:
        """The mask in the form the attention call takes: [B, 1, T, S] for
        ``enable_gqa``; folded to the query rows (g, t) otherwise."""
        mask = self._mask(positions, dtype)
        if self.gqa == "enable_gqa":
            return mask
        G = self.n_heads // self.n_kv_heads
        if self.sinks is None:   # the mask repeats per group g
            mf = mask if T == 1 else mask.expand(B, G, T, mask.shape[-1]).reshape(B, 1, G * T, -1)
        else:
            mf = mask.view(B, self.n_kv_heads, G * T, mask.shape[-1])                    # heads h = kv*G + g
        return mf

    def _attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, B: int, T: int) -> Tensor:
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        G = H // KV
        if self.gqa == "enable_gqa":
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache, attn_mask=mask,
                                                 enable_gqa=True)                      # [B, H, T, hd]
            return self.wo(out.transpose(1, 2).reshape(B, T, H * hd))
        # fold: query rows (g, t) of KV head kv
        qf = q.view(B, T, KV, G, hd).permute(0, 2, 3, 1, 4).reshape(B, KV, G * T, hd)
        out = F.scaled_dot_product_attention(qf, k_cache, v_cache, attn_mask=mask)   # [B, KV, G*T, hd]
        out = out.view(B, KV, G, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, H * hd)
        return self.wo(out)

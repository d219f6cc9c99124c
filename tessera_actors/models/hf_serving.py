"""A transformers causal LM with the serving engine's contract.

:class:`ServingLM` wraps a transformers ``...ForCausalLM`` (its own modules
and weights, run by its own code) and gives it what the engine needs from
the reference models (``models/__init__.py``):

``forward(input_ids [B,T], positions [B] | [B,T], rows [B] | None, last [B] | None)``
    -> logits [B, T, vocab] (``[B, 1, vocab]`` with ``last``: the logits of
    token ``last[b]`` of each row only).  ``rows``: the KV-cache row of each
    batch row; without it rows ``row_base .. row_base + B - 1``.
``state_names()`` / ``reset_state()`` / ``example_inputs(kind, batch, seq, pos)``
    as for the reference models; the state is a static KV cache
    ``cache.k{i}`` / ``cache.v{i}`` [max_batch, kv_heads, max_seq, head_dim]
    per layer.

How: the transformers model is called with ``position_ids = positions``, a
prepared 4-D mask (slot ``s`` visible to token ``t`` of row ``b`` iff
``s <= positions[b, t]``; transformers passes 4-D masks through as they are)
and a :class:`StaticRows` cache object whose ``update`` (the one method the
attention layers call) writes the new keys/values into the static buffers
at (row, position) and returns the rows' whole cache.  So no host read, no
data-dependent shape: one captured program serves every position.  Models
whose layers mix full and sliding-window attention, and models without a
KV cache (Mamba-2), are refused.
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from tessera_actors.models.common import register_state


class StaticRows:
    """The cache object handed to the transformers model for one forward."""

    is_compileable = True

    def __init__(self, owner: "ServingLM", rows: Tensor | None, positions: Tensor) -> None:
        self.owner, self.rows, self.positions = owner, rows, positions

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [B, KV, T, hd] -> the batch's cache rows [B, KV, S, hd]."""
        k_buf = getattr(self.owner.cache, f"k{layer_idx}")
        v_buf = getattr(self.owner.cache, f"v{layer_idx}")
        B, T = self.positions.shape
        if self.rows is None:
            base = self.owner.row_base
            if base + B > k_buf.shape[0]:
                raise ValueError(f"rows {base}..{base + B - 1} exceed the KV cache's max_batch {k_buf.shape[0]}")
            k_rows, v_rows = k_buf[base:base + B], v_buf[base:base + B]
            where = torch.arange(B, device=key_states.device)[:, None].expand(B, T)
        else:
            k_rows, v_rows = k_buf, v_buf
            where = self.rows[:, None].expand(B, T)
        k_rows.transpose(1, 2).index_put_((where, self.positions), key_states.transpose(1, 2).to(k_buf.dtype))
        v_rows.transpose(1, 2).index_put_((where, self.positions), value_states.transpose(1, 2).to(v_buf.dtype))
        if self.rows is not None:
            k_rows, v_rows = k_buf.index_select(0, self.rows), v_buf.index_select(0, self.rows)
        return k_rows.to(key_states.dtype), v_rows.to(value_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only read when position_ids are missing
        raise RuntimeError("StaticRows: position_ids must be given")


class ServingLM(nn.Module):
    """See the module docstring.  Parameters frozen; eval mode."""

    def __init__(self, hf_model: nn.Module, max_batch: int, max_seq: int) -> None:
        super().__init__()
        cfg = hf_model.config
        types = set(getattr(cfg, "layer_types", None) or [])
        if len(types) > 1:
            raise ValueError(f"{type(hf_model).__name__} mixes attention kinds {sorted(types)}: not servable "
                             "with one static mask")
        if getattr(cfg, "num_attention_heads", None) is None or not hasattr(hf_model, "get_output_embeddings"):
            raise ValueError(f"{type(hf_model).__name__} has no KV-cache attention to serve")
        self.hf = hf_model
        self.base = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else hf_model.base_model
        params = inspect.signature(self.base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if types == {"full_attention"}:
            self.window = None
        self.max_seq, self.row_base = max_seq, 0
        self.cache = nn.Module()
        dtype = next(hf_model.parameters()).dtype
        device = next(hf_model.parameters()).device
        for i in range(cfg.num_hidden_layers):
            register_state(self.cache, f"k{i}", torch.zeros(max_batch, kv, max_seq, hd, dtype=dtype, device=device))
            register_state(self.cache, f"v{i}", torch.zeros(max_batch, kv, max_seq, hd, dtype=dtype, device=device))
        self.config = self.cfg = cfg  # ``cfg.vocab_size`` as the reference models have it
        self.eval().requires_grad_(False)

    def state_names(self) -> list[str]:
        return [f"cache.{n}" for n, _ in self.cache.named_buffers()]

    def reset_state(self) -> None:
        with torch.no_grad():
            for _, b in self.cache.named_buffers():
                b.zero_()

    def example_inputs(self, kind: str, batch: int, seq: int = 1, pos: int = 0) -> dict[str, Tensor]:
        from tessera_actors.models.common import example_ids, lm_positions
        device = next(self.hf.parameters()).device
        tokens = 1 if kind == "decode" else seq
        if kind not in ("decode", "prefill"):
            raise ValueError(f"kind must be 'decode' or 'prefill', not {kind!r}")
        if pos + tokens > self.max_seq:
            raise ValueError(f"positions up to {pos + tokens - 1} exceed max_seq={self.max_seq}")
        return {"input_ids": example_ids(self.config.vocab_size, (batch, tokens), device),
                "positions": lm_positions(kind, batch, seq, pos, device)}

    def forward(self, input_ids: Tensor, positions: Tensor, rows: Tensor | None = None,
                last: Tensor | None = None) -> Tensor:
        from tessera_actors.models.llama import normalize_positions
        B, T = input_ids.shape
        positions = normalize_positions(positions, B, T)
        slots = torch.arange(self.max_seq, device=input_ids.device)
        pos = positions[:, None, :, None]
        mask = slots <= pos                                                     # [B, 1, T, S]
        if self.window:
            mask = mask & (slots > pos - self.window)
        if self.config._attn_implementation != "sdpa":                          # eager etc.: additive masks
            dtype = next(self.hf.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        out = self.base(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{self._cache_kw: StaticRows(self, rows, positions)})
        h = out[0]
        if last is not None:
            h = h.gather(1, last.view(B, 1, 1).expand(B, 1, h.shape[-1]))
        return self.hf.get_output_embeddings()(h)

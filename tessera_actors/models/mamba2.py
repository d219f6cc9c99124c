"""Mamba-2 selective state-space LM in decode-step form, own code.

Each layer keeps two state buffers, one row per sequence, plus a spare row
(index ``max_batch``) that padding rows write and no sequence reads:
  ``layers.{i}.mixer.conv_state`` [max_batch + 1, conv_dim, d_conv] - the last
      ``d_conv`` inputs of the depthwise causal conv (x, B, C channels);
  ``layers.{i}.mixer.ssm_state``  [max_batch + 1, n_heads, head_dim, d_state].
One step per token: ``conv_state`` shifts in the new input, the SSM update is
``h = exp(dt * A) * h + dt * x B^T`` and ``y = h C + D x``, gated by
``silu(z)`` through a gated RMSNorm.  A step reads its rows' states with
``index_select`` and writes them back with ``index_put_`` (in place, only
those rows: never a copy of the whole state).

Inputs: ``input_ids`` [B, T] and ``positions`` [B] or [B, T]. A row whose
position is 0 starts a fresh sequence: its state is zeroed by multiplying with
``positions != 0`` (tensor ops, no branching), so one program serves new and
continuing sequences.  Serving inputs (optional, as ``Llama.forward``):
``rows`` int64 [B], the state row of each batch row (default: rows
``row_base`` .. ``row_base + B - 1``), and ``last`` int64 [B], the index of
each row's last real token: the tokens after it are padding and leave the
state as it is (their ``dt`` is 0), and only that token's logits are
computed (output [B, 1, vocab]).  Positions stay below ``max_seq - 1``: a
row whose (last real) token is at ``max_seq - 1`` is a padding row - the
serving engine's throw-away position, the last slot of a KV cache - and
writes its states into the spare row, so a padding row never disturbs a
sequence (not even the one whose row it reads).  The state of a row is the
state after its latest token (``ROW_STATE = "latest"``: no per-position
history, so no prefix of it can be reused and no attention window applies).

Prefill (T > 1) computes the same recurrence for all T tokens at once in
Mamba-2's chunked state-space-dual form (:meth:`Mamba2Mixer.scan`: quadratic
inside chunks of ``SCAN_CHUNK`` tokens, the state carried from chunk to
chunk), as real Mamba-2 prefill does: equal to feeding the tokens one by one
up to float rounding; a prompt fed in several calls (the engine's chunks)
continues each row's state from call to call.  Output: logits [B, T, vocab].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera_actors.models.common import ReferenceModel, RMSNorm, add_lm_stack, example_ids, lm_positions, register_state
from tessera_actors.models.llama import normalize_positions


@dataclass
class Mamba2Config:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    head_dim: int = 16
    n_groups: int = 1
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_batch: int = 4
    max_seq: int = 2048   # positions stay below max_seq - 1 (that one marks a padding row: module docstring)

    def __post_init__(self):
        if (self.expand * self.dim) % self.head_dim:
            raise ValueError(f"d_inner={self.expand * self.dim} must be a multiple of head_dim={self.head_dim}")
        if self.n_heads % self.n_groups:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_groups={self.n_groups}")
        if min(self.vocab_size, self.dim, self.n_layers, self.d_state, self.d_conv, self.max_batch) <= 0 \
                or self.max_seq < 2:
            raise ValueError("Mamba2Config sizes must be positive")

    @property
    def d_inner(self) -> int:
        return self.expand * self.dim

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @classmethod
    def tiny(cls, **overrides) -> "Mamba2Config":
        return cls(**overrides)

    @classmethod
    def mamba2_2_7b(cls, **overrides) -> "Mamba2Config":
        cfg = dict(vocab_size=50288, dim=2560, n_layers=64, d_state=128, d_conv=4, expand=2,
                   head_dim=64, n_groups=1, max_batch=8)
        cfg.update(overrides)
        return cls(**cfg)


SCAN_CHUNK = 64   # tokens per chunk of the prefill scan


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer; ``step(x [B,D], keep [B]) -> [B,D]`` advances one token."""

    def __init__(self, cfg: Mamba2Config):
        super().__init__()
        self.cfg = cfg
        H = cfg.n_heads
        self.in_proj = nn.Linear(cfg.dim, 2 * cfg.d_inner + 2 * cfg.n_groups * cfg.d_state + H, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(cfg.conv_dim, cfg.d_conv))
        self.conv_bias = nn.Parameter(torch.empty(cfg.conv_dim))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm = RMSNorm(cfg.d_inner, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.dim, bias=False)
        # one row per sequence and the spare row (index max_batch) that padding rows write
        register_state(self, "conv_state", torch.zeros(cfg.max_batch + 1, cfg.conv_dim, cfg.d_conv))
        register_state(self, "ssm_state", torch.zeros(cfg.max_batch + 1, H, cfg.head_dim, cfg.d_state))

    @torch.no_grad()
    def init_special(self, gen: torch.Generator) -> None:
        """Mamba-2 init: A in [1, 16], dt in [1e-3, 1e-1] (through dt_bias), D = 1."""
        H, dev = self.cfg.n_heads, self.A_log.device
        A = 1 + 15 * torch.rand(H, generator=gen, device=dev)
        log_lo, log_hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(log_lo + (log_hi - log_lo) * torch.rand(H, generator=gen, device=dev))
        self.A_log.copy_(torch.log(A))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.D.fill_(1.0)

    def _rows(self, B: int, rows: Tensor | None, write: Tensor | None, device) -> tuple[Tensor, Tensor]:
        """(the state rows a step of ``B`` rows reads, those it writes):
        the first ``B`` rows when not given."""
        if rows is None:
            if B > self.cfg.max_batch:
                raise ValueError(f"batch {B} exceeds max_batch {self.cfg.max_batch}")
            rows = torch.arange(B, device=device)
        return rows, rows if write is None else write

    def step(self, x: Tensor, keep: Tensor, rows: Tensor | None = None, write: Tensor | None = None) -> Tensor:
        """One token of each row: ``x`` [B, D], ``keep`` [B] (False: the token
        starts a fresh sequence); the states of ``rows`` read, written to
        ``write`` (the spare row for a padding row)."""
        cfg = self.cfg
        B = x.shape[0]
        H, P, N, G = cfg.n_heads, cfg.head_dim, cfg.d_state, cfg.n_groups
        rows, write = self._rows(B, rows, write, x.device)
        z, xbc, dt = torch.split(self.in_proj(x), [cfg.d_inner, cfg.conv_dim, H], dim=-1)

        conv_state, ssm_state = self.conv_state.index_select(0, rows), self.ssm_state.index_select(0, rows)
        keep = keep.to(x.dtype)
        window = torch.cat([conv_state[:, :, 1:] * keep[:, None, None], xbc[:, :, None]], dim=-1)
        self.conv_state.index_put_((write,), window.to(self.conv_state.dtype))
        xbc = F.silu((window * self.conv_weight).sum(-1) + self.conv_bias)
        xs, b, c = torch.split(xbc, [cfg.d_inner, G * N, G * N], dim=-1)

        dt = F.softplus(dt.float() + self.dt_bias.float())               # [B, H]
        decay = torch.exp(dt * -torch.exp(self.A_log.float()))           # [B, H]
        xs = xs.view(B, H, P).float()
        b = b.view(B, G, 1, N).expand(B, G, H // G, N).reshape(B, H, N).float()
        c = c.view(B, G, 1, N).expand(B, G, H // G, N).reshape(B, H, N).float()
        update = (dt[:, :, None] * xs)[:, :, :, None] * b[:, :, None, :]  # [B, H, P, N]
        state = ssm_state.float() * (decay * keep.float()[:, None])[:, :, None, None] + update
        self.ssm_state.index_put_((write,), state.to(self.ssm_state.dtype))
        y = torch.matmul(state, c[:, :, :, None]).squeeze(-1) + self.D.float()[:, None] * xs
        y = y.reshape(B, cfg.d_inner).to(x.dtype)
        return self.out_proj(self.norm(y * F.silu(z)))


    def scan(self, x: Tensor, keep: Tensor, rows: Tensor | None = None, write: Tensor | None = None,
             last: Tensor | None = None) -> Tensor:
        """``T`` tokens at once: ``x`` [B, T, D], ``keep`` [B, T] (False: the
        token starts a fresh sequence) -> [B, T, D]; the states end as after
        ``T`` calls of :meth:`step` (``rows``/``write`` as there), or with
        ``last`` [B] after token ``last`` of each row (those after it are
        padding: their ``dt`` is 0, the state passes them unchanged).  The SSM
        runs in the chunked dual form:
        inside a chunk of ``SCAN_CHUNK`` tokens, ``y_t = sum_s M[t, s] (C_t.B_s)
        dt_s x_s`` with ``M[t, s] = exp(L_t - L_s)`` for ``s <= t`` in the same
        sequence (``L``: the cumulative log decay), plus the state entering
        the chunk decayed to ``t``; the state leaving a chunk enters the next."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, P, N, G, K = cfg.n_heads, cfg.head_dim, cfg.d_state, cfg.n_groups, cfg.d_conv
        rows, write = self._rows(B, rows, write, x.device)
        z, xbc, dt = torch.split(self.in_proj(x), [cfg.d_inner, cfg.conv_dim, H], dim=-1)
        conv_state, ssm_state = self.conv_state.index_select(0, rows), self.ssm_state.index_select(0, rows)
        real = None if last is None else torch.arange(T, device=x.device)[None, :] <= last[:, None]   # [B, T]
        if real is not None:
            keep = keep | ~real   # (a padding token starts nothing)
        # a token's sequence: the resets up to it (a reset token starts the next one); before the chunk: 0
        seg = torch.cumsum((~keep).to(torch.int64), dim=1)                                  # [B, T]
        # causal depthwise conv: the window of token t holds the inputs t-K+1..t of its own sequence
        inputs = torch.cat([conv_state[:, :, 1:], xbc.transpose(1, 2)], dim=-1)             # [B, C, K-1+T]
        windows = inputs.unfold(-1, K, 1)                                                   # [B, C, T, K]
        seg_in = torch.cat([torch.zeros(B, K - 1, dtype=seg.dtype, device=seg.device), seg], dim=1)
        same = (seg_in.unfold(1, K, 1) == seg[:, :, None]).to(x.dtype)                      # [B, T, K]
        windows = windows * same[:, None]
        C = windows.shape[1]
        final = (windows[:, :, -1] if last is None
                 else windows.gather(2, last.view(B, 1, 1, 1).expand(B, C, 1, K))[:, :, 0])   # [B, C, K]
        self.conv_state.index_put_((write,), final.to(self.conv_state.dtype))
        xbc = F.silu((windows * self.conv_weight[:, None]).sum(-1) + self.conv_bias[:, None]).transpose(1, 2)
        xs, b, c = torch.split(xbc, [cfg.d_inner, G * N, G * N], dim=-1)

        dt = F.softplus(dt.float() + self.dt_bias.float())                                  # [B, T, H]
        if real is not None:
            dt = dt * real[..., None].to(dt.dtype)   # padding: no decay, no input
        log_decay = dt * -torch.exp(self.A_log.float())                                     # [B, T, H]
        xs = xs.reshape(B, T, H, P).float()
        b = b.reshape(B, T, G, 1, N).expand(B, T, G, H // G, N).reshape(B, T, H, N).float()
        c = c.reshape(B, T, G, 1, N).expand(B, T, G, H // G, N).reshape(B, T, H, N).float()
        u = dt[..., None] * xs                                                              # [B, T, H, P]
        state = ssm_state.float()                                                           # [B, H, P, N]
        prev = torch.zeros(B, 1, dtype=seg.dtype, device=seg.device)   # the sequence the state belongs to
        ys = []
        for lo in range(0, T, SCAN_CHUNK):
            hi = min(lo + SCAN_CHUNK, T)
            L = torch.cumsum(log_decay[:, lo:hi], dim=1).transpose(1, 2)                    # [B, H, Q]
            sq = seg[:, lo:hi]                                                              # [B, Q]
            Q = hi - lo
            causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
            within = causal & (sq[:, :, None] == sq[:, None, :])[:, None]                   # [B, 1, Q, Q]
            gap = L[:, :, :, None] - L[:, :, None, :]
            M = torch.exp(torch.where(within, gap, torch.full_like(gap, float("-inf"))))   # [B, H, Q, Q]
            cq, bq, uq = c[:, lo:hi].transpose(1, 2), b[:, lo:hi].transpose(1, 2), u[:, lo:hi].transpose(1, 2)
            y = torch.matmul(torch.matmul(cq, bq.transpose(-1, -2)) * M, uq)               # [B, H, Q, P]
            carried = (sq == prev).to(torch.float32)[:, None]                               # [B, 1, Q]
            into = torch.exp(L) * carried                                                   # [B, H, Q]
            y = y + into[..., None] * torch.matmul(cq, state.transpose(-1, -2))
            # the state after the chunk: its last token's sequence, decayed from each token on
            end = sq[:, -1:]
            tail = torch.exp(L[:, :, -1:] - L) * (sq == end).to(torch.float32)[:, None]     # [B, H, Q]
            state = (state * (into[:, :, -1] * (end == prev).to(torch.float32))[:, :, None, None]
                     + torch.matmul((uq * tail[..., None]).transpose(-1, -2), bq))
            prev = end
            ys.append(y.transpose(1, 2))                                                    # [B, Q, H, P]
        self.ssm_state.index_put_((write,), state.to(self.ssm_state.dtype))
        y = torch.cat(ys, dim=1) + self.D.float()[:, None] * xs
        y = y.reshape(B, T, cfg.d_inner).to(x.dtype)
        return self.out_proj(self.norm(y * F.silu(z)))


class Mamba2Block(nn.Module):
    def __init__(self, cfg: Mamba2Config):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mixer = Mamba2Mixer(cfg)

    def forward(self, h: Tensor, keep: Tensor, rows: Tensor, write: Tensor, last: Tensor | None) -> Tensor:
        """``h`` [B, T, D]: one recurrence step when ``T == 1`` (decode),
        else the chunked scan (prefill); the mixer's inputs as there."""
        if h.shape[1] == 1:
            return h + self.mixer.step(self.norm(h[:, 0]), keep[:, 0], rows, write)[:, None]
        return h + self.mixer.scan(self.norm(h), keep, rows, write, last)


class Mamba2(ReferenceModel):
    """Mamba-2 LM; see the module docstring for inputs and state."""

    ROW_STATE = "latest"   # a state row is the state after the row's latest token (ReferenceModel.ROW_STATE)

    def __init__(self, cfg: Mamba2Config):
        super().__init__()
        self.cfg = cfg
        self.row_base = 0   # without ``rows``: the batch uses state rows row_base .. row_base+B-1 (a decode bucket's)
        add_lm_stack(self, cfg, lambda: Mamba2Block(cfg))

    def _init_special(self, gen: torch.Generator) -> None:
        for layer in self.layers:
            layer.mixer.init_special(gen)

    def state_rows(self, positions: Tensor, rows: Tensor | None, last: Tensor | None) -> tuple[Tensor, Tensor]:
        """(the state rows the batch rows read, those they write): a padding
        row - its last real token at ``max_seq - 1`` - writes the spare row."""
        B = positions.shape[0]
        spare = self.cfg.max_batch
        if rows is None:
            if self.row_base + B > spare:
                raise ValueError(f"rows {self.row_base}..{self.row_base + B - 1} exceed max_batch {spare}")
            rows = torch.arange(B, device=positions.device) + self.row_base
        at = positions[:, -1] if last is None else positions.gather(1, last.view(B, 1))[:, 0]
        return rows, torch.where(at < self.cfg.max_seq - 1, rows, torch.full_like(rows, spare))

    def forward(self, input_ids: Tensor, positions: Tensor, rows: Tensor | None = None,
                last: Tensor | None = None) -> Tensor:
        B, T = input_ids.shape
        positions = normalize_positions(positions, B, T)
        read, write = self.state_rows(positions, rows, last)
        keep = positions != 0
        h = self.embed(input_ids)
        for layer in self.layers:   # decode: one recurrence step; prefill: all tokens at once (chunked scan)
            h = layer(h, keep, read, write, last)
        if last is not None:
            h = h.gather(1, last.view(B, 1, 1).expand(B, 1, h.shape[-1]))
        return self.lm_head(self.norm(h))

    def example_inputs(self, kind: str, batch: int, seq: int = 1, pos: int = 0) -> dict[str, Tensor]:
        """As ``Llama.example_inputs`` (positions only matter as ``== 0``)."""
        tokens = 1 if kind == "decode" else seq
        device = self.embed.weight.device
        return {"input_ids": example_ids(self.cfg.vocab_size, (batch, tokens), device),
                "positions": lm_positions(kind, batch, seq, pos, device)}

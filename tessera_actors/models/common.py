"""Building blocks shared by the reference models.

Every reference model obeys one contract so that a generic capture can record
any of them (see ``tessera_actors.models`` for the full statement):

* ``forward(**inputs) -> Tensor`` with static shapes, no host syncs and no
  Python branching on tensor values;
* persistent state (KV cache, SSM state) lives in buffers registered with
  :func:`register_state` and is updated in place inside ``forward``;
* ``state_names()`` / ``reset_state()`` / ``example_inputs(kind, batch, seq, pos)``.

Buffers that are neither parameters nor state (RoPE tables, positional
embeddings) are *constants*: computed once at construction in float32 and
never cast to the model dtype, so bf16 models keep exact rotary tables.
"""
from __future__ import annotations

import math
import mmap

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_STATE_ATTR = "_tessera_state_keys"


LAZY_BYTES = 1 << 20   # host tensors from this size on are fresh zero pages (:func:`zeroed`)


def zeroed(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` zero bytes on ``device``.  In host memory from
    :data:`LAZY_BYTES` on, a private anonymous mapping of the kernel's zero
    pages: a page becomes resident only when first written (reading one
    costs no memory), so a KV cache of ``max_seqs`` rows of
    ``max_model_len`` positions holds resident only the positions its
    sequences wrote, and weights are not written twice (zeros, then their
    values); a model's state made so costs nothing until written
    (``models.smollm2``).  The mapping goes when the last tensor viewing it does."""
    if device.type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8)   # holds the mapping


def register_state(module: nn.Module, name: str, tensor: Tensor) -> None:
    """Register ``tensor`` as a persistent-state buffer of ``module``.

    State buffers survive across forward calls, are written in place inside
    ``forward`` and are zeroed by ``ReferenceModel.reset_state``. They are not
    part of ``state_dict`` (weights files never carry them).
    """
    module.register_buffer(name, tensor, persistent=False)
    keys = module.__dict__.setdefault(_STATE_ATTR, [])
    if name not in keys:
        keys.append(name)


class ReferenceModel(nn.Module):
    """Base class of the reference models: the state half of the contract.

    ``ROW_STATE`` says what one row (sequence) of the state holds:
    ``"positions"`` (a KV cache: each position's keys and values, so the
    first ``n`` positions of a row are the state of its first ``n`` tokens
    - a kept prefix can be reused, attention can read a window of them) or
    ``"latest"`` (a recurrent state, an SSM's: the state after the row's
    latest token only - nothing of it serves another prompt, no window
    applies).  The serving engine reads it (``serving.deploy.fitted``)."""

    ROW_STATE = "positions"

    def state_names(self) -> list[str]:
        """Fully qualified names (as in ``named_buffers()``) of the state buffers."""
        names = []
        for prefix, module in self.named_modules():
            for key in module.__dict__.get(_STATE_ATTR, ()):
                names.append(f"{prefix}.{key}" if prefix else key)
        return names

    @torch.no_grad()
    def reset_state(self) -> None:
        """Zero every state buffer in place (storage is kept, so captured
        programs that point at it stay valid)."""
        buffers = dict(self.named_buffers())
        for name in self.state_names():
            buffers[name].zero_()

    def example_inputs(self, kind: str, batch: int, seq: int = 1, pos: int = 0) -> dict[str, Tensor]:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


def cast_model(model: ReferenceModel, dtype: torch.dtype) -> ReferenceModel:
    """Cast parameters and state buffers to ``dtype``; constants stay float32."""
    state = set(model.state_names())
    for param in model.parameters():
        param.data = param.data.to(dtype)
    for prefix, module in model.named_modules():
        for key, buf in list(module._buffers.items()):
            full = f"{prefix}.{key}" if prefix else key
            if buf is not None and full in state and buf.is_floating_point():
                module._buffers[key] = buf.to(dtype)
    return model


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random init: normal(0, std) for matrices and embeddings,
    ones for norm scales, small normal for biases. Models with special
    parameters (Mamba's A_log, ...) re-initialise those afterwards through
    their ``_init_special(generator)`` hook."""
    device = next(model.parameters()).device
    if device.type == "meta":
        return
    # Values are drawn on the parameters' device (fast for real sizes on GPU);
    # they are deterministic per (seed, device type).
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight":
            param.fill_(1.0)
            continue
        scale = std / 2 if (leaf == "bias" or param.dim() == 1) else std
        value = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32)
        param.copy_(value.mul_(scale))
    hook = getattr(model, "_init_special", None)
    if hook is not None:
        hook(gen)


def example_ids(vocab: int, shape: tuple[int, ...], device, seed: int = 1234) -> Tensor:
    """Deterministic example token ids."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=gen).to(device)


def lm_positions(kind: str, batch: int, seq: int, pos: int, device) -> Tensor:
    """``decode``: [B] all equal to ``pos``; ``prefill``: [B, seq] = pos..pos+seq-1."""
    if kind == "decode":
        return torch.full((batch,), pos, dtype=torch.int64, device=device)
    if kind == "prefill":
        return (pos + torch.arange(seq, device=device)).expand(batch, seq).contiguous()
    raise ValueError(f"unknown input kind {kind!r} (expected 'decode' or 'prefill')")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, result cast back to the input dtype.
    ``fewest_ops`` (:func:`use_fewest_ops`): one ``F.rms_norm`` call (the
    aten capture records it as one kernel) instead of its six ops (and a
    bfloat16 input's three casts); on a CPU the two give the same bits."""

    fewest_ops = False

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.fewest_ops:   # (aten's rms_norm computes a bfloat16/float16 input in float32 as below)
            if x.dtype == self.weight.dtype:
                return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def use_fewest_ops(model: nn.Module, on: bool = True) -> None:
    """Give every module of ``model`` that has one its fewest-ops form
    (``fewest_ops``; ``on=False``: the default form back).  The forms
    compute the same values (on a CPU the same bits) in fewer aten ops:
    what an executor that dispatches a captured graph op by op wants, as
    CPU deployments do.  The default form is the one compilers (inductor)
    are given: it fuses either way."""
    for m in model.modules():
        if hasattr(m, "fewest_ops"):
            m.fewest_ops = on


def add_lm_stack(module: nn.Module, cfg, block) -> None:
    """Give ``module`` a language model's stack, in this order: ``embed``
    (token embedding), ``layers`` (``cfg.n_layers`` blocks, each made by
    ``block()``), ``norm`` (the final RMSNorm) and ``lm_head``, tied to the
    embedding when ``cfg.tie_embeddings``."""
    module.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
    module.layers = nn.ModuleList(block() for _ in range(cfg.n_layers))
    module.norm = RMSNorm(cfg.dim, cfg.norm_eps)
    module.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
    if cfg.tie_embeddings:
        module.lm_head.weight = module.embed.weight


def rope_inv_freq(head_dim: int, theta: float, llama3_scaling: dict | None = None) -> Tensor:
    """Rotary inverse frequencies, optionally with Llama-3.1 frequency scaling
    (keys: factor, low_freq_factor, high_freq_factor, original_max_position)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if llama3_scaling:
        factor = llama3_scaling["factor"]
        low, high = llama3_scaling["low_freq_factor"], llama3_scaling["high_freq_factor"]
        orig = llama3_scaling["original_max_position"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((orig / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, blended)
        inv_freq = torch.where(wavelen < orig / high, inv_freq, scaled)
    return inv_freq.float()


def rope_tables(max_pos: int, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin tables of shape [max_pos, head_dim // 2] (float32)."""
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return angles.cos(), angles.sin()


def rope_full_width(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The tables [B, T, D/2] at full width [B, T, D] for :func:`apply_rope`'s
    four-op form: ``cat(cos, cos)`` and ``cat(-sin, sin)`` (made once a step,
    read by every layer)."""
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [B, T, H, D] in the half-split ("rotate_half") layout with
    ``cos``/``sin`` [B, T, D/2] already gathered at the token positions:
    ``x1 c - x2 s`` and ``x2 c + x1 s`` (seven ops).  With the tables at full
    width [B, T, D] (:func:`rope_full_width`) the same products and sums in
    four ops, bit for bit: ``x * cos + cat(x2, x1) * sin`` (``-sin`` on the
    first half; an exact negation), a bfloat16 ``x`` with no cast of its own."""
    half = x.shape[-1] // 2
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if cos.shape[-1] == x.shape[-1]:
        # float32 tables: a bfloat16 x is promoted inside the products, exactly as x.float() would be
        xf = x if cos.dtype == torch.float32 else x.float()
        return (xf * c + torch.cat([xf[..., half:], xf[..., :half]], dim=-1) * s).to(x.dtype)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class SwiGLU(nn.Module):
    """Llama feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def param_count(model: nn.Module) -> int:
    """Number of parameters (shared tensors counted once); works on meta."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total

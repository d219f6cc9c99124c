"""Router statistics of a warm-up batch (ATSInfer's expert load): which of
a mixture of experts' routed experts the tokens of a batch choose, per
layer, as the ``expert_load`` the offload planner reads
(:mod:`tessera_actors.planning.offload.load`).

:func:`router_load` runs the model once on the warm-up batch (a prompt
chunk per row, positions from 0) with a hook on every layer's router; the
model's KV cache is lent for the run (zeros of the meta model's shapes
where a served model dropped it) and put back as it was, so a host model
that engines share stays unchanged.  Blocking (a forward of the whole
model on its device)."""
from __future__ import annotations

import torch
from torch import Tensor

from tessera_actors.models.moe import Experts


@torch.no_grad()
def router_load(model: torch.nn.Module, input_ids: Tensor) -> dict[str, list[float]]:
    """``{weight name: [share of the tokens routed to each of its experts]}``
    for every routed expert weight (each part's ``gate_up`` and ``down``)
    of ``model`` on ``input_ids`` [B, T]: the fraction of the B*T tokens
    that have the expert among their top-k (a layer's shares sum to top_k)."""
    counts: dict[str, Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, Experts):
            def hook(_m, _args, logits, name=name, k=mod.cfg.top_k, e=mod.cfg.n_experts):
                top = torch.topk(logits, k, dim=-1).indices.reshape(-1)
                counts[name] = counts.get(name, 0) + torch.bincount(top, minlength=e).cpu()
            hooks.append(mod.router.register_forward_hook(hook))
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T).contiguous()
    try:
        with lent_state(model):
            model(input_ids=input_ids, positions=positions)
    finally:
        for h in hooks:
            h.remove()
    tokens = B * T
    out: dict[str, list[float]] = {}
    for name, c in counts.items():
        mod = model.get_submodule(name)
        shares = (c.double() / tokens).tolist()
        parts = mod.cfg.expert_parts
        per = len(shares) // parts
        for w in ("gate_up", "down"):
            if parts == 1:
                out[f"{name}.{w}"] = shares
            else:
                out.update({f"{name}.{w}.{j}": shares[j * per:(j + 1) * per] for j in range(parts)})
    return out


class lent_state:
    """The model's state buffers replaced by zeros of their full shape for
    the ``with`` block (the meta model's shapes), then put back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.kept: list[tuple[torch.nn.Module, str, Tensor]] = []

    def __enter__(self) -> "lent_state":
        model = self.model
        with torch.device("meta"):
            shapes = dict(type(model)(model.cfg).named_buffers())
        device = next(model.parameters()).device
        for name in model.state_names():
            path, _, buf = name.rpartition(".")
            mod = model.get_submodule(path) if path else model
            old = mod._buffers[buf]
            self.kept.append((mod, buf, old))
            mod._buffers[buf] = torch.zeros(shapes[name].shape, dtype=old.dtype, device=device)
        return self

    def __exit__(self, *exc) -> None:
        for mod, buf, old in self.kept:
            mod._buffers[buf] = old
        self.kept.clear()


__all__ = ["lent_state", "router_load"]

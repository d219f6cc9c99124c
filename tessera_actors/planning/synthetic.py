"""Synthetic transformer-like kernel graphs and cost tables, for tests and
the planner benchmark (no capture, no torch).

:func:`transformer_graph` builds ``layers`` repeated decoder blocks (12
kernels each: norm, q/k/v projections, rope, attention over a KV-cache
state buffer, output projection, residual add, norm, gate/up projections,
SiLU-mul, down projection, residual add) between an embedding and an LM
head; weights per layer; activations in a few reused temporary slots, so
WAR/WAW edges are real.  :func:`random_costs` gives every kernel signature a
random per-device slowdown, so kernels disagree about devices the way real
ones do, and equal signatures cost the same (tying repeated layers is exact).
"""
from __future__ import annotations

import random
from typing import Sequence

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.planning.costs import CostTable

_BLOCK = [  # name, scope suffix, flops factor (x tokens*hidden^2), weight factor (x hidden^2)
    ("rmsnorm", "input_layernorm", 0.0, 0.0),
    ("q_proj", "self_attn.q_proj", 2.0, 1.0),
    ("k_proj", "self_attn.k_proj", 0.5, 0.25),
    ("v_proj", "self_attn.v_proj", 0.5, 0.25),
    ("rope", "self_attn.rotary", 0.0, 0.0),
    ("attention", "self_attn.sdpa", 1.0, 0.0),
    ("o_proj", "self_attn.o_proj", 2.0, 1.0),
    ("add", "residual", 0.0, 0.0),
    ("rmsnorm", "post_attention_layernorm", 0.0, 0.0),
    ("gate_up", "mlp.gate_up_proj", 14.0, 7.0),
    ("silu_mul", "mlp.act", 0.0, 0.0),
    ("down_proj", "mlp.down_proj", 7.0, 3.5),
]


def transformer_graph(layers: int, hidden: int = 1024, tokens: int = 64, kv_tokens: int = 1024,
                      dtype_bytes: int = 2, state: bool = True) -> KernelGraph:
    """A decoder stack of ``layers`` blocks: ``12 * layers + 2`` kernels.
    With ``state`` each block's attention reads and appends to its own KV
    cache (role ``state``)."""
    bufs: dict[int, Buffer] = {}

    def buf(nbytes: int, role: str, name: str) -> int:
        bid = len(bufs)
        bufs[bid] = Buffer(bid, int(nbytes), role, name)
        return bid

    act = tokens * hidden * dtype_bytes
    x_in = buf(tokens * 4, "input", "ids")
    resid = buf(act, "temp", "resid")
    h = buf(act, "temp", "h")
    q = buf(act, "temp", "q")
    kv = buf(act // 2, "temp", "kv")
    mlp = buf(act * 7, "temp", "mlp")
    out = buf(tokens * 4, "output", "logits")
    emb = buf(hidden * hidden * dtype_bytes * 4, "weight", "embed")
    kernels: list[Kernel] = []

    def kern(name: str, acc: Sequence[tuple], flops: float, scope: str, layer: int, sig: str) -> None:
        accesses = tuple(Access(b, s, e, m) for b, s, e, m in acc)
        nb = float(sum(e - s for _, s, e, _ in acc))
        kernels.append(Kernel(len(kernels), name, "ptx" if flops == 0 else "library", accesses,
                              flops=flops, bytes=nb, signature=sig, layer=layer, scope=scope))

    kern("embedding", [(x_in, 0, tokens * 4, "r"), (emb, 0, bufs[emb].nbytes, "r"), (resid, 0, act, "w")],
         0.0, "embed_tokens", -1, "embedding")
    for lay in range(layers):
        w = {n: buf(hidden * hidden * dtype_bytes * wf, "weight", f"layers.{lay}.{n}")
             for n, _, _, wf in _BLOCK if wf > 0}
        cache = buf(kv_tokens * hidden * dtype_bytes, "state" if state else "temp", f"layers.{lay}.kv_cache")
        for name, scope, ff, wf in _BLOCK:
            fl = ff * tokens * hidden * hidden
            sc = f"layers.{lay}.{scope}"
            if name == "rmsnorm":
                acc = [(resid, 0, act, "r"), (h, 0, act, "w")]
            elif name in ("q_proj", "k_proj", "v_proj"):
                dst, size = (q, act) if name == "q_proj" else (kv, act // 4)
                off = 0 if name != "v_proj" else act // 4
                acc = [(h, 0, act, "r"), (w[name], 0, bufs[w[name]].nbytes, "r"), (dst, off, off + size, "w")]
            elif name == "rope":
                acc = [(q, 0, act, "rw"), (kv, 0, act // 4, "rw")]
            elif name == "attention":
                fl = 4.0 * tokens * kv_tokens * hidden
                acc = [(q, 0, act, "r"), (kv, 0, act // 2, "r"), (cache, 0, bufs[cache].nbytes, "rw"),
                       (h, 0, act, "w")]
            elif name == "o_proj":
                acc = [(h, 0, act, "r"), (w[name], 0, bufs[w[name]].nbytes, "r"), (q, 0, act, "w")]
            elif name == "add":
                acc = [(q, 0, act, "r"), (resid, 0, act, "rw")]
            elif name == "gate_up":
                acc = [(h, 0, act, "r"), (w[name], 0, bufs[w[name]].nbytes, "r"), (mlp, 0, act * 7, "w")]
            elif name == "silu_mul":
                acc = [(mlp, 0, act * 7, "r"), (mlp, 0, act * 7 // 2, "w")]
            else:  # down_proj writes into q, then the final add folds it into resid
                acc = [(mlp, 0, act * 7 // 2, "r"), (w[name], 0, bufs[w[name]].nbytes, "r"), (q, 0, act, "w")]
            kern(name, acc, fl, sc, lay, name)
    kern("lm_head", [(resid, 0, act, "r"), (emb, 0, bufs[emb].nbytes, "r"), (out, 0, tokens * 4, "w")],
         2.0 * tokens * hidden * hidden * 4, "lm_head", -1, "lm_head")
    return KernelGraph(kernels, bufs, inputs={"ids": x_in}, outputs=[out],
                       meta={"model": "synthetic-transformer", "layers": layers})


def random_costs(graph: KernelGraph, devices: Sequence[str], seed: int = 0,
                 spread: float = 2.0, base_s: float = 20e-6) -> CostTable:
    """Device 0 is the reference; on device ``d > 0`` every kernel signature
    is slower or faster by a random factor in ``[1/spread, spread]`` times
    a per-device speed in ``[1, 2]``.  Links: the estimate's defaults."""
    rng = random.Random(seed)
    speed = [1.0] + [rng.uniform(1.0, 2.0) for _ in devices[1:]]
    factor: dict[tuple[str, int], float] = {}
    times = []
    for k in graph.kernels:
        w = base_s * (1.0 + (k.flops / 1e9) + k.bytes / 1e8)
        row = []
        for d in range(len(devices)):
            key = (k.signature or f"#{k.id}", d)
            if key not in factor:
                factor[key] = 1.0 if d == 0 else speed[d] * spread ** rng.uniform(-1.0, 1.0)
            row.append(w * factor[key])
        times.append(row)
    est = CostTable.estimate(graph, devices)
    return CostTable(list(devices), times, est.latency, est.bandwidth, est.mem, "synthetic")

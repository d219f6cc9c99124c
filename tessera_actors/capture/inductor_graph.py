"""Kernel graph from an inductor recording: buffers (roles, packed temporaries),
kernels (``ptx`` launches and ``library`` aten calls), per-kernel layer/scope
from the weights they read, and the per-distinct-kernel texts in ``meta``.
Same buffer rules as the aten capture (:func:`.aten.capture`), plus: an
unnamed storage that gets written was allocated by inductor outside the
dispatcher, so it is a temporary, not state."""
from __future__ import annotations

import re
from typing import Any

import torch

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.capture.aten import CaptureError, CaptureResult, _pack_temps, _remap_payload
from tessera_actors.capture.inductor_match import pack_text
from tessera_actors.capture.pytree import flatten_outputs

_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)\.")


def assemble(rec, result: Any, inputs: dict[str, torch.Tensor], meta: dict[str, Any],
              reuse_temps: bool, compress: bool, keep_ptx: bool) -> CaptureResult:
    named = flatten_outputs(result)
    if not named:
        raise CaptureError(f"the compiled model returned no tensor (got {type(result).__name__})")
    outs = [t for _, t in named]
    if not rec.records:
        raise CaptureError("no kernel was recorded: is the model empty, or did the run hit a fallback?")
    storages = sorted(rec.storages.values(), key=lambda s: s["id"])
    out_ids = [rec._storage(t, producing=True) for t in outs]
    storages = sorted(rec.storages.values(), key=lambda s: s["id"])
    for b in out_ids:
        if storages[b]["role"] == "temp":
            storages[b]["role"] = "output"
    for r in rec.records:
        for b, _, _, m in r["accesses"]:
            if "w" not in m or storages[b]["role"] not in ("weight", "input"):
                continue
            if storages[b]["name"]:   # a provided (named) buffer that is written is state
                storages[b]["role"] = "state"
            else:                     # an unnamed storage inductor allocated outside the dispatcher
                storages[b]["role"], storages[b]["initial"] = "temp", None
    packed = _pack_temps(rec.records, storages) if reuse_temps else {}
    base = len(storages)
    remap = {b: base + slot for b, (slot, _) in packed.items()}
    buffers: dict[int, Buffer] = {}
    for s in storages:
        if s["id"] not in remap:
            buffers[s["id"]] = Buffer(s["id"], s["nbytes"], s["role"], s["name"], s["dtype"], s["shape"])
    for b, (slot, size) in packed.items():
        if base + slot not in buffers:
            buffers[base + slot] = Buffer(base + slot, size, "temp", f"slot{slot}", "uint8", (size,))
    names = {s["id"]: s["name"] for s in storages}
    places = _layers(rec.records, names, storages)
    kernels: list[Kernel] = []
    for i, r in enumerate(rec.records):
        acc = tuple(Access(remap.get(b, b), s, e, m) for b, s, e, m in r["accesses"])
        layer, scope = places[i]
        if r.get("kind") == "ptx":
            payload = _remap_payload(r["payload"], remap)
            kernels.append(Kernel(i, r["op"], "ptx", acc, bool(r["indirect"]), r["flops"],
                                  float(sum(a.nbytes for a in acc)), r["sig"], layer, scope, payload))
        else:
            payload = _remap_payload({"op": r["op"], "args": r["args"], "kwargs": r["kwargs"], "outs": r["outs"]},
                                     remap)
            kernels.append(Kernel(i, r["qual"].removeprefix("aten::"), "library", acc, False, r["flops"],
                                  float(sum(a.nbytes for a in acc)), r["sig"], layer, scope, payload))
    views = {"input_views": {n: _remap_payload(rec._ref(t), remap)["t"] for n, t in inputs.items()},
             "output_views": [_remap_payload(rec._ref(t), remap)["t"] for t in outs]}
    views.update(output_names=[n for n, _ in named], guards=rec.guards)
    meta.setdefault("constants", {})
    meta.update(backend="triton", **views, **_kernel_meta(rec, compress, keep_ptx))
    graph = KernelGraph(kernels, buffers, {n: rec._storage(t, False) for n, t in inputs.items()},
                        [remap.get(b, b) for b in out_ids], meta)
    values = {s["id"]: s["initial"] for s in storages
              if s["role"] in ("weight", "state") and s["initial"] is not None}
    return CaptureResult(graph, values, [t.detach().clone() for t in outs])


def _layers(records, names, storages) -> list[tuple[int, str]]:
    """(layer, scope) per kernel. Layer: from the layered weights it reads
    (``layers.N.``); a kernel reading none lies between two kernels of the same
    layer (then it is that layer's) or at a boundary (-1). Scope: the module
    of the first weight it reads, else the previous kernel's."""
    own: list[int | None] = []
    scopes: list[str] = []
    scope = ""
    for r in records:
        weights = [names[b] for b, _, _, _ in r["accesses"]
                   if storages[b]["role"] in ("weight", "state") and names[b]]
        layers = [int(m.group(1)) for w in weights if (m := _LAYER.search(w + "."))]
        own.append(layers[0] if layers else None)
        layered = [w for w in weights if _LAYER.search(w + ".")]
        if weights:
            scope = (layered or weights)[0].rsplit(".", 1)[0]
        scopes.append(scope)
    out = []
    prev = [None] * len(own)
    last = None
    for i, v in enumerate(own):
        prev[i] = last
        if v is not None:
            last = v
    nxt = None
    for i in range(len(own) - 1, -1, -1):
        v = own[i]
        if v is None:
            v = prev[i] if prev[i] is not None and prev[i] == nxt else -1
        else:
            nxt = own[i]
        out.append((v, scopes[i]))
    return out[::-1]


def _kernel_meta(rec, compress: bool, keep_ptx: bool) -> dict[str, Any]:
    ptx, src, kinfo, pinned, indirect = {}, {}, {}, [], []
    for k in rec.kernels.values():
        a = k["analysis"]
        if keep_ptx and k["launch"]["ptx"]:
            ptx[k["key"]] = pack_text(k["launch"]["ptx"], compress)
        if k["source"]:
            src[k["key"]] = pack_text(k["source"], compress)
        kinfo[k["key"]] = {"name": k["name"], "file": k["info"]["file"], "config": k["launch"]["config"],
                           "ptx_source": k["launch"]["ptx_source"], "indirect": a.indirect,
                           "error": a.error, "reasons": a.reasons[:5], "mutated": k["info"]["mutated"],
                           "arg_names": k["info"]["arg_names"],
                           "params": [[p.name, p.is_ptr, p.access] for p in a.params]}
        if a.error:
            pinned.append(k["key"])
        elif a.indirect:
            indirect.append(k["key"])
    return {"ptx": ptx, "triton_src": src, "triton_kernels": kinfo, "pinned": sorted(pinned),
            "indirect_kernels": sorted(indirect),
            "text_encoding": "zlib" if compress else "plain", "launches": rec.launches}

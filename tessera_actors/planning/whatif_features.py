"""Cost features of a kernel for the what-if model (:mod:`.whatif`), from the
graph alone: FLOPs, tensor-core use and dtype (aten schema in the payload;
the PTX's ``mma``/``wgmma`` count for Triton kernels), bytes (access sets
tightened by the launch), activation bytes and launch geometry (CTAs,
CTAs resident per SM).  Torch-free.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from tessera_actors.graph import KernelGraph
from tessera_actors.planning.costs import kernel_bytes

CLASSES = ("gemm", "attention", "attn_decode", "gather", "pointwise", "strided", "reduction", "t_pointwise", "t_reduction")
_GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_scaled_mm",
             "scaled_dot_product", "_flash_attention", "_efficient_attention", "cudnn_convolution")
_GATHER_OPS = ("embedding", "index", "index_select", "gather", "take", "index_put")
_REDUCE_OPS = ("sum", "mean", "amax", "amin", "max", "min", "softmax", "_softmax", "log_softmax", "norm",
               "var", "std", "cumsum", "native_layer_norm", "topk", "sort", "argmax", "prod", "any", "all")
_ITEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "int8": 1,
         "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int16": 2}
_DT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


@dataclass(frozen=True)
class KernelFeatures:
    """Cost features of one kernel (see module docstring)."""

    cls: str
    flops: float
    tensor: bool
    dtype: str
    bytes: float
    act_bytes: float
    ctas: int
    resident: int
    key: str = ""


def _tensors(obj, out: list) -> list:
    """Tensor refs ``[buf, offset, shape, stride, dtype]`` anywhere in a payload value."""
    if isinstance(obj, dict):
        if "t" in obj and isinstance(obj["t"], (list, tuple)) and len(obj["t"]) == 5:
            out.append(obj["t"])
        else:
            for v in obj.values():
                _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    return out


def _numel(t) -> int:
    return int(math.prod(t[2])) if t[2] else 1


def _nbytes(t) -> int:
    return _numel(t) * _ITEM.get(t[4], 4)


def _contiguous(t) -> bool:
    """Row-major dense (size-1 dimensions ignored); no strides recorded: assumed so."""
    shape, stride = t[2], t[3]
    if not stride or len(stride) != len(shape):
        return True
    want = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if n != 1 and st != want:
            return False
        want *= n
    return True


def _op(kernel) -> str:
    p = kernel.payload if isinstance(kernel.payload, dict) else {}
    op = str(p.get("op", kernel.name))
    return op.split(".")[1] if op.startswith("aten.") else op.split(".")[0]


def _ptx_mma(graph: KernelGraph, name: str, cache: dict) -> int:
    """Tensor-core instruction count in the kernel's PTX (0 when unavailable)."""
    if name in cache:
        return cache[name]
    n = 0
    text = (graph.meta.get("ptx") or {}).get(name)
    if text is not None:
        try:
            from ptx.features import kernel_features
            from ptx.parser import parse
            if isinstance(text, (bytes, bytearray)):
                text = zlib.decompress(text).decode()
            mod = parse(text)
            fn = mod.functions.get(name) or next(iter(mod.entries), None)
            n = kernel_features(fn, mod)["mma"] if fn is not None else 0
        except Exception:      # an unparsable text: counted as no tensor cores
            n = 0
    cache[name] = n
    return n


def _role_bytes(graph: KernelGraph, kernel) -> tuple[float, float]:
    """(total, activation) access bytes: activations are neither weights nor state."""
    tot = act = 0.0
    for a in kernel.accesses:
        nb = a.nbytes * (a.reads + a.writes)
        tot += nb
        if graph.buffers[a.buffer].role not in ("weight", "state"):
            act += nb
    return tot, act


def _gemm_geometry(op: str, ts: list) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a GEMM-like op from its tensor arguments."""
    mats = [t for t in ts if len(t[2]) >= 2]
    if len(mats) < 2:
        return 1, 1, 1, 1
    a, b = mats[-2], mats[-1]
    if op in ("addmm", "baddbmm") and len(mats) >= 3:
        a, b = mats[1], mats[2]
    batch = int(math.prod(a[2][:-2])) if len(a[2]) > 2 else 1
    m, k = a[2][-2], a[2][-1]
    n = b[2][-1] if op != "linear" else b[2][0]
    return max(batch, 1), max(m, 1), max(n, 1), max(k, 1)


def kernel_features(graph: KernelGraph, k: int, ptx_cache: dict | None = None) -> KernelFeatures:
    """Features of kernel ``k`` of ``graph``."""
    kern = graph.kernels[k]
    p = kern.payload if isinstance(kern.payload, dict) else {}
    op = _op(kern)
    ts = _tensors(p.get("args", []), [])
    outs = _tensors(p.get("outs", []), [])
    acc_bytes, act_bytes = _role_bytes(graph, kern)
    nbytes = kernel_bytes(graph, k)
    dtype = next((_DT[t[4]] for t in ts + outs if t[4] in _DT), "fp32")
    flops, tensor, resident = float(kern.flops), False, 8
    if kern.kind == "ptx":
        cfg = p.get("config", {}) or {}
        kw = cfg.get("kwargs", {}) or {}
        warps = int(cfg.get("num_warps", 4) or 4)
        resident = max(1, min(16, 32 // warps))
        info = (graph.meta.get("triton_kernels") or {}).get(p.get("triton", kern.name), {})
        names = [n for n in info.get("arg_names", []) if not n.endswith("BLOCK")]
        args = p.get("args", [])
        ints = {n: v for n, v in zip(names, args) if isinstance(v, int) and not isinstance(v, bool)}
        numel = {d: ints.get(f"{d}numel", 1) for d in ("x", "y", "z", "r0_")}
        ctas = 1
        for d, blk in (("x", "XBLOCK"), ("y", "YBLOCK"), ("z", "ZBLOCK")):
            ctas *= max(1, math.ceil(numel[d] / max(int(kw.get(blk, numel[d]) or 1), 1)))
        touched = numel["x"] * numel["y"] * numel["z"] * numel["r0_"]
        bound = sum(min(_nbytes(t), touched * _ITEM.get(t[4], 4)) for t in ts)
        if bound > 0:
            scale = min(1.0, bound / max(nbytes, 1.0))
            nbytes, act_bytes = nbytes * scale, act_bytes * scale
        tensor = _ptx_mma(graph, p.get("triton", kern.name), ptx_cache if ptx_cache is not None else {}) > 0
        name = kern.name
        cls = "gemm" if tensor or "_tem_" in name else ("t_reduction" if ("_red_" in name or "_per_" in name)
                                                         else "t_pointwise")
    elif "scaled_dot_product" in op or op.endswith("_attention") or "_attention_forward" in op:
        # fused attention (flash / efficient / cuDNN SDPA): tensor-core GEMMs QK^T and PV,
        # 4 * Lq * Lk * D FLOPs per head (the capture's count is not that); a CTA per
        # 128 query rows per head, split over the keys when that leaves SMs idle
        cls, tensor, resident = "attention", dtype in ("bf16", "fp16", "fp8"), 1
        q, kv = (ts[0], ts[1]) if len(ts) >= 2 and len(ts[0][2]) >= 2 and len(ts[1][2]) >= 2 else (None, None)
        if q is not None:
            lk, heads_rows = kv[2][-2], _numel(q) // max(q[2][-1], 1)
            flops = max(flops, 4.0 * _numel(q) * lk)
            tiles = int(math.prod(q[2][:-2])) * math.ceil(q[2][-2] / 128) if len(q[2]) > 2 else \
                math.ceil(heads_rows / 128)
            ctas = tiles * max(1, min(lk // 256, math.ceil(264 / max(tiles, 1))))
            if len(q[2]) >= 2 and q[2][-2] < 16:
                # decode: a few query rows per KV head fill a sliver of a tensor-core tile, so the
                # kernel runs at CUDA-core rates (H200, cuDNN SDPA: ~13 TFLOP/s at 4 rows)
                cls, tensor = "attn_decode", False
        else:
            ctas = 1
    elif any(op == g or op.startswith(g) for g in _GEMM_OPS):
        cls, tensor = "gemm", dtype in ("bf16", "fp16", "fp8")
        batch, m, n, kk = _gemm_geometry(op, ts)
        tiles = batch * math.ceil(m / 128) * math.ceil(n / 128)
        ctas = tiles * max(1, min(kk // 256, math.ceil(264 / tiles)))       # split-K fills a GPU
        resident = 1
    elif op.rstrip("_") in _GATHER_OPS:
        cls = "gather"
        vals = ts[2] if op.startswith("index_put") and len(ts) > 2 else (outs[0] if outs else None)
        if vals is not None:
            nbytes = act_bytes = 2.0 * _nbytes(vals) + sum(_nbytes(t) for t in ts if t[4].startswith("int"))
        ctas = max(1, math.ceil((_numel(vals) if vals is not None else 1) / 512))
    else:
        cls = "reduction" if op.rstrip("_") in _REDUCE_OPS else "pointwise"
        if cls == "pointwise" and any(_numel(t) > 4096 and not _contiguous(t) for t in ts):
            cls = "strided"      # a transposing copy: scattered accesses
        big = max(ts + outs, key=_numel, default=None)
        n = _numel(big) if big is not None else 1
        # a reduction runs a CTA per row of its (last-dimension) reduction
        ctas = max(1, n // max(big[2][-1] if big is not None and big[2] else 1, 1)) if cls == "reduction" \
            else math.ceil(n / 512)
    key = kern.signature or f"{kern.name}#{k}"
    return KernelFeatures(cls, flops, tensor, dtype, float(nbytes), float(min(act_bytes, nbytes)),
                          int(max(ctas, 1)), int(resident), key)


def graph_features(graph: KernelGraph) -> list[KernelFeatures]:
    cache: dict = {}
    return [kernel_features(graph, k.id, cache) for k in graph.kernels]

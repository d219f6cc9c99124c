"""Access modes of one generated (Triton) kernel launch: pure functions, no torch.

Inputs are plain data: the launch's Python arguments (name + kind), the
kernel's PTX text, and inductor's own naming of the parameters
(``in_ptrN`` read, ``out_ptrN`` write, ``in_out_ptrN`` read-write, plus
``mutated_arg_names``). Output: one access mode per tensor argument.

Rules (the cardinal one: never miss a write):

* PTX pointer parameters (declared ``.ptr``) are matched **by position** to
  the tensor arguments; Triton appends hidden pointer parameters (global /
  profile scratch) after them, which are reported but touch no graph buffer.
  Fewer PTX pointers than tensor arguments -> no match -> the kernel is pinned.
* The PTX analysis and inductor's metadata are merged by union of reads and
  union of writes; every disagreement is reported.
* A write is a full overwrite (``w``) only when we know every byte of the
  recorded range is written: inductor says ``out_ptr`` (not mutated), the
  PTX says write-only, and the caller verified the view is dense and its
  element count equals the kernel's iteration space. Any other write is
  ``rw``, so a placement that cuts an edge still moves the old bytes.
* An indirect kernel (PTX analysis) or one whose PTX cannot be analysed:
  every tensor argument ``rw``, kernel pinned.
"""
from __future__ import annotations

import re
import zlib
from typing import Any
from dataclasses import dataclass, field

_ROLE = re.compile(r"^(in_out_ptr|in_ptr|out_ptr)\d+$")


@dataclass(frozen=True)
class PtxParam:
    index: int
    name: str
    is_ptr: bool
    access: str  # none | read | write | readwrite


@dataclass
class KernelAnalysis:
    """Result of analysing one kernel's PTX (or failing to)."""

    entry: str = ""
    params: list[PtxParam] = field(default_factory=list)
    indirect: bool = False
    reasons: list[str] = field(default_factory=list)
    error: str = ""  # non-empty: analysis failed, kernel must be pinned


@dataclass
class LaunchAccess:
    """Per tensor argument (by position in the launch): mode or None (untouched)."""

    modes: dict[int, str | None]
    indirect: bool
    pinned_reason: str = ""
    disagreements: list[str] = field(default_factory=list)
    hidden_params: list[str] = field(default_factory=list)


def analyze_ptx(text: str | None, kernel_name: str) -> KernelAnalysis:
    """Run the ``ptx`` analyzer on ``text`` and pick the entry ``kernel_name``
    (or the only entry). Never raises: failures come back in ``error``."""
    if not text:
        return KernelAnalysis(error="no PTX found for this kernel")
    try:
        from ptx import analyze_module, parse
        module = parse(text)
        results = analyze_module(module)
    except Exception as e:  # any analyzer failure pins the kernel, never a wrong graph
        return KernelAnalysis(error=f"PTX analysis failed: {type(e).__name__}: {e}")
    entries = {f.name: f for f in module.entries}
    name = kernel_name if kernel_name in results else (next(iter(results)) if len(results) == 1 else None)
    if name is None:
        return KernelAnalysis(error=f"PTX has entries {sorted(results)}, none is {kernel_name!r}")
    res, fn = results[name], entries.get(name)
    decl = {p.name: p for p in (fn.params if fn is not None else [])}
    params = []
    for p in res.params:
        d = decl.get(p.name)
        is_ptr = bool(getattr(d, "is_ptr", False)) if d is not None else bool(p.pointer)
        params.append(PtxParam(p.index, p.name, is_ptr, p.access))
    if params and not any(p.is_ptr for p in params):
        # PTX without ``.ptr`` attributes: every 64-bit parameter may be a pointer
        params = [PtxParam(p.index, p.name, p.access != "none" or _is_u64(decl.get(p.name)), p.access)
                  for p in params]
    return KernelAnalysis(name, params, bool(res.indirect), list(res.reasons))


def _is_u64(decl) -> bool:
    return decl is not None and str(getattr(decl, "type", "")).lstrip(".") in ("u64", "b64", "s64")


def inductor_opinion(name: str | None, mutated: set[str]) -> tuple[bool, bool] | None:
    """(reads, writes) from inductor's parameter naming, or None if it has none."""
    if not name:
        return None
    m = _ROLE.match(name)
    if m is None and name not in mutated:
        return None
    reads = bool(m) and m.group(1) in ("in_ptr", "in_out_ptr")
    writes = (bool(m) and m.group(1) in ("out_ptr", "in_out_ptr")) or name in mutated
    if name in mutated:
        reads = True  # a mutated buffer keeps its other bytes: treat as read-modify-write
    return reads, writes


def merge_access(ptx_access: str, name: str | None, mutated: set[str], full_cover: bool
                 ) -> tuple[str | None, str]:
    """Mode for one tensor argument and a disagreement note ('' if none)."""
    p_r = ptx_access in ("read", "readwrite")
    p_w = ptx_access in ("write", "readwrite")
    op = inductor_opinion(name, mutated)
    note = ""
    if op is not None:
        i_r, i_w = op
        if i_w != p_w:  # only write disagreements matter for soundness
            note = f"{name}: ptx={ptx_access} inductor={'r' if i_r else ''}{'w' if i_w else ''}"
        reads, writes = p_r or i_r, p_w or i_w
    else:
        reads, writes = p_r, p_w
    if not reads and not writes:
        return None, note
    if not writes:
        return "r", note
    exact = (full_cover and not reads and ptx_access == "write" and op is not None
             and name is not None and name.startswith("out_ptr") and name not in mutated)
    return ("w" if exact else "rw"), note


def launch_access(args: list[tuple[str | None, str]], analysis: KernelAnalysis,
                  mutated: set[str], full_cover: dict[int, bool]) -> LaunchAccess:
    """Access modes of a launch. ``args``: (name, kind) per positional argument,
    kind ``tensor`` or anything else; ``full_cover[i]``: tensor ``i``'s view is
    dense and matches the iteration space (see module docstring)."""
    tensors = [i for i, (_, kind) in enumerate(args) if kind == "tensor"]
    pinned = LaunchAccess({i: "rw" for i in tensors}, True)
    if analysis.error:
        pinned.pinned_reason = analysis.error
        return pinned
    ptrs = [p for p in analysis.params if p.is_ptr]
    if len(ptrs) < len(tensors):
        pinned.pinned_reason = (f"{len(tensors)} tensor arguments but only {len(ptrs)} PTX pointer "
                                f"parameters: cannot match them")
        return pinned
    out = LaunchAccess({}, analysis.indirect)
    out.hidden_params = [f"{p.name}:{p.access}" for p in ptrs[len(tensors):]]
    for j, i in enumerate(tensors):
        name = args[i][0]
        if analysis.indirect:
            out.modes[i] = "rw"
            continue
        mode, note = merge_access(ptrs[j].access, name, mutated, full_cover.get(i, False))
        out.modes[i] = mode
        if note:
            out.disagreements.append(note)
    if analysis.indirect:
        out.pinned_reason = "indirect: " + "; ".join(analysis.reasons[:3])
    return out


# -- texts stored in graph.meta (PTX, generated sources) ------------------------
def pack_text(text: str, compress: bool) -> Any:
    return zlib.compress(text.encode(), 6) if compress else text


def unpack_text(v: Any) -> str:
    """Text stored by :func:`pack_text` (plain or zlib bytes)."""
    if isinstance(v, (bytes, bytearray)):
        return zlib.decompress(v).decode()
    return v or ""


def ptx_text(graph, key: str) -> str:
    """PTX text of distinct kernel ``key`` of a captured graph ('' if not kept)."""
    return unpack_text(graph.meta.get("ptx", {}).get(key))


def triton_source(graph, key: str) -> str:
    """Generated Triton module source of kernel ``key`` ('' if not kept)."""
    return unpack_text(graph.meta.get("triton_src", {}).get(key))


# -- re-deriving a captured graph's Triton accesses (CPU, no torch) -------------
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "uint16": 2, "uint32": 4,
             "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}


def ref_span(ref) -> tuple[int, int]:
    """[first, last+1) bytes a tensor reference ``[buffer, offset, shape, strides, dtype]``
    can touch (the same rule as :func:`tessera_actors.capture.aten.byte_span`)."""
    _, off, shape, stride, dt = ref
    if dt not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {dt!r} in a tensor reference")
    if any(s == 0 for s in shape):
        return (0, 0)
    last = sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
    return (off, off + (last + 1) * _ITEMSIZE[dt])


def ref_numel(ref) -> int:
    n = 1
    for s in ref[2]:
        n *= s
    return n


def ref_dense(ref) -> bool:
    s, e = ref_span(ref)
    return e - s == ref_numel(ref) * _ITEMSIZE[ref[4]]


def launch_inputs(args: list, names: list[str]) -> tuple[list[tuple[str | None, str]], dict[int, bool]]:
    """(name, kind) per recorded launch argument and which tensor arguments are
    dense and match the iteration space (product of the ``*numel`` scalars)."""
    named = [(names[i] if i < len(names) else None,
              "tensor" if isinstance(a, dict) and "t" in a else "scalar") for i, a in enumerate(args)]
    numels = [int(a) for (n, _), a in zip(named, args)
              if n and n.endswith("numel") and isinstance(a, int) and not isinstance(a, bool)]
    spaces = set(numels)
    if numels:
        p = 1
        for x in numels:
            p *= x
        spaces.add(p)
    cover = {i: ref_dense(a["t"]) and ref_numel(a["t"]) in spaces
             for i, a in enumerate(args) if named[i][1] == "tensor"}
    return named, cover


def reanalyze(graph):
    """The graph with every ``ptx`` kernel's accesses re-derived from its stored
    PTX and launch record by the current ``ptx`` analyzer (e.g. after the
    analyzer improved, or to check a fixture). Kernels whose PTX was not kept,
    or whose graph predates stored argument names, are left unchanged and
    listed in ``meta["reanalysis_skipped"]``."""
    from dataclasses import replace

    from tessera_actors.graph import Access, KernelGraph
    kinfo = graph.meta.get("triton_kernels", {})
    cache: dict[str, KernelAnalysis] = {}
    kernels, skipped, pinned, indirect = [], set(), set(), set()
    for k in graph.kernels:
        p = k.payload if isinstance(k.payload, dict) else {}
        key = p.get("key")
        info = kinfo.get(key) if key else None
        if k.kind != "ptx" or info is None or "arg_names" not in info or not ptx_text(graph, key):
            if k.kind == "ptx":
                skipped.add(key or k.name)
            kernels.append(k)
            continue
        if key not in cache:
            cache[key] = analyze_ptx(ptx_text(graph, key), info.get("name", k.name))
        named, cover = launch_inputs(p["args"], info["arg_names"])
        acc = launch_access(named, cache[key], set(info.get("mutated", [])), cover)
        accesses = tuple(Access(a["t"][0], *ref_span(a["t"]), acc.modes[i]) for i, a in enumerate(p["args"])
                         if named[i][1] == "tensor" and acc.modes.get(i))
        meta = {"disagreements": acc.disagreements, "pinned": acc.pinned_reason, "hidden": acc.hidden_params}
        (pinned if cache[key].error else indirect if acc.indirect else set()).add(key)
        kernels.append(replace(k, accesses=accesses, indirect=acc.indirect, payload=dict(p, meta=meta),
                               bytes=float(sum(a.nbytes for a in accesses))))
    pinned |= {key for key in graph.meta.get("pinned", []) if key in skipped}
    meta = dict(graph.meta, pinned=sorted(pinned), indirect_kernels=sorted(indirect),
                reanalysis_skipped=sorted(skipped))
    return KernelGraph(kernels, graph.buffers, dict(graph.inputs), list(graph.outputs), meta)

"""Record one forward pass compiled by torch inductor as a kernel program (CUDA).

The model is compiled (``torch.compile``, inductor, ``fullgraph``, default
mode, no CUDA graphs), warmed up (compilation and autotuning happen there),
then run once more while two recorders are active, in program order:

* every Triton kernel launch, intercepted at inductor's runtime launcher
  (``CachingAutotuner.run``, see :mod:`.inductor_hooks`): a ``ptx`` kernel
  whose tensor arguments become byte-range accesses with modes from the PTX
  analyzer merged with inductor's metadata (:mod:`.inductor_match`);
* every aten op inductor's wrapper calls (extern ``mm``/``addmm``/``bmm``
  with ``out=``, fallbacks, copies back into mutated inputs) through a
  ``TorchDispatchMode``: ``library`` kernels with schema semantics, recorded
  by the aten capture's recorder (:mod:`.aten`).

Storages become buffers exactly as in the aten capture (weights, state,
inputs, outputs, temporaries packed into reusable slots). A Triton kernel's
payload names its generated module file and kernel, the captured config and
its arguments (tensor references and scalars), so
:class:`tessera_actors.execution.triton.TritonProgram` can replay it; each distinct
kernel's PTX and source are stored once in ``graph.meta`` (zlib-compressed
when ``compress``). A kernel whose PTX is missing or cannot be analysed is
pinned (``indirect``) with every tensor argument read-write, and listed in
``graph.meta["pinned"]`` - never a silently wrong graph. Kernels the PTX
analysis finds indirect are listed in ``graph.meta["indirect_kernels"]``.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

import torch

from tessera_actors.capture import inductor_hooks as hooks
from tessera_actors.capture.aten import CaptureError, CaptureResult, _Recorder, byte_span, module_roles
from tessera_actors.capture.hostreads import host_read_sites, python_level_reads
from tessera_actors.capture.pytree import encode_constant, flatten_inputs
from tessera_actors.capture.inductor_graph import assemble
from tessera_actors.capture.inductor_match import (KernelAnalysis, analyze_ptx, inductor_opinion, launch_access, ptx_text,
                             triton_source, unpack_text)

log = logging.getLogger("tessera.capture.inductor")

_ALLOC = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
          "aten::new_empty_strided"}


def dense(t: torch.Tensor) -> bool:
    """Every byte of the view's span belongs to exactly one element."""
    s, e = byte_span(t)
    return e - s == t.numel() * t.element_size()


class _InductorRecorder(_Recorder):
    """The aten recorder plus allocations, partial ``out=`` writes and Triton launches."""

    def __init__(self, roles, scope, keep_ptx: bool) -> None:
        super().__init__(roles, scope)
        self.suspended = 0
        self.keep_ptx = keep_ptx
        self.kernels: dict[tuple, dict[str, Any]] = {}   # distinct Triton kernels
        self.launches = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # do not make dynamo skip the compiled frame
        return True

    # -- aten ops ---------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:  # ops inside a Triton launch (scratch allocation)
            return func(*args, **kwargs)
        qual = func._schema.name
        if func.is_view:  # no data touched; do not let a first sighting make a temp a weight
            return func(*args, **kwargs)
        if qual in _ALLOC:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                self._storage(out, producing=True)
            return out
        written = list(self._written(func, args, kwargs))
        for t in written:
            if t.untyped_storage()._cdata not in self.storages and t.untyped_storage()._cdata not in self.roles:
                self._storage(t, producing=True)
        n = len(self.records)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.records) > n:
            self.records[-1]["kind"] = "library"
            partial = {(self._storage(t, False), *byte_span(t)) for t in written if not dense(t)}
            if partial:
                self.records[-1]["accesses"] = [(b, s, e, "rw" if (b, s, e) in partial and m == "w" else m)
                                                for b, s, e, m in self.records[-1]["accesses"]]
        return out

    @staticmethod
    def _written(func, args, kwargs):
        schema = func._schema.arguments
        for i, a in enumerate(schema):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor):
                    yield t

    # -- Triton launches --------------------------------------------------
    def on_launch(self, tuner, args: tuple, kwargs: dict, call: Callable[[], Any]) -> Any:
        k = self._kernel(tuner)
        tensor_kwargs = [n for n, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if tensor_kwargs:  # not inductor's calling convention: refuse rather than guess positions
            raise CaptureError(f"Triton kernel {k['name']} was launched with tensor keyword arguments "
                               f"{tensor_kwargs}; the capture cannot match them to PTX parameters")
        names = k["info"]["arg_names"]
        named = [(names[i] if i < len(names) else None, "tensor" if isinstance(a, torch.Tensor) else "scalar")
                 for i, a in enumerate(args)]
        numels = [int(a) for (n, _), a in zip(named, args) if n and n.endswith("numel") and isinstance(a, int)]
        spaces = set(numels)
        if numels:
            spaces.add(_prod(numels))
        cover = {i: dense(a) and a.numel() in spaces for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        acc = launch_access(named, k["analysis"], set(k["info"]["mutated"]), cover)
        mutated = set(k["info"]["mutated"])
        for i, a in enumerate(args):  # register first sightings before the kernel writes
            if isinstance(a, torch.Tensor):
                op = inductor_opinion(named[i][0], mutated)
                writes = "w" in (acc.modes.get(i) or "") or bool(op and op[1])
                key = a.untyped_storage()._cdata
                self._storage(a, producing=writes and key not in self.roles and key not in self.storages)
        self.suspended += 1
        try:
            result = call()
        finally:
            self.suspended -= 1
        self.launches += 1
        if k["analysis"].error.startswith("no PTX") and hooks.chosen_launcher(tuner) is not None:
            del self.kernels[id(tuner)]  # compiled during this very launch: analyse now
            k = self._kernel(tuner)
            acc = launch_access(named, k["analysis"], mutated, cover)
        accesses, enc = [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                ref = self._ref(a)
                enc.append(ref)
                mode = acc.modes.get(i)
                if mode:
                    accesses.append((ref["t"][0], *byte_span(a), mode))
            else:
                enc.append(_scalar(a))
        extra = {n: _scalar(v) for n, v in kwargs.items() if n != "stream" and not isinstance(v, torch.Tensor)}
        flops = float(max([t.numel() for t in args if isinstance(t, torch.Tensor)] or [0]))
        shapes = ",".join(f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}" if isinstance(a, torch.Tensor)
                          else repr(a) for a in args)
        meta = {"disagreements": acc.disagreements, "pinned": acc.pinned_reason, "hidden": acc.hidden_params}
        self.records.append({"kind": "ptx", "op": k["name"], "qual": k["name"], "accesses": accesses,
                             "scope": "", "sig": f"{k['name']}({shapes})", "flops": flops,
                             "indirect": acc.indirect, "key": k["key"],
                             "payload": {"triton": k["info"]["name"], "file": k["info"]["file"], "key": k["key"],
                                         "config": k["launch"]["config"], "args": enc, "kwargs": extra,
                                         "device": a_device(args), "meta": meta}})
        return result

    def _kernel(self, tuner) -> dict[str, Any]:
        """Static facts + PTX analysis of a tuner, computed once per distinct kernel."""
        ident = id(tuner)
        k = self.kernels.get(ident)
        if k is not None:
            return k
        info = hooks.kernel_info(tuner)
        launch = hooks.launch_info(tuner)
        analysis = analyze_ptx(launch["ptx"], info["name"]) if launch["ptx"] else \
            KernelAnalysis(error=f"no PTX: {launch['ptx_source']}")
        key = info["name"]
        while any(v["key"] == key for v in self.kernels.values()):
            key += "+"
        hooks.remember(tuner)
        k = {"name": info["name"], "key": key, "info": info, "launch": launch, "analysis": analysis,
             "source": _read_source(info["file"])}
        self.kernels[ident] = k
        log.info("triton kernel %s: file=%s ptx=%s indirect=%s error=%s", key, info["file"],
                 launch["ptx_source"], analysis.indirect, analysis.error)
        return k


def a_device(args) -> int:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "cuda":
            return int(a.device.index or 0)
    return 0


def _prod(xs: list[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _scalar(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return {"dt": str(v).removeprefix("torch.")}
    raise CaptureError(f"Triton launch argument of type {type(v).__name__} cannot be recorded")


def _read_source(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""


# -- capture ------------------------------------------------------------------
def repeated_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost repeated blocks of ``model``: the children of every
    ``nn.ModuleList`` that holds two or more modules of one type (decoder
    layers, ViT blocks, DiT blocks), not looking inside a block already
    taken (an MoE layer's expert list is part of its layer)."""
    taken: list[tuple[str, torch.nn.Module]] = []
    prefixes: list[str] = []
    for name, mod in model.named_modules():
        if any(name.startswith(p) for p in prefixes):
            continue
        if isinstance(mod, torch.nn.ModuleList) and len(mod) >= 2 and len({type(m) for m in mod}) == 1:
            for i, child in enumerate(mod):
                taken.append((f"{name}.{i}" if name else str(i), child))
            prefixes.append(f"{name}." if name else "")
    return taken


def choose_regions(model: torch.nn.Module, inputs: dict[str, Any], regions: str = "auto") -> tuple[str, str]:
    """(regions, reason): ``"auto"`` becomes ``"whole"`` when the model has
    repeated blocks and its eager forward reads tensor values on the host
    (code between compiled blocks runs eagerly; compiled as one graph it is
    traced instead); otherwise ``regions`` is kept.  Runs ``model(**inputs)``
    once eagerly when it has to look (the caller restores any state), after
    dropping earlier in-place compiles (:func:`drop_compiled`)."""
    if regions != "auto" or not repeated_blocks(model):
        return regions, ""
    drop_compiled(model)   # the probe runs the eager model
    with torch.no_grad():
        sites = host_read_sites(model, inputs)
    if not sites:
        return regions, ""
    reason = (f"host reads in the eager forward ({len(sites)}, first at {sites[0]}): "
              "compiled as one graph instead of per block")
    log.info("%s", reason)
    return "whole", reason


def compile_model(model: torch.nn.Module, *, reset: bool = True, regions: str = "auto") -> Callable[..., Any]:
    """``torch.compile`` with inductor, fullgraph, static shapes, no CUDA graphs.

    ``regions``: ``"whole"`` compiles the whole model as one graph;
    ``"blocks"`` compiles each repeated block in place (``Module.compile``),
    and the parameter-holding leaves around them (a final norm:
    :func:`_between_blocks`), and runs the rest of the code around them eagerly - the blocks share one compiled
    graph, so a 32-layer model compiles about as fast as a one-layer one;
    ``"auto"`` (default) takes blocks when the model has repeated blocks.
    The kernel program is recorded either way (eager ops between blocks are
    recorded as library kernels)."""
    import torch._dynamo
    import torch._inductor.config as icfg
    if regions not in ("auto", "whole", "blocks"):
        raise ValueError(f"regions must be 'auto', 'whole' or 'blocks', not {regions!r}")
    if reset:
        torch._dynamo.reset()
        drop_compiled(model)
    try:
        icfg.triton.cudagraphs = False
    except AttributeError:
        pass
    blocks = repeated_blocks(model) if regions != "whole" else []
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, len(blocks) + 8, getattr(torch._dynamo.config, name)))
    if regions == "blocks" and not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (an nn.ModuleList of one module type)")
    if not blocks:
        return torch.compile(model, backend="inductor", fullgraph=True, dynamic=False)
    for _, block in blocks + [(name, m) for name, m in _between_blocks(model, blocks)]:
        block.compile(backend="inductor", fullgraph=True, dynamic=False)
    log.info("compiling %d repeated blocks of %s in place", len(blocks), type(model).__name__)
    return model


def drop_compiled(model: torch.nn.Module) -> None:
    """Undo earlier in-place compiles (``Module.compile``) of ``model``'s
    modules.  One model captured bucket after bucket keeps its blocks
    compiled for the last bucket's shapes; the next bucket's eager probe
    (:func:`choose_regions`) would run them compiled under its dispatch mode,
    which dynamo skips or refuses, and the warm-up and the recorded run
    would not agree on which frames are compiled."""
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None


def _between_blocks(model: torch.nn.Module, blocks) -> list[tuple[str, torch.nn.Module]]:
    """The modules that run between or after the repeated blocks and are
    worth compiling on their own: leaves with parameters of their own, other
    than a ``Linear`` or an ``Embedding`` (one library kernel either way) -
    a final norm, which run eagerly is six kernels in float32 (about 20 us of
    a Llama decode step of 64 rows on an H200) and compiled is one - and
    those marked ``compile_alone`` (``serving.gpu_capture.GreedyHead``)."""
    under = [name + "." for name, _ in blocks]
    return [(name, m) for name, m in model.named_modules()
            if m is not model and not any(name.startswith(u) for u in under)
            and not any(True for _ in m.children())
            and (getattr(m, "compile_alone", False) or any(True for _ in m.parameters(recurse=False)))
            and not isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]


def _warm_up(compiled, inputs: dict[str, Any], warmup: int, device: torch.device, times: dict[str, float],
             t0: float, label: str) -> None:
    """Run the compiled model ``warmup`` times (compilation, autotuning);
    a failure is a :class:`CaptureError`."""
    try:
        with torch.no_grad():
            for i in range(max(1, warmup)):
                compiled(**inputs)
                _sync(device)
                if i == 0:
                    times["compile_s"] = time.perf_counter() - t0
    except CaptureError:
        raise
    except Exception as e:
        text = str(e)
        frames = re.findall(r'File "([^"]+)", line (\d+)', text)  # dynamo names the user code it stopped at
        where = f" (at {frames[-1][0]}:{frames[-1][1]})" if frames else ""
        raise CaptureError(f"torch.compile (inductor) failed for {label}: "
                           f"{type(e).__name__}: {text.splitlines()[0] if text else ''}{where}") from e


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _unique_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return -1


def _compiled_and_warm(model, inputs, compiled, regions: str, warmup: int, device: torch.device,
                       times: dict[str, float], t0: float, say, restore) -> tuple[Callable[..., Any], str]:
    """(the compiled model, warmed up; why its regions were chosen).  A whole
    graph chosen for its host reads that does not compile is compiled per
    block after all, its host reads guarded."""
    reason = ""
    if compiled is None:
        say("choosing regions")
        regions, reason = choose_regions(model, inputs, regions)
        restore()
    say("compiling")
    given = compiled
    if compiled is None:
        compiled = compile_model(model, regions=regions)
    try:
        _warm_up(compiled, inputs, warmup, device, times, t0, type(model).__name__)
    except CaptureError as e:
        if not reason or given is not None:
            raise
        reason += f"; the whole graph failed ({e}): compiled per block, host reads guarded"
        log.info("%s", reason)
        restore()
        compiled = compile_model(model, regions="blocks")
        _warm_up(compiled, inputs, warmup, device, times, t0, type(model).__name__)
    return compiled, reason


def _record(compiled, inputs, params: dict, state: dict, tensors: dict, keep_ptx: bool, fresh_state: bool,
            device: torch.device):
    """(the recorder, the result) of one recorded run of the warmed-up
    ``compiled``; ``CaptureError`` when that run recompiled."""
    roles: dict[int, tuple[str, str]] = {}
    for name, t in params.items():
        roles[t.untyped_storage()._cdata] = ("weight", name)
    for name, t in state.items():
        roles[t.untyped_storage()._cdata] = ("state", name)
    for name, t in tensors.items():
        roles[t.untyped_storage()._cdata] = ("input", name)
    rec = _InductorRecorder(roles, [""], keep_ptx)
    rec.snapshot_named = not fresh_state
    for t in list(params.values()) + list(state.values()) + list(tensors.values()):
        rec._storage(t, producing=False)
    graphs_before = _unique_graphs()
    with torch.no_grad(), hooks.run_hook(rec.on_launch), python_level_reads(rec.guard_tolist), rec:
        result = compiled(**inputs)
    _sync(device)
    if graphs_before >= 0 and _unique_graphs() != graphs_before:
        raise CaptureError("the model was recompiled during the recorded run (guards failed): "
                           "the recorded program would not be the warmed-up one")
    return rec, result


def capture_inductor(model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                     state_names: list[str] | None = None, meta: dict[str, Any] | None = None, *,
                     warmup: int = 2, reuse_temps: bool = True, keep_ptx: bool = True,
                     compress: bool = True, progress: Callable[[str], None] | None = None,
                     compiled: Callable[..., Any] | None = None, regions: str = "auto",
                     fresh_state: bool = False) -> CaptureResult:
    """Compile ``model`` with inductor and record ``model(**inputs)``.

    ``inputs`` are what a user passes (tensors, nested tensors, plain
    keywords: constants of the bucket); the result may be any pytree of
    tensors (as in :func:`.aten.capture`).  With ``regions="auto"``, a model
    whose eager forward reads tensor values on the host (transformers' mask
    code does, between the decoder layers) is compiled as one whole graph,
    where such code is traced instead (``graph.meta["regions_reason"]``);
    host reads left in eager code under ``regions="blocks"`` become guards.

    Weights are the model's parameters and non-state buffers; state buffers
    (default ``model.state_names()``) are snapshot before the recorded run
    and restored after it (warm-up runs too), so the model's state is
    unchanged by the capture. ``progress`` receives phase names; ``compiled``
    (from :func:`compile_model`) reuses an already compiled model; ``regions``
    is passed to :func:`compile_model` otherwise.  ``fresh_state``: the
    state holds nothing to keep (a served model's KV cache before serving):
    it is zeroed after the capture instead of snapshot and restored, and the
    result's values leave out every named weight and state buffer (the
    caller has them by name) - no copy of the weights or the cache.  Raises
    :class:`CaptureError` when the model cannot be compiled or recorded."""
    say = progress or (lambda msg: log.info("%s", msg))
    params, state = module_roles(model, state_names)
    tensors, constants, _ = flatten_inputs(inputs)
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    if device.type != "cuda":
        # inductor's CPU kernels are C++ functions no recorder sees: the graph would miss them
        raise CaptureError(f"the inductor capture records Triton kernels and needs CUDA inputs, not {device}; "
                           f"use the aten capture (tessera_actors.capture.capture_module) on {device.type}")
    saved = {} if fresh_state else {n: t.clone() for n, t in state.items()}
    times: dict[str, float] = {}

    def restore() -> None:
        with torch.no_grad():
            for n, t in state.items():
                if fresh_state:
                    t.zero_()
                else:
                    t.copy_(saved[n])
    try:
        t0 = time.perf_counter()
        compiled, reason = _compiled_and_warm(model, inputs, compiled, regions, warmup, device, times, t0, say,
                                              restore)
        times["warmup_s"] = time.perf_counter() - t0 - times.get("compile_s", 0.0)
        restore()
        say("recording")
        t1 = time.perf_counter()
        rec, result = _record(compiled, inputs, params, state, tensors, keep_ptx, fresh_state, device)
        times["record_s"] = time.perf_counter() - t1
        warnings = []
        if device.type == "cuda" and rec.launches == 0:
            warnings.append("no Triton kernel launch was recorded: the compiled frame may have been "
                            "skipped (run eagerly) under the recorder; the graph holds aten ops only")
            log.warning("%s", warnings[-1])
        say("building graph")
        t2 = time.perf_counter()
        meta = dict(meta or {}, constants={n: encode_constant(v) for n, v in constants.items()})
        res = assemble(rec, result, tensors, meta, reuse_temps, compress, keep_ptx)
        times["assemble_s"] = time.perf_counter() - t2
        times["total_s"] = time.perf_counter() - t0
        res.graph.meta["capture_times"] = {k: round(v, 3) for k, v in times.items()}
        res.graph.meta["compiled_graphs"] = _unique_graphs()
        res.graph.meta["regions"] = "blocks" if compiled is model else "whole"
        res.graph.meta["regions_reason"] = reason
        res.graph.meta["torch"] = torch.__version__
        res.graph.meta["warnings"] = warnings
        return res
    finally:
        restore()


__all__ = ["capture_inductor", "choose_regions", "compile_model", "drop_compiled", "repeated_blocks", "dense", "ptx_text", "triton_source", "unpack_text"]

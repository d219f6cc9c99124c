"""From a model name to the bucket graphs the engine serves.

The buckets themselves (names, shapes, inputs) are in :mod:`~tessera_actors.serving.buckets`.

Every bucket is captured on the meta device (no arithmetic, so capturing a
real-size model takes well under a second per bucket), and its weight and
state buffers are named as in the model, so the device actors of one
deployment hold one copy of the weights and one KV cache for all buckets
(``InstallPlan.share``).  Values come from the real model by name; the KV
cache starts as zeros and is never shipped.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading

import torch

from tessera_actors.capture.aten import storage_bytes
from tessera_actors.graph import KernelGraph
from tessera_actors.serving.buckets import Bucket, buckets_for, capture_aten, core_buckets, windowed
from tessera_actors.serving.config import EngineConfig
from tessera_actors.serving.memory import fit_kv_cache, state_bytes
from tessera_actors.serving.params import EngineError

log = logging.getLogger("tessera_actors.serving")


class ServedModel:
    """The real model (its weights; its state dropped), its tokenizer/template
    metadata and its bucket graphs.  ``cfg``: the configuration served
    (``max_seqs`` fitted to the KV-cache budget).

    ``buckets`` is every bucket the engine may run; an aten bucket's graph
    is captured on first use: :meth:`graph` captures it (blocking, about a
    second; one capture at a time, from any thread: the meta model's
    attention modules are reshaped for it), so a server need not capture
    the buckets it places in the background before it serves (inductor
    captures are all made at load).  ``graphs``, ``values`` (weight bytes by
    buffer id) and ``captures`` (``inductor`` | ``aten``, or ``aten
    (inductor failed: ...)``) hold the buckets captured so far; ``weights``
    holds the weight bytes by buffer name, for any bucket (every bucket
    names its weights as the model does)."""

    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, meta: torch.nn.Module, vocab_size: int,
                 buckets: dict[str, Bucket], gguf_meta: dict | None) -> None:
        self.cfg, self.name, self.model, self.vocab_size = cfg, cfg.model, model, vocab_size
        self.buckets, self.gguf_meta = buckets, gguf_meta
        self._meta = meta
        self._state = set(model.state_names())
        named = dict(model.named_parameters())
        named.update(dict(model.named_buffers()))
        self.weights = {n: t for n, t in named.items() if n not in self._state}
        self.weight_bytes = sum({t.data_ptr(): t.numel() * t.element_size()
                                 for t in self.weights.values()}.values())   # tied weights once
        self.kv_bytes = state_bytes(meta)   # the KV cache over all devices
        self.graphs: dict[str, KernelGraph] = {}
        self.values: dict[str, dict[int, torch.Tensor]] = {}
        self.captures: dict[str, str] = {}
        self._lock = threading.Lock()

    def add(self, bucket: str, graph: KernelGraph, how: str, captured: dict | None = None) -> None:
        """Keep a captured graph of ``bucket`` with its weight values."""
        self.values[bucket] = weight_values(bucket, graph, self.weights, self._state, captured)
        self.graphs[bucket], self.captures[bucket] = graph, how

    def graph(self, bucket: str) -> KernelGraph:
        """The bucket's graph, captured now (as aten ops) if it is not yet
        (``KeyError`` for a bucket the engine does not run)."""
        g = self.graphs.get(bucket)
        if g is not None:
            return g
        b = self.buckets[bucket]
        with self._lock:
            if bucket not in self.graphs:
                self.add(bucket, capture_aten(self._meta, b), "aten")
        return self.graphs[bucket]

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Weight bytes by buffer name (flat views of the model's storages,
        no copy): what the scheduler loads a bucket captured after start
        from.  The same dict each call, emptied by :meth:`release_weights`."""
        if not hasattr(self, "_named_bytes"):
            self._named_bytes = {n: storage_bytes(t) for n, t in self.weights.items()}
        return self._named_bytes

    def release_weights(self) -> None:
        """Drop this process's copy of the weights (in place: a reader of
        :meth:`named_weights`, the scheduler, sees none from now on); the
        bytes go back once no other engine of the process holds the same
        model.  Buckets not captured yet are no longer served."""
        self.named_weights().clear()
        self.weights.clear()
        self.values.clear()
        self.model = None
        _build.cache_clear()
        self.buckets = {n: b for n, b in self.buckets.items() if n in self.graphs}

    def capture_all(self) -> None:
        """Capture every bucket (blocking)."""
        for name in self.buckets:
            self.graph(name)


def drop_state(model: torch.nn.Module) -> None:
    """Replace the model's state buffers (its KV cache: ``max_seqs`` x
    ``max_model_len`` slots) by empty tensors: the cache starts as zeros on
    the devices and is never shipped, so the host keeps only the weights."""
    for name in getattr(model, "state_names", lambda: [])():
        path, _, buf = name.rpartition(".")
        mod = model.get_submodule(path) if path else model
        t = mod._buffers.get(buf)
        if t is not None and t.numel():
            mod._buffers[buf] = torch.empty(0, dtype=t.dtype, device=t.device)


@functools.lru_cache(maxsize=2)
def _build(model: str, size: str, dtype: torch.dtype, seed: int, kw: tuple, build_device: str = "cpu"
           ) -> torch.nn.Module:
    """The real model, built once per configuration in a process (engines of
    one benchmark share its weights: they are only ever read); generated on
    ``build_device`` and kept in host memory, without its state."""
    from tessera_actors import models
    m = models.get(model, size, dtype=dtype, seed=seed, device=build_device, **dict(kw))
    drop_state(m)
    if build_device != "cpu":
        m = m.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return m


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _model_kw(cfg: EngineConfig) -> dict:
    """``models.get``'s keyword arguments of ``cfg`` besides name, size, dtype and seed."""
    kw = dict(cfg.overrides, max_batch=cfg.max_seqs, max_seq=cfg.max_model_len)
    if cfg.weights != "dense":
        kw["weights"] = cfg.weights
    return kw


def _meta_model(cfg: EngineConfig, dtype: torch.dtype) -> torch.nn.Module:
    """The model of ``cfg`` on the meta device (shapes only)."""
    from tessera_actors import models
    try:
        if cfg.model.startswith("hf:"):
            from tessera_actors.models import hf
            return hf.load_serving(cfg.model, cfg.max_seqs, cfg.max_model_len, dtype=dtype, seed=cfg.seed,
                                   device="meta", **cfg.overrides)
        return models.get(cfg.model, cfg.size, dtype=dtype, seed=cfg.seed, device="meta", **_model_kw(cfg))
    except (KeyError, TypeError, ValueError, FileNotFoundError) as e:
        raise EngineError(f"cannot build model {cfg.model!r}: {e}") from e


def fitted(cfg: EngineConfig) -> tuple[EngineConfig, torch.nn.Module]:
    """(``cfg`` with ``max_seqs`` lowered to what ``kv_cache_memory`` holds,
    its meta model): the row size comes from the meta model's state."""
    dtype = _dtype(cfg.dtype)
    if cfg.model.startswith("hf:"):
        cfg.kv_windows = (cfg.max_model_len,)   # a transformers model's attention reads the whole cache
    meta = _meta_model(cfg, dtype)
    cfg = served_form(cfg, meta)
    fit = fit_kv_cache(cfg, state_bytes(meta) // cfg.max_seqs)
    return (fit, _meta_model(fit, dtype)) if fit is not cfg else (cfg, meta)


def served_form(cfg: EngineConfig, model: torch.nn.Module) -> EngineConfig:
    """``cfg`` as the model's state rows allow (``ReferenceModel.ROW_STATE``):
    a recurrent state (``"latest"``, an SSM's) holds no per-position history,
    so no kept prompt prefix can be reused (prefix caching off) and no
    attention window applies (one bucket per shape, ``kv_windows=()``);
    padding rows are the model's to keep away from the sequences' states
    (``models.mamba2``: its spare row).  ``cfg`` itself when nothing changes."""
    if getattr(model, "ROW_STATE", "positions") != "latest":
        return cfg
    changed = {}
    if cfg.prefix_caching:
        changed["prefix_caching"] = False
    if windowed(cfg):
        changed["kv_windows"] = ()
    if not changed:
        return cfg
    log.info("model %s keeps a recurrent state per sequence (no per-position KV cache): serving it with %s",
             cfg.model, ", ".join(f"{k}={v!r}" for k, v in changed.items()))
    return dataclasses.replace(cfg, **changed)


def _models(cfg: EngineConfig, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the real model in host memory, the same model on the meta device)."""
    from tessera_actors import models
    kw = _model_kw(cfg)
    try:
        if cfg.model.startswith("hf:"):   # a transformers causal LM, run by its own code
            from tessera_actors.models import hf
            cfg.kv_windows = (cfg.max_model_len,)   # its attention reads the whole cache
            real = hf.load_serving(cfg.model, cfg.max_seqs, cfg.max_model_len, dtype=dtype, seed=cfg.seed,
                                   **cfg.overrides)
            drop_state(real)
            meta = hf.load_serving(cfg.model, cfg.max_seqs, cfg.max_model_len, dtype=dtype, seed=cfg.seed,
                                   device="meta", **cfg.overrides)
            return real, meta
        key = tuple(sorted(kw.items()))
        try:
            hash(key)
        except TypeError:   # an unhashable override (a dict): build it afresh
            real = models.get(cfg.model, cfg.size, dtype=dtype, seed=cfg.seed, **kw)
            drop_state(real)
        else:
            real = _build(cfg.model, cfg.size, dtype, cfg.seed, key, cfg.build_device)
        return real, models.get(cfg.model, cfg.size, dtype=dtype, seed=cfg.seed, device="meta", **kw)
    except (KeyError, TypeError, ValueError, FileNotFoundError) as e:
        raise EngineError(f"cannot build model {cfg.model!r}: {e}") from e


def weight_values(name: str, graph: KernelGraph, named: dict[str, torch.Tensor], state: set[str],
                  captured: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """The initial bytes of a bucket graph's weights, by buffer id: the real
    model's tensor of the buffer's name (flat bytes of its storage, no copy),
    or for an unnamed constant the bytes the capture recorded."""
    vals = {}
    for buf in graph.buffers.values():
        if buf.role == "weight":
            t = named.get(buf.name)
            if t is None and captured is not None and not buf.name and buf.id in captured:
                vals[buf.id] = captured[buf.id].cpu()
                continue
            if t is None:
                raise EngineError(f"bucket {name}: weight buffer {buf.id} ({buf.name!r}) has no tensor "
                                  "of that name in the model")
            vals[buf.id] = storage_bytes(t)
        elif buf.role == "state" and buf.name not in state:
            raise EngineError(f"bucket {name}: {buf.name!r} is written but is not a state buffer")
    return vals


def load_served_model(cfg: EngineConfig, core_only: bool = False, progress=None) -> ServedModel:
    """Build the model (real weights for ``smollm2``) with as many KV rows as
    ``cfg.kv_cache_memory`` holds (``ServedModel.cfg``: the configuration
    served), check it takes the serving inputs, and capture its buckets:
    with inductor (Triton kernels, PTX access sets; every bucket now) when
    every device is a GPU of this process's kind, else on the meta device
    as aten ops (:func:`capture_kind`; ``core_only``: only the
    :func:`core_buckets` now, the others on first use).  ``progress(done,
    total, bucket)`` is called after each bucket captured here.  Blocking
    (call in a thread)."""
    if cfg.model == "smollm2":
        limit = 8192   # SmolLM2-135M-Instruct's own context (GGUF llama.context_length)
        if cfg.max_model_len > limit:
            raise EngineError(f"max_model_len {cfg.max_model_len} exceeds SmolLM2's context of {limit}")
    cfg, _ = fitted(cfg)
    real, meta = _models(cfg, _dtype(cfg.dtype))
    params = inspect.signature(real.forward).parameters
    if not {"input_ids", "positions", "rows", "last"} <= set(params):
        raise EngineError(f"model {cfg.model!r} cannot be served: its forward takes {list(params)}, the engine "
                          "needs input_ids, positions, rows and last (a Llama-family decoder)")
    buckets = {b.name: b for b in buckets_for(cfg)}
    if cfg.embeddings and any(hasattr(m, "pool") for m in meta.modules()) and cfg.prefill_buckets:   # embeddings, a chunk at a time
        embed = Bucket("embed", max(cfg.prefill_buckets))
        buckets[embed.name] = embed
    meta_gguf = None
    if cfg.model in ("smollm2", "hf:smollm2"):
        from tessera_actors.models.smollm2 import _reader, release_file
        meta_gguf = _reader().metadata
        release_file()   # the weights and the metadata are read: the file's pages need not stay resident
    vocab = getattr(getattr(real, "cfg", None), "vocab_size", None) or 0
    served = ServedModel(cfg, real, meta, vocab, buckets, meta_gguf)
    if capture_kind(cfg) == "inductor":
        from tessera_actors.serving.gpu_capture import capture_on_gpu
        # (the embedding bucket is captured as aten ops when first used)
        graphs, captured, captures = capture_on_gpu(cfg, real, meta,
                                                    [b for b in buckets.values() if b.kind != "embed"], progress)
        for name, graph in graphs.items():
            served.add(name, graph, captures[name], captured.get(name))
        return served
    from tessera_actors.models.common import use_fewest_ops
    from tessera_actors.serving.gpu_capture import attention_form, set_attention_form
    set_attention_form(meta, attention_form(cfg, gpu=all_cuda(cfg)))
    use_fewest_ops(meta, all_cpu(cfg))   # a CPU runs the graph op by op: the fewest ops, the same bits
    now = [n for n in buckets if n in core_buckets(cfg, buckets)] if core_only else list(buckets)
    for i, name in enumerate(now):
        served.graph(name)
        if progress is not None:
            progress(i + 1, len(now), name)
    return served


def capture_kind(cfg: EngineConfig) -> str:
    """``cfg.capture``, or for ``auto``: ``inductor`` when every device of the
    deployment (in-process, or of every node) is a CUDA device and this
    process sees one (it compiles there), else ``aten``."""
    if cfg.capture != "auto":
        return cfg.capture
    if not all_cuda(cfg) or cfg.model.startswith("hf:"):
        return "aten"
    return "inductor" if torch.cuda.is_available() else "aten"


def all_cpu(cfg: EngineConfig) -> bool:
    """Whether every device of the deployment (in-process, or of every node) is a CPU."""
    specs = cfg.device_specs()
    return bool(specs) and all(s.kind == "cpu" for s in specs)


def all_cuda(cfg: EngineConfig) -> bool:
    """Whether every device of the deployment (in-process, or of every node) is a GPU."""
    specs = cfg.device_specs()
    return bool(specs) and all(s.kind == "cuda" for s in specs)

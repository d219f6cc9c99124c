"""From a model name to the bucket graphs the engine serves.

A *bucket* is one captured shape of the model's forward:

* ``decode:B@R`` - one new token for each of ``B`` KV rows ``R .. R+B-1``
  (inputs ``input_ids`` [B, 1], ``positions`` [B]);
* ``prefill:C`` - a chunk of ``C`` prompt tokens of one sequence into its
  own KV row (inputs ``input_ids`` [1, C], ``positions`` [1, C], ``rows``
  [1], ``last`` [1]: only the logits of the chunk's last real token are
  computed); ``prefill:RxC``: chunks of ``R`` sequences in one step
  (``[R, C]``, ``rows`` [R], ``last`` [R]: batched prefill, at most
  ``max_batched_tokens`` tokens a step);
* ``embed:C`` - a chunk of ``C`` tokens as ``prefill:C`` takes them,
  giving the final hidden states summed over its real tokens (``/v1/embeddings``:
  the engine adds the chunks up and divides by the token count), for a
  model that pools (``LlamaDecoder.pool``);
* either with ``~W``: attention reads only the first ``W`` cache slots
  (``kv_windows``; the engine picks the smallest window above the step's
  positions), so short contexts cost short attentions.

Every bucket is captured on the meta device (no arithmetic, so capturing a
real-size model takes well under a second per bucket), and its weight and
state buffers are named as in the model, so the device actors of one
deployment hold one copy of the weights and one KV cache for all buckets
(``InstallPlan.share``).  Values come from the real model by name; the KV
cache starts as zeros and is never shipped.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass

import torch

from tessera_actors.capture import capture_module
from tessera_actors.capture.aten import storage_bytes
from tessera_actors.graph import KernelGraph
from tessera_actors.serving.config import EngineConfig
from tessera_actors.serving.memory import fit_kv_cache, state_bytes
from tessera_actors.serving.params import EngineError


@dataclass(frozen=True)
class Bucket:
    kind: str          # "decode" | "prefill"
    size: int          # rows (decode) or tokens (prefill)
    base: int = 0      # first KV row (decode)
    window: int = 0    # attention reads the first ``window`` KV slots (0: all)
    rows: int = 1      # prefill: sequences a step carries, each a chunk of ``size`` tokens

    @property
    def name(self) -> str:
        return bucket_name(self.kind, self.size, self.base, self.window, self.rows)


def bucket_name(kind: str, size: int, base: int = 0, window: int = 0, rows: int = 1) -> str:
    if kind == "decode":
        name = f"decode:{size}@{base}"
    else:
        name = f"{kind}:{rows}x{size}" if rows > 1 else f"{kind}:{size}"
    return f"{name}~{window}" if window else name


def windowed(cfg: EngineConfig) -> bool:
    """Whether buckets come with attention windows shorter than the cache."""
    return any(0 < w < cfg.max_model_len for w in cfg.kv_windows)


def window_for(cfg: EngineConfig, last_position: int, chunk: int = 0) -> int:
    """The window of a step whose largest real position is ``last_position``
    (0 = the whole cache); ``chunk``: a prompt chunk of that many tokens,
    which also has a window of its own length (a prompt's first chunk reads
    no more of the cache than itself)."""
    own = [chunk] if windowed(cfg) and 0 < chunk < cfg.max_model_len and chunk not in cfg.kv_windows else []
    for w in sorted([*cfg.kv_windows, *own]):
        if last_position < w < cfg.max_model_len:
            return w
    return 0


def decode_sizes(cfg: EngineConfig, limit: int) -> list[int]:
    """The decode bucket sizes usable by a group of ``limit`` rows."""
    return [b for b in cfg.decode_buckets if b < limit] + [limit]


def buckets_for(cfg: EngineConfig) -> list[Bucket]:
    """Every bucket the engine may run: decode sizes for the one group of
    latency mode and for each group of throughput mode, and the prefill
    chunk sizes; always the decode bucket of every row (``decode:max_seqs@0``),
    the reference the planner places first."""
    ref = Bucket("decode", cfg.max_seqs, 0)
    seen: dict[str, Bucket] = {ref.name: ref}
    windows = [w for w in cfg.kv_windows if w < cfg.max_model_len] + [0]
    layouts = [1] if cfg.mode == "latency" else ([cfg.groups] if cfg.mode == "throughput" else [1, cfg.groups])
    for w in windows:
        for groups in layouts:
            for lo, hi in cfg.group_bounds(groups):
                for size in decode_sizes(cfg, hi - lo):
                    b = Bucket("decode", size, lo, w)
                    seen.setdefault(b.name, b)
        for size in cfg.prefill_buckets:
            b = Bucket("prefill", size, 0, w)
            seen.setdefault(b.name, b)
    if windowed(cfg):   # each chunk also with a window of its own length
        for size in cfg.prefill_buckets:
            if size < cfg.max_model_len:
                b = Bucket("prefill", size, 0, size)
                seen.setdefault(b.name, b)
    for b in batched_prefill_buckets(cfg):
        seen.setdefault(b.name, b)
    return list(seen.values())


def batched_prefill_buckets(cfg: EngineConfig) -> list[Bucket]:
    """Prompt chunks of several sequences in one step: ``R`` rows of ``C``
    tokens for each ``R`` of ``prefill_rows`` above 1 and each chunk size
    with ``R * C <= max_batched_tokens``; attention over the chunk's own
    length (first chunks, when windowed) and over the whole cache."""
    out = []
    for size in cfg.prefill_buckets:
        for rows in cfg.prefill_rows:
            if rows < 2 or rows > cfg.max_seqs or rows * size > cfg.max_batched_tokens:
                continue
            windows = ([size] if windowed(cfg) and size < cfg.max_model_len else []) + [0]
            out += [Bucket("prefill", size, 0, w, rows) for w in windows]
    return out


def bucket_inputs(bucket: Bucket, device: str | torch.device = "meta") -> dict[str, torch.Tensor]:
    if bucket.kind == "decode":
        return {"input_ids": torch.zeros(bucket.size, 1, dtype=torch.int64, device=device),
                "positions": torch.zeros(bucket.size, dtype=torch.int64, device=device)}
    r = bucket.rows
    return {"input_ids": torch.zeros(r, bucket.size, dtype=torch.int64, device=device),
            "positions": torch.arange(bucket.size, dtype=torch.int64, device=device)[None].expand(r, -1).contiguous(),
            "rows": torch.arange(r, dtype=torch.int64, device=device),
            "last": torch.zeros(r, dtype=torch.int64, device=device)}


@contextlib.contextmanager
def shaped(model: torch.nn.Module, bucket: Bucket):
    """Capture-time constants of a bucket on the attention modules: the first
    KV row of a decode group (``row_base``) and the window (``kv_window``);
    on the decoder, ``pool`` for an embedding bucket."""
    pools = [m for m in model.modules() if hasattr(m, "pool")]
    if bucket.kind == "embed":
        if not pools:
            raise EngineError("this model cannot give embeddings (its decoder does not pool)")
        for m in pools:
            m.pool = True
    try:
        with _attention_shaped(model, bucket):
            yield
    finally:
        for m in pools:
            m.pool = False


@contextlib.contextmanager
def _attention_shaped(model: torch.nn.Module, bucket: Bucket):
    mods = [m for m in model.modules() if hasattr(m, "row_base")]
    if bucket.window and any(not hasattr(m, "kv_window") for m in mods):
        raise EngineError("this model's attention has no kv_window; serve it with kv_windows=()")
    old = [(m.row_base, getattr(m, "kv_window", 0)) for m in mods]
    for m in mods:
        m.row_base = bucket.base
        if hasattr(m, "kv_window"):
            m.kv_window = bucket.window
    try:
        yield
    finally:
        for m, (b, w) in zip(mods, old):
            m.row_base = b
            if hasattr(m, "kv_window"):
                m.kv_window = w


def core_buckets(cfg: EngineConfig, buckets: dict[str, Bucket]) -> set[str]:
    """Buckets placed before the engine serves: the reference decode bucket
    (every row, the whole cache) and the longest prompt chunk over the whole
    cache, which can stand in for every decode step and every prompt chunk
    (:meth:`~tessera_actors.serving.deployment.Deployment.runnable`: padded, in a larger bucket) while the others
    are captured and placed in the background, the most used first.  With
    node processes every bucket is core: a placement waits on its devices'
    answers, and one under way when a node dies would hold up the
    scheduler, and so the recovery, until its asks time out."""
    if cfg.nodes:
        return set(buckets)
    core = {f"decode:{cfg.max_seqs}@0"}
    chunks = [b for b in buckets.values() if b.kind == "prefill" and not b.window and b.rows == 1]
    if chunks:
        core.add(max(chunks, key=lambda b: b.size).name)
    return core & set(buckets)


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


def _meta_model(cfg: EngineConfig, dtype: torch.dtype) -> torch.nn.Module:
    """The model of ``cfg`` on the meta device (shapes only)."""
    from tessera_actors import models
    try:
        if cfg.model.startswith("hf:"):
            from tessera_actors.models import hf
            return hf.load_serving(cfg.model, cfg.max_seqs, cfg.max_model_len, dtype=dtype, seed=cfg.seed,
                                   device="meta", **cfg.overrides)
        kw = dict(cfg.overrides, max_batch=cfg.max_seqs, max_seq=cfg.max_model_len)
        return models.get(cfg.model, cfg.size, dtype=dtype, seed=cfg.seed, device="meta", **kw)
    except (KeyError, TypeError, ValueError, FileNotFoundError) as e:
        raise EngineError(f"cannot build model {cfg.model!r}: {e}") from e


def fitted(cfg: EngineConfig) -> tuple[EngineConfig, torch.nn.Module]:
    """(``cfg`` with ``max_seqs`` lowered to what ``kv_cache_memory`` holds,
    its meta model): the row size comes from the meta model's state."""
    dtype = _dtype(cfg.dtype)
    if cfg.model.startswith("hf:"):
        cfg.kv_windows = (cfg.max_model_len,)   # a transformers model's attention reads the whole cache
    meta = _meta_model(cfg, dtype)
    fit = fit_kv_cache(cfg, state_bytes(meta) // cfg.max_seqs)
    return (fit, _meta_model(fit, dtype)) if fit is not cfg else (cfg, meta)


def _models(cfg: EngineConfig, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the real model in host memory, the same model on the meta device)."""
    from tessera_actors import models
    kw = dict(cfg.overrides, max_batch=cfg.max_seqs, max_seq=cfg.max_model_len)
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
        from tessera_actors.models.smollm2 import _reader
        meta_gguf = _reader().metadata
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
    from tessera_actors.serving.gpu_capture import attention_form, set_attention_form
    set_attention_form(meta, attention_form(cfg, gpu=all_cuda(cfg)))
    now = [n for n in buckets if n in core_buckets(cfg, buckets)] if core_only else list(buckets)
    for i, name in enumerate(now):
        served.graph(name)
        if progress is not None:
            progress(i + 1, len(now), name)
    return served


def capture_aten(meta: torch.nn.Module, bucket: Bucket) -> KernelGraph:
    """The bucket's graph captured as aten ops on the meta device (no
    arithmetic: well under a second for a real-size model); attention is
    one kernel that each device runs as its own (:mod:`~tessera_actors.capture.fused`)."""
    with shaped(meta, bucket):
        graph = capture_module(meta, bucket_inputs(bucket)).graph
    graph.meta["capture"] = "aten"
    return graph


def capture_kind(cfg: EngineConfig) -> str:
    """``cfg.capture``, or for ``auto``: ``inductor`` when every device of the
    deployment (in-process, or of every node) is a CUDA device and this
    process sees one (it compiles there), else ``aten``."""
    if cfg.capture != "auto":
        return cfg.capture
    if not all_cuda(cfg) or cfg.model.startswith("hf:"):
        return "aten"
    return "inductor" if torch.cuda.is_available() else "aten"


def all_cuda(cfg: EngineConfig) -> bool:
    """Whether every device of the deployment (in-process, or of every node) is a GPU."""
    specs = cfg.device_specs()
    return bool(specs) and all(s.kind == "cuda" for s in specs)

"""From a model name to the bucket graphs the engine serves.

A *bucket* is one captured shape of the model's forward:

* ``decode:B@R`` - one new token for each of ``B`` KV rows ``R .. R+B-1``
  (inputs ``input_ids`` [B, 1], ``positions`` [B]);
* ``prefill:C`` - a chunk of ``C`` prompt tokens of one sequence into its
  own KV row (inputs ``input_ids`` [1, C], ``positions`` [1, C], ``rows``
  [1], ``last`` [1]: only the logits of the chunk's last real token are
  computed);
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
from dataclasses import dataclass, field

import torch

from tessera_actors.capture import capture_module
from tessera_actors.capture.aten import storage_bytes
from tessera_actors.graph import KernelGraph
from tessera_actors.serving.config import EngineConfig
from tessera_actors.serving.params import EngineError


@dataclass(frozen=True)
class Bucket:
    kind: str          # "decode" | "prefill"
    size: int          # rows (decode) or tokens (prefill)
    base: int = 0      # first KV row (decode)
    window: int = 0    # attention reads the first ``window`` KV slots (0: all)

    @property
    def name(self) -> str:
        return bucket_name(self.kind, self.size, self.base, self.window)


def bucket_name(kind: str, size: int, base: int = 0, window: int = 0) -> str:
    name = f"decode:{size}@{base}" if kind == "decode" else f"prefill:{size}"
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
    return list(seen.values())


def bucket_inputs(bucket: Bucket, device: str | torch.device = "meta") -> dict[str, torch.Tensor]:
    if bucket.kind == "decode":
        return {"input_ids": torch.zeros(bucket.size, 1, dtype=torch.int64, device=device),
                "positions": torch.zeros(bucket.size, dtype=torch.int64, device=device)}
    return {"input_ids": torch.zeros(1, bucket.size, dtype=torch.int64, device=device),
            "positions": torch.arange(bucket.size, dtype=torch.int64, device=device)[None],
            "rows": torch.zeros(1, dtype=torch.int64, device=device),
            "last": torch.zeros(1, dtype=torch.int64, device=device)}


@contextlib.contextmanager
def shaped(model: torch.nn.Module, bucket: Bucket):
    """Capture-time constants of a bucket on the attention modules: the first
    KV row of a decode group (``row_base``) and the window (``kv_window``)."""
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


@dataclass
class ServedModel:
    """The real model (values; its state dropped), its tokenizer/template
    metadata, the captured bucket graphs with their values by buffer id, and
    how each bucket was captured (``captures``: ``inductor`` | ``aten``, or
    ``aten (inductor failed: ...)``)."""

    name: str
    model: torch.nn.Module
    vocab_size: int
    graphs: dict[str, KernelGraph]
    values: dict[str, dict[int, torch.Tensor]]
    buckets: dict[str, Bucket]
    gguf_meta: dict | None
    captures: dict[str, str] = field(default_factory=dict)


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


def load_served_model(cfg: EngineConfig, node_devices: list[str] | None = None, progress=None) -> ServedModel:
    """Build the model (real weights for ``smollm2``), check it takes the
    serving inputs, capture every bucket: with inductor (Triton kernels,
    PTX access sets) when every device is a GPU of this process's kind, else
    on the meta device as aten ops (:func:`capture_kind`; ``node_devices``:
    the device strings of the nodes a launcher started).  ``progress(done,
    total, bucket)`` is called after each bucket.  Blocking (call in a
    thread)."""
    dtype = _dtype(cfg.dtype)
    if cfg.model == "smollm2":
        limit = 8192   # SmolLM2-135M-Instruct's own context (GGUF llama.context_length)
        if cfg.max_model_len > limit:
            raise EngineError(f"max_model_len {cfg.max_model_len} exceeds SmolLM2's context of {limit}")
    real, meta = _models(cfg, dtype)
    params = inspect.signature(real.forward).parameters
    if not {"input_ids", "positions", "rows", "last"} <= set(params):
        raise EngineError(f"model {cfg.model!r} cannot be served: its forward takes {list(params)}, the engine "
                          "needs input_ids, positions, rows and last (a Llama-family decoder)")
    named = {n: t for n, t in real.named_parameters()}
    named.update(dict(real.named_buffers()))
    state = set(real.state_names())
    buckets = buckets_for(cfg)
    kind = capture_kind(cfg, node_devices)
    if kind == "inductor":
        from tessera_actors.serving.gpu_capture import capture_on_gpu
        graphs, captured, captures = capture_on_gpu(cfg, real, meta, buckets, progress)
    else:
        from tessera_actors.serving.gpu_capture import attention_form, set_attention_form
        set_attention_form(meta, attention_form(cfg, gpu=all_cuda(cfg, node_devices)))
        graphs, captured, captures = {}, {}, {}
        for i, b in enumerate(buckets):
            graphs[b.name], captures[b.name] = capture_aten(meta, b), "aten"
            if progress is not None:
                progress(i + 1, len(buckets), b.name)
    values = {b.name: weight_values(b.name, graphs[b.name], named, state, captured.get(b.name)) for b in buckets}
    meta_gguf = None
    if cfg.model in ("smollm2", "hf:smollm2"):
        from tessera_actors.models.smollm2 import _reader
        meta_gguf = _reader().metadata
    vocab = getattr(getattr(real, "cfg", None), "vocab_size", None) or 0
    return ServedModel(cfg.model, real, vocab, graphs, values, {b.name: b for b in buckets}, meta_gguf, captures)


def capture_aten(meta: torch.nn.Module, bucket: Bucket) -> KernelGraph:
    """The bucket's graph captured as aten ops on the meta device (no
    arithmetic: well under a second for a real-size model); attention is
    one kernel that each device runs as its own (:mod:`~tessera_actors.capture.fused`)."""
    with shaped(meta, bucket):
        graph = capture_module(meta, bucket_inputs(bucket)).graph
    graph.meta["capture"] = "aten"
    return graph


def capture_kind(cfg: EngineConfig, node_devices: list[str] | None = None) -> str:
    """``cfg.capture``, or for ``auto``: ``inductor`` when every device of the
    deployment (in-process, or of every node) is a CUDA device and this
    process sees one (it compiles there), else ``aten``."""
    if cfg.capture != "auto":
        return cfg.capture
    if not all_cuda(cfg, node_devices) or cfg.model.startswith("hf:"):
        return "aten"
    return "inductor" if torch.cuda.is_available() else "aten"


def all_cuda(cfg: EngineConfig, node_devices: list[str] | None = None) -> bool:
    """Whether every device of the deployment (in-process, or of every node:
    ``node_devices``, a launcher's, else ``cfg.nodes``) is a GPU; nodes that
    register by themselves (``expect_nodes``, Ray before it started them)
    are not known, so not."""
    from tessera_actors.devices import parse_devices
    nodes = cfg.nodes if node_devices is None else node_devices
    if (cfg.expect_nodes or cfg.ray) and node_devices is None:
        return False
    specs = [s for n in nodes for s in parse_devices(n)] if nodes else parse_devices(cfg.devices)
    return bool(specs) and all(s.kind == "cuda" for s in specs)

"""From a model name to the bucket graphs the engine serves.

A *bucket* is one captured shape of the model's forward:

* ``decode:B@R`` - one new token for each of ``B`` KV rows ``R .. R+B-1``
  (inputs ``input_ids`` [B, 1], ``positions`` [B]);
* ``prefill:C`` - a chunk of ``C`` prompt tokens of one sequence into its
  own KV row (inputs ``input_ids`` [1, C], ``positions`` [1, C], ``rows``
  [1], ``last`` [1]: only the logits of the chunk's last real token are
  computed);
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
from tessera_actors.serving.params import EngineError
from tessera_actors.serving.memory import fit_kv_cache, state_bytes


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
    name = f"decode:{size}@{base}" if kind == "decode" else f"{kind}:{size}"
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
def shaped(model: torch.nn.Module, bucket: Bucket, cpu_only: bool = False):
    """Capture-time constants of a bucket on the attention modules: the first
    KV row of a decode group (``row_base``), the window (``kv_window``) and,
    for a deployment on CPU devices only, the fused CPU attention kernel
    (``cpu_fused``); on the decoder, ``pool`` for an embedding bucket."""
    pools = [m for m in model.modules() if hasattr(m, "pool")]
    if bucket.kind == "embed":
        if not pools:
            raise EngineError("this model cannot give embeddings (its decoder does not pool)")
        for m in pools:
            m.pool = True
    try:
        with _attention_shaped(model, bucket, cpu_only):
            yield
    finally:
        for m in pools:
            m.pool = False


@contextlib.contextmanager
def _attention_shaped(model: torch.nn.Module, bucket: Bucket, cpu_only: bool):
    mods = [m for m in model.modules() if hasattr(m, "row_base")]
    if bucket.window and any(not hasattr(m, "kv_window") for m in mods):
        raise EngineError("this model's attention has no kv_window; serve it with kv_windows=()")
    old = [(m.row_base, getattr(m, "kv_window", 0), getattr(m, "cpu_fused", None)) for m in mods]
    for m in mods:
        m.row_base = bucket.base
        if hasattr(m, "kv_window"):
            m.kv_window = bucket.window
        if hasattr(m, "cpu_fused"):
            m.cpu_fused = cpu_only
    try:
        yield
    finally:
        for m, (b, w, f) in zip(mods, old):
            m.row_base = b
            if hasattr(m, "kv_window"):
                m.kv_window = w
            if f is not None:
                m.cpu_fused = f


def cpu_only(cfg: EngineConfig) -> bool:
    """Whether every device of the deployment is a CPU (devices, or the
    node processes' devices); anything unparsable counts as not."""
    from tessera_actors.devices import parse_devices
    try:
        specs = [s for n in cfg.nodes for s in parse_devices(n)] if cfg.nodes else parse_devices(cfg.devices)
    except Exception:   # noqa: BLE001 - an unusual device string only loses the fused CPU kernel
        return False
    return bool(specs) and all(s.kind == "cpu" for s in specs)


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
    chunks = [b for b in buckets.values() if b.kind == "prefill" and not b.window]
    if chunks:
        core.add(max(chunks, key=lambda b: b.size).name)
    return core & set(buckets)


class ServedModel:
    """The real model (its weights), its tokenizer/template metadata and its
    bucket graphs.  ``cfg``: the configuration served (``max_seqs`` fitted
    to the KV-cache budget).

    ``buckets`` is every bucket the engine may run; a bucket's graph is
    captured on first use: :meth:`graph` captures it (blocking, about a
    second; one capture at a time, from any thread: the meta model's
    attention modules are reshaped for it), so a server need not capture
    the buckets it places in the background before it serves.  ``graphs``
    and ``values`` (weight bytes by buffer id) hold the buckets captured so
    far; ``weights`` holds the weight bytes by buffer name, for any bucket
    (every bucket names its weights as the model does)."""

    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, meta: torch.nn.Module, vocab_size: int,
                 buckets: dict[str, Bucket], gguf_meta: dict | None, cpu_fused: bool) -> None:
        self.cfg, self.name, self.model, self.vocab_size = cfg, cfg.model, model, vocab_size
        self.buckets, self.gguf_meta = buckets, gguf_meta
        self._meta, self._fused = meta, cpu_fused
        self._state = set(model.state_names())
        named = dict(model.named_parameters())
        named.update(dict(model.named_buffers()))
        self.weights = {n: storage_bytes(t) for n, t in named.items() if n not in self._state}
        self.weight_bytes = sum({t.data_ptr(): t.numel() for t in self.weights.values()}.values())   # tied: once
        self.kv_bytes = state_bytes(meta)   # the KV cache over all devices
        self.graphs: dict[str, KernelGraph] = {}
        self.values: dict[str, dict[int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def graph(self, bucket: str) -> KernelGraph:
        """The bucket's graph, captured now if it is not yet (``KeyError``
        for a bucket the engine does not run)."""
        g = self.graphs.get(bucket)
        if g is not None:
            return g
        b = self.buckets[bucket]
        with self._lock:
            if bucket not in self.graphs:
                with shaped(self._meta, b, self._fused):
                    cap = capture_module(self._meta, bucket_inputs(b))
                self.values[bucket] = self._weight_values(b, cap.graph)
                self.graphs[bucket] = cap.graph
        return self.graphs[bucket]

    def release_weights(self) -> None:
        """Drop this process's copy of the weights (in place: a reader of
        ``weights``, the scheduler, sees none from now on); the bytes go
        back once no other engine of the process holds the same model.
        Buckets not captured yet can no longer be (``EngineError``)."""
        self.weights.clear()
        self.values.clear()
        self.model = None
        _build.cache_clear()
        missing = set(self.buckets) - set(self.graphs)
        self.buckets = {n: b for n, b in self.buckets.items() if n not in missing}

    def capture_all(self) -> None:
        """Capture every bucket (blocking)."""
        for name in self.buckets:
            self.graph(name)

    def _weight_values(self, b: Bucket, graph: KernelGraph) -> dict[int, torch.Tensor]:
        vals = {}
        for buf in graph.buffers.values():
            if buf.role == "weight":
                t = self.weights.get(buf.name)
                if t is None:
                    raise EngineError(f"bucket {b.name}: weight buffer {buf.id} ({buf.name!r}) has no tensor "
                                      "of that name in the model")
                vals[buf.id] = t
            elif buf.role == "state" and buf.name not in self._state:
                raise EngineError(f"bucket {b.name}: {buf.name!r} is written but is not a state buffer")
        return vals


@functools.lru_cache(maxsize=2)
def _build(model: str, size: str, dtype: torch.dtype, seed: int, kw: tuple, build_device: str = "cpu"
           ) -> torch.nn.Module:
    """The real model, built once per configuration in a process (engines of
    one benchmark share its weights: they are only ever read); generated on
    ``build_device`` and kept in host memory."""
    from tessera_actors import models
    m = models.get(model, size, dtype=dtype, seed=seed, device=build_device, **dict(kw))
    if build_device != "cpu":
        m = m.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return m


def without_state(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its state buffers (the KV cache) moved to the meta
    device, in place: the served model's own cache is never used - every
    device holds its own, zeros at install - so its bytes go back to the
    system (1.5 GB for SmolLM2 at 16 x 2048 in float32)."""
    names = set(model.state_names())
    for prefix, module in model.named_modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None and (f"{prefix}.{key}" if prefix else key) in names:
                module._buffers[key] = torch.empty_like(buf, device="meta")
    return model


def _build_model(cfg: EngineConfig, device: str) -> torch.nn.Module:
    """The model of ``cfg`` on ``device``: "meta" (shapes only, for capture)
    or "cpu" (its real weights; a reference model's random ones generated on
    ``cfg.build_device``)."""
    from tessera_actors import models
    dtype = _dtype(cfg.dtype)
    if cfg.model.startswith("hf:"):   # a transformers causal LM, run by its own code
        from tessera_actors.models import hf
        extra = {"device": "meta"} if device == "meta" else {}
        return hf.load_serving(cfg.model, cfg.max_seqs, cfg.max_model_len, dtype=dtype, seed=cfg.seed,
                               **extra, **cfg.overrides)
    kw = dict(cfg.overrides, max_batch=cfg.max_seqs, max_seq=cfg.max_model_len)
    if device == "meta":
        return models.get(cfg.model, cfg.size, dtype=dtype, seed=cfg.seed, device="meta", **kw)
    key = tuple(sorted(kw.items()))
    try:
        hash(key)
    except TypeError:   # an unhashable override (a dict): build it afresh
        return models.get(cfg.model, cfg.size, dtype=dtype, seed=cfg.seed, **kw)
    return _build(cfg.model, cfg.size, dtype, cfg.seed, key, cfg.build_device)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_served_model(cfg: EngineConfig, core_only: bool = False) -> ServedModel:
    """Build the model (real weights for ``smollm2``) with as many KV rows as
    ``cfg.kv_cache_memory`` holds (``ServedModel.cfg``: the configuration
    served, ``max_seqs`` lowered to fit), check it takes the serving inputs,
    and capture its buckets (``core_only``: the :func:`core_buckets`; the
    others are captured when first used).  Blocking (call in a thread)."""
    if cfg.model == "smollm2":
        limit = 8192   # SmolLM2-135M-Instruct's own context (GGUF llama.context_length)
        if cfg.max_model_len > limit:
            raise EngineError(f"max_model_len {cfg.max_model_len} exceeds SmolLM2's context of {limit}")
    if cfg.model.startswith("hf:"):
        cfg.kv_windows = (cfg.max_model_len,)   # a transformers model's attention reads the whole cache
    try:
        meta = _build_model(cfg, "meta")
        fitted = fit_kv_cache(cfg, state_bytes(meta) // cfg.max_seqs)
        if fitted is not cfg:
            cfg, meta = fitted, _build_model(fitted, "meta")
        real = _build_model(cfg, "cpu")
    except (KeyError, TypeError, ValueError, FileNotFoundError) as e:
        raise EngineError(f"cannot build model {cfg.model!r}: {e}") from e
    without_state(real)
    params = inspect.signature(real.forward).parameters
    if not {"input_ids", "positions", "rows", "last"} <= set(params):
        raise EngineError(f"model {cfg.model!r} cannot be served: its forward takes {list(params)}, the engine "
                          "needs input_ids, positions, rows and last (a Llama-family decoder)")
    served_buckets = {b.name: b for b in buckets_for(cfg)}
    if any(hasattr(m, "pool") for m in meta.modules()) and cfg.prefill_buckets:   # embeddings, a chunk at a time
        embed = Bucket("embed", max(cfg.prefill_buckets))
        served_buckets[embed.name] = embed
    meta_gguf = None
    if cfg.model in ("smollm2", "hf:smollm2"):
        from tessera_actors.models.smollm2 import _reader
        meta_gguf = _reader().metadata
    vocab = getattr(getattr(real, "cfg", None), "vocab_size", None) or 0
    served = ServedModel(cfg, real, meta, vocab, served_buckets, meta_gguf, cpu_only(cfg))
    for name in core_buckets(cfg, served_buckets) if core_only else served_buckets:
        served.graph(name)
    return served

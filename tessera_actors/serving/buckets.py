"""The buckets the engine serves: their names, which ones a configuration
runs, their example inputs, the capture-time shape of the model for one, and
a bucket's graph captured as aten ops on the meta device.

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
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tessera_actors.capture import capture_module
from tessera_actors.graph import KernelGraph
from tessera_actors.serving.config import EngineConfig
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
    length (first chunks, when windowed) and over the whole cache.  None on
    a deployment with a device memory budget (``mem=``, ``gpu_budget``): an
    ``R x C`` chunk's transient results would be kept from the weights'
    share of the budget; prompts are prefilled one at a time there."""
    if any(s.mem is not None for s in cfg.device_specs()):
        return []
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


def capture_aten(meta: torch.nn.Module, bucket: Bucket) -> KernelGraph:
    """The bucket's graph captured as aten ops on the meta device (no
    arithmetic: well under a second for a real-size model); attention is
    one kernel that each device runs as its own (:mod:`~tessera_actors.capture.fused`)."""
    with shaped(meta, bucket):
        graph = capture_module(meta, bucket_inputs(bucket)).graph
    graph.meta["capture"] = "aten"
    return graph

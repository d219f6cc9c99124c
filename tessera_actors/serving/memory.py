"""Where a served model's memory goes, and the KV cache sized from a budget.

A served model holds, per device, its share of the weights and of the KV
cache (one copy for every bucket: ``InstallPlan.share``), one scratch that
every bucket's temporaries share, and each placed bucket's own inputs and
outputs; the engine's process also keeps the weights it loads from (to
place buckets later and to re-place after a lost node; in-process CPU
devices hold those same tensors) and every bucket's graph.  The KV cache is the part a user sizes:
``max_seqs`` rows of ``max_model_len`` positions, within
``EngineConfig.kv_cache_memory`` (:func:`fit_kv_cache`).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from tessera_actors.serving.config import EngineConfig, kv_budget
from tessera_actors.serving.launch import rss_bytes
from tessera_actors.serving.params import EngineError

log = logging.getLogger("tessera_actors.serving")


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's state buffers (its KV cache), any device (meta too)."""
    names = set(model.state_names())
    return sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n in names)


def devices_memory(cfg: EngineConfig) -> int:
    """Bytes the deployment's devices have: each device's ``mem=`` budget,
    else a GPU's memory, and this machine's RAM once for its CPU devices
    (they share it)."""
    total, host = 0, False
    for spec in cfg.device_specs():
        if spec.mem is not None:
            total += spec.mem
        elif spec.kind == "cuda":
            total += torch.cuda.get_device_properties(spec.index).total_memory if torch.cuda.is_available() else 0
        else:
            host = True
    if host:
        total += os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total


def kv_budget_bytes(cfg: EngineConfig) -> int | None:
    """``kv_cache_memory`` in bytes (a fraction of :func:`devices_memory`); None: no limit."""
    budget = kv_budget(cfg.kv_cache_memory, all(s.kind == "cpu" for s in cfg.device_specs()))
    if budget is None:
        return None
    kind, value = budget
    return int(value * devices_memory(cfg)) if kind == "fraction" else int(value)


def fit_kv_cache(cfg: EngineConfig, row_bytes: int) -> EngineConfig:
    """``cfg`` with as many KV rows (``max_seqs``, at most the one asked
    for) as the budget holds, each ``row_bytes`` (one sequence of
    ``max_model_len`` positions); ``cfg`` itself when they all fit.
    ``EngineError`` when not even one row fits."""
    budget = kv_budget_bytes(cfg)
    if budget is None or row_bytes <= 0 or cfg.max_seqs * row_bytes <= budget:
        return cfg
    rows = budget // row_bytes
    if rows < 1:
        raise EngineError(f"kv_cache_memory {cfg.kv_cache_memory!r} ({budget / 2**20:.0f} MiB) holds no sequence of "
                          f"max_model_len {cfg.max_model_len} ({row_bytes / 2**20:.0f} MiB): raise the budget or "
                          f"lower max_model_len")
    log.info("the KV cache budget %s (%.0f MiB) holds %d of max_seqs %d sequences of %d tokens "
                "(%.1f MiB each): serving %d at once (raise --kv-cache-memory for more)", cfg.kv_cache_memory,
                budget / 2**20, rows, cfg.max_seqs, cfg.max_model_len, row_bytes / 2**20, rows)
    return dataclasses.replace(cfg, max_seqs=int(rows))


def memory_report(served, cfg: EngineConfig, devices: dict | None = None) -> dict:
    """Bytes by what holds them (``engine.stats()["memory"]``, ``/metrics``):
    the process's resident set; the KV cache (``kv_rows`` x ``max_model_len``
    over all devices: reserved, resident as sequences write it on a CPU)
    and the weights (one copy on the devices; the engine's own to place
    from, until it is given back: in-process CPU devices hold the very
    same tensors) once the model is loaded; and once buckets are placed,
    what the devices allocated (``device_bytes``) and of it the activation
    buffers (``activation_bytes``: each device's scratch, which every
    bucket's temporaries share, and the buckets' own inputs and outputs);
    ``devices``: the deployment's ``device_memory``."""
    out = {"rss_bytes": rss_bytes(), "kv_cache_budget_bytes": kv_budget_bytes(cfg) or 0,
           "kv_rows": cfg.max_seqs, "max_model_len": cfg.max_model_len}
    if served is not None:
        out.update(kv_cache_bytes=served.kv_bytes, weight_bytes=served.weight_bytes,
                   engine_weight_bytes=served.weight_bytes if served.weights else 0)
    if devices:
        out.update(device_bytes=sum(d["allocated_bytes"] for d in devices.values()),
                   activation_bytes=sum(d["scratch_bytes"] + d["plan_bytes"] for d in devices.values()))
    return out


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the system where the C library can
    (glibc's ``malloc_trim``; a no-op elsewhere): after the engine's copy of
    the weights and the start's temporaries are freed, a few hundred MB
    stay mapped otherwise."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)

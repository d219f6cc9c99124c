"""Command-line flags that build an ``AsyncEngine``, shared by ``tessera serve``
and ``tessera bench serve``; each maps onto an ``EngineConfig`` field, and a
flag left out keeps the engine's default."""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from typing import Any, Callable

from tessera_actors.launch.env import LAUNCHERS, job_place


DEFAULT_MAX_BODY = 4 * 1024 * 1024   # bytes of a request body; larger bodies get 413
# --gpu-budget without --devices: the first GPU beside the CPU at 12 threads (DESIGN.md: on a 16-core
# H200 host 12 GEMV threads keep 46 GB/s beside a copy stream, 16 collapse to 14.5)
GPU_BUDGET_DEVICES = "cuda:0,cpu?threads=12"


def add_engine_arguments(p: argparse.ArgumentParser, seed_flag: str = "--seed") -> None:
    """Flags that build the AsyncEngine (shared by ``tessera serve`` and ``tessera bench serve``).
    A flag left out keeps ``EngineConfig``'s default, which its help shows."""
    from tessera_actors.serving.config import EngineConfig
    d = EngineConfig()
    p.add_argument("--model", default="smollm2", help="model: smollm2, llama, moe, mamba2, vlm (random weights; vlm: "
                   "text prompts to its decoder) or hf:<dir | config.json | file.gguf>")
    p.add_argument("--size", default=None, help=f"model size, e.g. tiny | real (default: {d.size})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--devices", default=None,
                       help="in-process devices (default: chosen for this machine and printed: on CPUs alone one "
                            "'cpu' device at every core but one, fewer where a probe at start finds them as fast; "
                            "a split such as 'cpu,cpu' only when asked for)")
    where.add_argument("--nodes", default=None, help="node processes, ';' between nodes: 'cpu;cpu?threads=1'")
    where.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                       help="node daemons as Ray actors on this Ray cluster: one per GPU (see --ray-cpu)")
    where.add_argument("--from-env", default=None, choices=LAUNCHERS,
                       help="serve the nodes a Slurm or torchrun job started (tessera node --from-env ...): "
                            "listen at the job's scheduler address, wait for its world size of nodes")
    p.add_argument("--ray-cpu", default=None, metavar="SPEC",
                   help="with --ray: also one CPU node per host with this device spec ('' none; default: "
                        "'cpu' on a cluster without GPUs)")
    p.add_argument("--ray-gpus", type=int, default=None, help="with --ray: GPU daemons (default: every GPU)")
    for flag, kind, what in (("--max-seqs", int, "KV slots (concurrent sequences)"),
                             ("--max-model-len", int, "context length (prompt + output tokens)"),
                             ("--max-queue", int, "waiting requests before 429"),
                             ("--planner", str, "placement planner: contiguous | layers | af | milp | offload"),
                             ("--mode", str, "latency | throughput | auto (plan switching under load)"),
                             ("--groups", int, "micro-batch groups of the decode rows in throughput mode, each "
                                               "with a step in flight (tessera advise's decode xN)"),
                             ("--lookahead", int, "decode steps sent ahead of their input tokens: 0 | 1")):
        field = flag[2:].replace("-", "_")
        p.add_argument(flag, type=kind, default=None, metavar=field.upper() if kind is str else "N",
                       help=f"{what} (default: {getattr(d, field)})")
    p.add_argument("--weights", default="auto", choices=("auto", "quantized", "dense"),
                   help="quantized: the model file's quantized weights as they are (smollm2's GGUF Q4_1/Q8_0: int4 "
                        "groups and int8 rows, run by torch's CPU int4/int8 kernels; CPU devices only); dense: "
                        "dequantised to --dtype; auto: quantized when the file is and every device is a CPU "
                        "(default: auto)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights and activations (with --weights quantized: activations and scales) "
                        "(default: bfloat16 with quantized weights, else float32)")
    p.add_argument("--kv-cache-memory", default="auto", metavar="SIZE|FRACTION",
                   help="memory for the KV cache: a size (512MiB, 2GiB), a fraction of the devices' memory (0.1), "
                        "'none' (no limit) or 'auto': 512MiB when every device is a CPU, else no limit; "
                        "--max-seqs is lowered to what fits (default: auto)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
                   help="do not reuse the KV row of a finished request for a prompt that starts with its tokens")
    p.add_argument("--max-batched-tokens", type=int, default=None, metavar="N",
                   help=f"prompt tokens (padded) one prefill step may carry, over several prompts "
                        f"(default: {d.max_batched_tokens})")
    p.add_argument("--gpu-budget", default=None, metavar="SIZE",
                   help="serve a model bigger than the GPU: the GPU holds at most SIZE (8GiB); the offload "
                        "planner keeps weights resident, streams them over PCIe or computes them on the CPU "
                        "(--devices a GPU and a CPU; default then: cuda:0,cpu?threads=12)")
    p.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a planner option, repeatable (offload: policy=tessera|layer_offload|streaming|expert_offload, ring=bytes|slots, "
                        "cpu_bps=4e10, cpu_rows_bps=1:4e10,8:3.3e10 (the CPU's matmul weight rate by rows), cpu_flops=1.5e13, "
                        "pcie_bps=5.5e10, switch_s=2e-4, reserve=335544320)")
    p.add_argument(seed_flag, dest="engine_seed", type=int, default=None, metavar="N",
                   help=f"engine seed: random weights and unseeded sampling (default: {d.seed})")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``tessera serve``'s flags: the engine's, then the HTTP server's."""
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed in the "
                                                          "ready line)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize")
    p.add_argument("--trace", default=None, metavar="DIR", help="write a trace-event JSON of served steps to DIR")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY, metavar="BYTES",
                   help="largest request body in bytes, 413 above (default: 4 MiB)")


def engine_kwargs(a: argparse.Namespace, trace_dir: str | None = None, chosen: Deployment | None = None) -> dict:
    """AsyncEngine keyword arguments from the parsed flags (unset flags keep the engine's defaults);
    ``chosen``: the default deployment already chosen for flags that name no devices
    (:func:`chosen_deployment`; None: chosen here)."""
    kw: dict[str, Any] = {"model": a.model}
    if a.nodes:
        kw["nodes"] = [n for n in a.nodes.split(";") if n]
    elif getattr(a, "ray", None):
        from tessera_actors.launch.ray import RayNodes
        kw["ray"] = RayNodes(address=a.ray, gpus=a.ray_gpus, cpu=a.ray_cpu)
    elif getattr(a, "from_env", None):
        place = job_place(a.from_env, engine=True)
        kw["expect_nodes"], kw["listen"] = place.world, place.scheduler
    elif a.devices:
        kw["devices"] = a.devices
    if getattr(a, "gpu_budget", None):
        kw["gpu_budget"] = a.gpu_budget
        kw.setdefault("devices", GPU_BUDGET_DEVICES)
    if not {"devices", "nodes", "ray", "expect_nodes"} & set(kw):
        chosen = chosen or chosen_deployment(a)
        kw["devices"], kw["devices_chosen"] = chosen.devices, chosen.why
    if trace_dir:
        kw["trace_dir"] = trace_dir
    for name in ("size", "max_seqs", "max_model_len", "max_queue", "planner", "mode", "groups", "dtype", "weights",
                 "lookahead", "prefix_caching", "max_batched_tokens"):
        if getattr(a, name, None) is not None:
            kw[name] = getattr(a, name)
    if a.engine_seed is not None:
        kw["seed"] = a.engine_seed
    if getattr(a, "kv_cache_memory", None) is not None:
        kw["kv_cache_memory"] = kv_cache_memory(a.kv_cache_memory)
    if getattr(a, "planner_option", None):
        kw["planner_options"] = planner_options(a.planner_option)
    return kw


@dataclass(frozen=True)
class Deployment:
    """The in-process devices chosen when no ``--devices`` (or nodes) are
    given, and why (``tessera serve`` prints it, ``engine.stats()`` reports it)."""
    devices: str
    why: str


def default_deployment(cores: int | None = None, gpus: int | None = None,
                       measure: Callable[[tuple[int, ...]], list] | None = None,
                       weights: str = "auto", dtype: str | None = None) -> Deployment:
    """The default in-process deployment of this machine (``cores``/``gpus``:
    its usable CPU cores and CUDA devices, found when None).  On CPUs alone:
    one ``cpu`` device whose decode steps run at every core but one (left
    to the serving loop) and its prompt chunks at every core
    (``prefill_threads``: long matrix products, few barriers);
    with more than one count to choose from (3 cores and more), the count
    :func:`~tessera_actors.serving.cpu_threads.choose_threads` takes from
    ``measure(counts)`` (default: :func:`~tessera_actors.serving.cpu_threads.measure_threads`,
    about 1.5 s, on int4 weights unless ``weights`` is "dense", at ``dtype``
    or the engine's default activations).  A split over CPU devices pays a
    hand-off per cut edge and gains only what the cores can run side by
    side; measured on the 2-core box (``benchmarks/bench_cpu_step.py``) one
    device was faster at every batch, so a split is used only where asked
    for (``--devices cpu,cpu``).
    With a GPU: ``cuda:0`` (inductor's kernels replayed as CUDA graphs;
    more GPUs, a GPU beside the CPU or a budget are asked for by flags)."""
    import os
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        more = "; --devices cuda:0,cuda:1 places the kernels over two" if gpus > 1 else ""
        return Deployment("cuda:0", f"{gpus} GPU{'s' if gpus > 1 else ''} seen: one GPU device{more}")
    from tessera_actors.serving.cpu_threads import candidates, choose_threads, measure_threads
    where = f"{cores} CPU core{'s' if cores != 1 else ''}, no GPU: one device"
    split = "a CPU split only where asked for: --devices cpu,cpu"
    counts = candidates(cores)
    if len(counts) == 1:
        n = counts[0]
        rule = "every core but one, left to the serving loop" if n < cores else "the one core"
        return Deployment(f"cpu?threads={n}{_prefill(n, cores)}",
                          f"{where}, {n} intra-op thread{'s' if n != 1 else ''} ({rule}){_prefill_why(n, cores)}; "
                          f"{split}")
    if measure is None:
        quantized = weights != "dense"
        measure = functools.partial(measure_threads, quantized=quantized,
                                    dtype=dtype or ("bfloat16" if quantized else "float32"))
    choice = choose_threads(measure(counts))
    n = choice.threads
    return Deployment(f"cpu?threads={n}{_prefill(n, cores)}",
                      f"{where}, {n} intra-op thread{'s' if n != 1 else ''}{_prefill_why(n, cores)}; "
                      f"{choice.why}; {split}")


def _prefill(threads: int, cores: int) -> str:
    """The device option that runs prompt chunks on every core (none when decode already does)."""
    return f"&prefill_threads={cores}" if cores > threads else ""


def _prefill_why(threads: int, cores: int) -> str:
    # measured on the 2-core box, alternating rounds through AsyncEngine (serve_cpu/README.md): prompt
    # chunks on both cores gave a fresh 290-token prompt's TTFT x0.74-0.91 and 16 streams x1.06-1.36
    return f", prompt chunks on all {cores}" if cores > threads else ""


def chosen_deployment(a: argparse.Namespace) -> Deployment | None:
    """The default deployment when the flags name no devices, nodes, Ray
    cluster, job or GPU budget (None: the flags' own; never overridden)."""
    if a.devices or a.nodes or getattr(a, "ray", None) or getattr(a, "from_env", None) \
            or getattr(a, "gpu_budget", None):
        return None
    return default_deployment(weights=getattr(a, "weights", "auto"), dtype=getattr(a, "dtype", None))


def devices_line(chosen: Deployment) -> str:
    """The line ``tessera serve`` prints for a deployment it chose."""
    return f"tessera serve: devices {chosen.devices} ({chosen.why})"


def weights_line(engine: dict) -> str:
    """What ``--weights``/``--dtype`` came to for these engine keywords (``tessera serve`` prints it)."""
    from tessera_actors.serving.config import EngineConfig
    cfg = EngineConfig(**engine)
    if cfg.weights == "quantized":
        return (f"weights quantized as the model file has them, {cfg.dtype} activations "
                "(--weights dense: dequantised, float32)")
    return f"weights dense, {cfg.dtype}" + ("" if engine.get("weights", "auto") != "auto" else
                                            " (quantized only on CPU devices of a quantized model file)")


def kv_cache_memory(text: str) -> str | float | None:
    """``--kv-cache-memory``: 'none', a fraction ('0.25') or a size ('2GiB', bytes)."""
    if text.strip().lower() == "none":
        return None
    if "." in text:
        try:
            return float(text)
        except ValueError:
            pass
    return text


def planner_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings to planner keyword options (numbers as numbers)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SystemExit(f"--planner-option takes KEY=VALUE, got {item!r}")
        v: Any = value.strip()
        for kind in (int, float):
            try:
                v = kind(v)
                break
            except ValueError:
                continue
        out[key.strip()] = v
    return out

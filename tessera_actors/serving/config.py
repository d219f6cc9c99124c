"""The serving engine's configuration: one dataclass, validated with real
errors; ``tessera serve`` flags map onto its fields."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineConfig:
    """``devices``: in-process device specs (comma-separated) used when
    ``nodes`` is empty; ``nodes``: one node process per entry, each with its
    device specs (``cpu``, ``cpu?threads=1``, ``cuda:0;...``); ``ray``: node
    daemons as Ray actors instead (an address, ``"auto"``, or a
    ``launch.ray.RayNodes``: one per GPU, a CPU node per host when asked);
    ``expect_nodes``: that many nodes started by someone else (Slurm,
    torchrun) register at ``listen`` (``launch/env.py``).

    KV cache: ``max_seqs`` rows (sequences in flight) of ``max_model_len``
    positions (prompt + output), within ``kv_cache_memory``: bytes (an int
    or ``"512MiB"``) or a fraction in (0, 1] of the devices' memory (as
    vLLM's ``gpu_memory_utilization``, but for the KV cache alone: a
    ``mem=`` budget where a device has one, else a GPU's memory or this
    machine's RAM for its CPUs); ``"auto"`` (``tessera serve``'s default):
    ``AUTO_CPU_KV`` when every device is a CPU, else no limit; ``None``: no
    limit.  When ``max_seqs`` rows do not fit, the engine keeps as many as
    do (at least one, else an error) and says so.  Decode runs at ``decode_buckets`` batch
    sizes (rows padded up), prompts are prefilled in chunks of
    ``prefill_buckets`` tokens, the chunks of up to ``prefill_rows``
    sequences in one step (padded to a row count of it) within
    ``max_batched_tokens`` padded tokens a step.  ``mode``: ``latency`` (one decode step of
    all rows at a time), ``throughput`` (the rows in ``groups`` micro-batch
    groups, one step of each in flight, so the devices of a split
    pipeline), or ``auto`` (the online monitor switches: window
    ``monitor_window_s``, ratio ``monitor_beta``).  ``max_queue`` bounds the
    requests waiting for a KV slot; beyond it ``EngineBusy``.  ``lookahead``
    (0 or 1): decode steps a group sends ahead of the tokens they take,
    which the device feeds from the previous step (1: the host turnaround
    between steps overlaps the devices' work).  ``prompt_steps``: the most
    prompt-chunk steps in flight (None: as many as the prompt plan's
    micro-batches, what ``tessera advise`` predicts; 1: one at a time).
    Faults: a node
    that misses pings for ``lost_after_s`` is suspected (lost); the deployment is
    re-placed on the survivors and requests continue there; once it answers
    again it is re-admitted and placed on again.  With no node left the
    engine waits ``rejoin_wait_s`` for a suspected one before it is dead.

    A model bigger than the GPU: ``gpu_budget`` (bytes or a size such as
    ``"8GiB"``) caps the memory of the deployment's GPU (its first non-CPU
    device; on a CPU-only deployment the first device, the GPU's stand-in)
    and places every bucket with the ``offload`` planner: weights resident
    on the GPU, streamed to it per step over PCIe, or computed on the
    deployment's CPU device (``devices`` is then a GPU and a CPU, e.g.
    ``"cuda:0,cpu?threads=12"``).  On a GPU the planner keeps
    ``planner_options["reserve"]`` bytes of the budget for what no graph
    names (default ``planning.offload.GPU_RESERVE``, 320 MiB: the pool of
    its captured graphs, transient results, the cuBLAS workspace).

    Weights: ``dense`` (the model's weights in ``dtype``; SmolLM2's GGUF
    Q4_1/Q8_0 dequantised), ``quantized`` (SmolLM2's as the file has them:
    int4 groups and int8 rows multiplied by torch's CPU kernels, CPU
    devices only; ``dtype`` is the activations', bfloat16 by default, the
    one those kernels are vectorised for), or ``auto`` (``tessera serve``'s
    default): quantized when the model's file is quantized, every device is
    a CPU and ``dtype`` is auto or bfloat16, else dense.  ``dtype="auto"``:
    bfloat16 with quantized weights, else float32 (the engine's default:
    the reference that split-vs-single and vLLM comparisons check)."""

    model: str = "smollm2"
    size: str = "real"
    devices: str = "cpu,cpu"
    nodes: tuple[str, ...] = ()
    node_args: tuple[str, ...] = ()
    ray: object = ""            # "" | "auto" | a Ray address | launch.ray.RayNodes
    expect_nodes: int = 0
    listen: str = ""            # where the engine's actor system listens (expect_nodes: the nodes' scheduler)
    launched: tuple = ()        # set by the engine: the device strings of the nodes its launcher started
    dtype: str = "auto"         # float32 | bfloat16 | float16 | auto: bfloat16 with quantized weights, else float32
    weights: str = "dense"      # dense | quantized | auto (see the class docstring)
    max_seqs: int = 16
    max_model_len: int = 2048
    max_queue: int = 256
    kv_cache_memory: int | float | str | None = None
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 192, 256, 320, 384, 448, 512)
    prefill_rows: tuple[int, ...] = (1, 4, 8)   # sequences a prompt-chunk step may carry (batched prefill)
    max_batched_tokens: int = 512   # prompt tokens (padded) of one step, as vLLM's max_num_batched_tokens
    prefix_caching: bool = True     # a prompt that starts as a finished one did reuses its KV row (batch.SlotAllocator)
    kv_windows: tuple[int, ...] | None = None   # attention windows per bucket; None: (512, max_model_len)
    planner: str = "contiguous"
    planner_options: dict = field(default_factory=dict)   # keyword options of the planner (offload: policy, cpu_bps, ...)
    mode: str = "auto"
    groups: int = 2
    lookahead: int = 1
    prompt_steps: int | None = None   # prompt-chunk steps in flight at most (None: the prompt plan's micro-batches)
    monitor_window_s: float = 0.3
    monitor_beta: float = 1.5
    step_timeout: float = 60.0
    heartbeat_s: float = 0.25
    lost_after_s: float = 1.0
    watch_processes: bool = True   # node processes the engine started: their exit is a loss at once
    rejoin_wait_s: float = 30.0    # no node left to place on: how long to wait for a suspected one to answer
    seed: int = 0
    profile: bool = False       # time the reference bucket's kernels on each in-process device for the planner
    trace_dir: str | None = None
    overrides: dict = field(default_factory=dict)   # extra model config fields
    # where the model is built before its values move to host memory (a GPU generates a real-size
    # random-weight model in seconds, a CPU in minutes)
    build_device: str = "cpu"
    # how buckets are captured: auto (inductor when every device is a GPU, else aten), aten, inductor
    capture: str = "auto"
    embeddings: bool = True   # an embed bucket for /v1/embeddings (placed last, in the background)
    regions: str = "auto"   # inductor: per repeated block (auto, blocks) or the whole model as one graph
    gqa: str = "auto"       # attention's GQA form: auto (enable_gqa on GPUs: cuDNN's kernel), fold, enable_gqa
    gpu_budget: int | str | None = None   # bytes the GPU may hold: the offload planner serves a bigger model
    devices_chosen: str = ""   # why these devices, when tessera serve chose them (flags.default_deployment)

    def __post_init__(self) -> None:
        def bad(why: str) -> ValueError:
            return ValueError(f"EngineConfig: {why}")
        self.nodes = tuple(self.nodes)
        self.node_args = tuple(self.node_args)
        self._check_launch(bad)
        self.decode_buckets = tuple(sorted(set(int(b) for b in self.decode_buckets)))
        self.prefill_buckets = tuple(sorted(set(int(b) for b in self.prefill_buckets)))
        if self.max_seqs < 1:
            raise bad(f"max_seqs must be >= 1, got {self.max_seqs}")
        if self.max_model_len < 2:
            raise bad(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_queue < 0:
            raise bad(f"max_queue must be >= 0, got {self.max_queue}")
        if not self.decode_buckets or self.decode_buckets[0] < 1:
            raise bad(f"decode_buckets must be positive sizes, got {self.decode_buckets}")
        self.decode_buckets = tuple(b for b in self.decode_buckets if b < self.max_seqs) + (self.max_seqs,)
        self.prefill_rows = tuple(sorted({1} | {int(r) for r in self.prefill_rows}))
        if self.prefill_rows[0] < 1:
            raise bad(f"prefill_rows must be positive counts, got {self.prefill_rows}")
        if self.max_batched_tokens < 1:
            raise bad(f"max_batched_tokens must be >= 1, got {self.max_batched_tokens}")
        if any(b < 1 for b in self.prefill_buckets):
            raise bad(f"prefill_buckets must be positive sizes, got {self.prefill_buckets}")
        self.prefill_buckets = tuple(b for b in self.prefill_buckets if b < self.max_model_len)
        if self.kv_windows is None:
            self.kv_windows = (512,) if self.max_model_len > 512 else ()
        self.kv_windows = tuple(sorted({int(w) for w in self.kv_windows if 0 < int(w) < self.max_model_len}
                                       | {self.max_model_len}))
        if self.mode not in ("latency", "throughput", "auto"):
            raise bad(f"mode must be latency, throughput or auto, got {self.mode!r}")
        if self.groups < 1:
            raise bad(f"groups must be >= 1, got {self.groups}")
        self.groups = min(self.groups, self.max_seqs)   # a group needs at least one row
        if self.lookahead not in (0, 1):
            raise bad(f"lookahead must be 0 or 1, got {self.lookahead}")
        if self.prompt_steps is not None and self.prompt_steps < 1:
            raise bad(f"prompt_steps must be >= 1 or None, got {self.prompt_steps}")
        for name in ("step_timeout", "heartbeat_s", "lost_after_s", "rejoin_wait_s", "monitor_window_s",
                     "monitor_beta"):
            if getattr(self, name) <= 0:
                raise bad(f"{name} must be positive, got {getattr(self, name)}")
        if not isinstance(self.planner_options, dict):
            raise bad(f"planner_options must be a dict, got {self.planner_options!r}")
        for name, allowed in (("capture", ("auto", "aten", "inductor")), ("regions", ("auto", "whole", "blocks")),
                              ("gqa", ("auto", "fold", "enable_gqa"))):
            if getattr(self, name) not in allowed:
                raise bad(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        kv_budget(self.kv_cache_memory)   # a bad value fails here, before anything is built
        if self.gpu_budget is not None:
            self._apply_gpu_budget(bad)
        self._resolve_weights(bad)

    def _resolve_weights(self, bad) -> None:
        """``weights`` and ``dtype`` made concrete (see the class docstring)."""
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise bad(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.weights not in ("auto", "dense", "quantized"):
            raise bad(f"weights must be dense, quantized or auto, got {self.weights!r}")
        specs = self.device_specs()
        others = [s.name for s in specs if s.kind != "cpu"]
        if self.weights == "auto":
            cpus = bool(specs) and not others
            self.weights = ("quantized" if self.model in QUANTIZED_MODELS and cpus
                            and self.dtype in ("auto", "bfloat16") else "dense")
        if self.weights == "quantized":
            if self.model not in QUANTIZED_MODELS:
                raise bad(f"weights='quantized' keeps a model file's quantized weights: model "
                          f"{' or '.join(QUANTIZED_MODELS)}, not {self.model!r}")
            if others:
                raise bad(f"weights='quantized' runs torch's CPU int4/int8 kernels "
                          f"(aten._weight_int4pack_mm_for_cpu), which {', '.join(others)} has not: serve "
                          "quantized weights on CPU devices, or weights='dense' here")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.weights == "quantized" else "float32"

    def _check_launch(self, bad) -> None:
        from tessera_actors.launch.ray import RayNodes
        if isinstance(self.ray, str) and self.ray:
            self.ray = RayNodes(address=self.ray)
        elif self.ray and not isinstance(self.ray, RayNodes):
            raise bad(f"ray must be an address, 'auto' or a RayNodes, got {self.ray!r}")
        if self.expect_nodes < 0:
            raise bad(f"expect_nodes must be >= 0, got {self.expect_nodes}")
        given = [name for name, on in (("nodes", self.nodes), ("ray", self.ray), ("expect_nodes", self.expect_nodes))
                 if on]
        if len(given) > 1:
            raise bad(f"{' and '.join(given)} are different ways to get nodes: give one")
        if self.expect_nodes and not self.listen.startswith("tcp://"):
            raise bad(f"expect_nodes needs listen, the tcp:// endpoint the nodes register at, got {self.listen!r}")
        if self.listen and not self.expect_nodes:
            raise bad("listen is for nodes that register by themselves (expect_nodes)")

    def _apply_gpu_budget(self, bad) -> None:
        """``gpu_budget`` as a ``mem=`` budget on the deployment's GPU and the
        ``offload`` planner (see the class docstring)."""
        import dataclasses
        from tessera_actors.devices import DeviceSpecError, parse_bytes, parse_devices
        if self.nodes or self.ray or self.expect_nodes:
            raise bad("gpu_budget is for in-process devices (a GPU and a CPU), not nodes")
        try:
            budget = parse_bytes(self.gpu_budget) if isinstance(self.gpu_budget, str) else int(self.gpu_budget)
        except (DeviceSpecError, TypeError, ValueError) as e:
            raise bad(f"gpu_budget must be bytes or a size such as '8GiB', got {self.gpu_budget!r} ({e})") from None
        if budget < 1:
            raise bad(f"gpu_budget must be positive, got {self.gpu_budget!r}")
        specs = parse_devices(self.devices)
        gpus = [i for i, s in enumerate(specs) if s.kind != "cpu"] or [0]
        if len(specs) != 2 or len(gpus) != 1 or specs[1 - gpus[0]].kind != "cpu":
            raise bad(f"gpu_budget needs two devices, a GPU and a CPU (e.g. 'cuda:0,cpu?threads=12'), "
                      f"got {self.devices!r}")
        g = specs[gpus[0]]
        if g.mem is not None and g.mem != budget:   # (equal: this config again, dataclasses.replace)
            raise bad(f"gpu_budget and a mem= budget on {self.devices!r}: give one")
        if self.planner not in ("contiguous", "offload"):
            raise bad(f"gpu_budget places with the offload planner, not {self.planner!r}")
        specs[gpus[0]] = dataclasses.replace(g, mem=budget)
        self.devices = ",".join(s.name for s in specs)
        self.planner = "offload"
        self.gpu_budget = budget
        # a GPU holds what no graph names (its captured graphs' pool, transient results): kept from the budget
        from tessera_actors.planning.offload import default_reserve
        reserve = default_reserve([s.name for s in specs])
        if reserve and "reserve" not in self.planner_options:
            self.planner_options = {**self.planner_options, "reserve": reserve}

    def device_specs(self) -> list:
        """Every device of the deployment: the in-process ones, or every
        node's (``launched``: the devices of the nodes a launcher started,
        set by the engine; nodes that register by themselves or that Ray
        has not started yet are not known: none)."""
        from tessera_actors.devices import parse_devices
        if self.launched:
            return [s for n in self.launched for s in parse_devices(n)]
        if self.expect_nodes or self.ray:
            return []
        return [s for n in self.nodes for s in parse_devices(n)] if self.nodes else parse_devices(self.devices)

    def group_bounds(self, groups: int) -> list[tuple[int, int]]:
        """KV rows ``[lo, hi)`` of each of ``groups`` micro-batch groups."""
        size = -(-self.max_seqs // groups)
        return [(lo, min(lo + size, self.max_seqs)) for lo in range(0, self.max_seqs, size)]


QUANTIZED_MODELS = ("smollm2",)   # models whose file holds quantized weights (models/smollm2.py)
AUTO_CPU_KV = "512MiB"   # "auto" on CPUs: SmolLM2 in float32 then holds 5 sequences of 2048 tokens


def kv_budget(value: int | float | str | None, cpu_only: bool = True) -> tuple[str, float] | None:
    """``kv_cache_memory`` read: ("bytes", n) or ("fraction", f), None for
    no limit (``"auto"``: :data:`AUTO_CPU_KV` on a ``cpu_only``
    deployment); ``ValueError`` naming the field otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        value = AUTO_CPU_KV if cpu_only else None
    if value is None:
        return None
    if isinstance(value, str):
        from tessera_actors.devices import DeviceSpecError, parse_bytes
        try:
            value = parse_bytes(value)
        except DeviceSpecError as e:
            raise ValueError(f"EngineConfig: kv_cache_memory: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"EngineConfig: kv_cache_memory must be bytes, a size such as '512MiB' or a fraction "
                         f"in (0, 1], got {value!r}")
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"EngineConfig: kv_cache_memory as a fraction must be in (0, 1], got {value!r} "
                             "(bytes are an integer or a size such as '2GiB')")
        return ("fraction", value)
    if value <= 1:
        raise ValueError(f"EngineConfig: kv_cache_memory must be positive bytes or a fraction in (0, 1], got {value!r}")
    return ("bytes", float(int(value)))

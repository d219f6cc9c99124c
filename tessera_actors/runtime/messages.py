"""All wire messages, declared in one place as frozen dataclasses.

``@message`` turns a class into a frozen dataclass (unless it already is one)
and registers it under its class name, which is its *wire kind*.  Field values
may be str/int/float/bool/None/bytes, lists/tuples/dicts of those, nested
registered messages, and tensors (``torch.Tensor`` / ``numpy.ndarray``)
anywhere inside fields; tensors travel as separate zero-copy frames.

Evolution rule: append-only.  Add new fields at the end *with defaults*; never
rename or retype a field.  Decoding ignores unknown fields and fills missing
ones from defaults, so old and new peers keep understanding each other.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, TypeVar, overload

T = TypeVar("T", bound=type)

_REGISTRY: dict[str, type] = {}
# per class: tuple of field names, cached for the codec's hot path
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


@overload
def message(cls: T) -> T: ...
@overload
def message(*, kind: str) -> Callable[[T], T]: ...


def message(cls=None, *, kind: str | None = None):
    """Register ``cls`` as a wire message (usable as ``@message`` or ``@message(kind=...)``).

    Raises ``TypeError`` when another class already owns the kind.
    """

    def register(c):
        if not dataclasses.is_dataclass(c):
            c = dataclasses.dataclass(frozen=True)(c)
        wire_kind = kind or c.__name__
        prior = _REGISTRY.get(wire_kind)
        if prior is not None and (prior.__module__, prior.__qualname__) != (c.__module__, c.__qualname__):
            raise TypeError(f"message kind {wire_kind!r} already registered by {prior.__module__}.{prior.__qualname__}")
        _REGISTRY[wire_kind] = c
        _FIELD_NAMES[c] = tuple(f.name for f in dataclasses.fields(c))
        c.__wire_kind__ = wire_kind
        return c

    return register if cls is None else register(cls)


def registry() -> dict[str, type]:
    """A copy of the kind -> class registry."""
    return dict(_REGISTRY)


# --- runtime messages -------------------------------------------------------

@message
class Ping:
    """Liveness probe; every actor answers it with ``Pong(payload)``."""
    payload: bytes = b""


@message
class Pong:
    payload: bytes = b""


@message
class ErrorReply:
    """Wire form of a failed ask: ``kind`` is an error class name."""
    kind: str
    message: str


@message
class Ok:
    detail: str = ""


# --- execution messages (appended by the execution layer below) -------------
# Maps keyed by ints travel as parallel lists (msgpack map keys stay strings).

@dataclasses.dataclass(frozen=True)
class _NodeFields:
    """A node daemon's name, the endpoint it listens on, its device specs and
    its process id (not a message itself: the fields of two)."""
    node: str
    endpoint: str
    devices: list = dataclasses.field(default_factory=list)
    pid: int = 0


@message
class Register(_NodeFields):
    """A node announces itself to the scheduler; reply: ``Registered``."""


@message
class Registered:
    node: str
    first_device: int = 0   # global index of the node's first device


@message
class Heartbeat:
    node: str
    seq: int = 0


@message
class Describe:
    """Ask a node what it hosts; reply: ``NodeInfo``."""


@message
class NodeInfo(_NodeFields):
    """A node's answer to ``Describe``: what ``Register`` announces."""


@message
class InstallPlan:
    """Install device ``device``'s part of a plan. ``graph`` and ``plan`` are
    msgpack bytes (KernelGraph.to_dict / plan_to_dict), or, to a device
    actor of the sender's process, the ``KernelGraph`` and ``Plan``
    themselves (read only, shared: nothing encoded); ``routes`` lists
    ``[device, endpoint, actor]`` for every plan device (endpoint "" = this
    process). Reply: ``Installed``.  ``share`` (non-empty) names a group of
    plans whose named weight and state buffers are one set of tensors on the
    device (the bucket graphs of one served model share weights and the KV
    cache): a buffer of the same name and size is allocated once per group.
    ``adopt``, to a device actor of the sender's process only: the initial
    bytes of weight buffers (buffer id -> flat uint8 host tensor) that a
    CPU device may hold as they are for its share group, instead of a copy
    (kernels only read weights); the ones it holds are not in ``need``."""
    plan_id: str
    device: int
    graph: object
    plan: object
    routes: list = dataclasses.field(default_factory=list)
    share: str = ""
    adopt: dict = dataclasses.field(default_factory=dict)


@message
class Installed:
    """``need``: the weight/state buffers of the plan whose values the device
    does not hold yet (those of a share group it loaded before are held);
    ``resident_bytes``: the bytes of the plan's own buffers there, its
    temporaries in the device's shared scratch included (not the share
    group's weights and state)."""
    plan_id: str
    device: int
    resident_bytes: int = 0
    kernels: int = 0
    segments: int = 0
    need: list = dataclasses.field(default_factory=list)


@message
class LoadValues:
    """Initial bytes of weight/state buffers (flat uint8 tensors); buffers
    the device does not hold are ignored. Reply: ``Ok``."""
    plan_id: str
    buffers: list = dataclasses.field(default_factory=list)
    data: list = dataclasses.field(default_factory=list)


@message
class SampleRow:
    """How one sampled entry of a step is drawn, and (decode) where its row
    stands.  ``row``: its row of the logits ``[B, T, V]`` (a decode step's
    KV row minus the bucket's first, a prompt chunk's row), ``col`` its
    token there; ``temperature`` 0 is greedy; ``top_k`` 0 keeps every id;
    ``seed`` and ``index`` (the token's position in the request's output)
    alone give the draw's uniform number, so a seeded request gets the same
    tokens in any batch; ``record``: the fixed part of the request's
    sampling record (penalties, logit bias, top log probabilities:
    ``tessera_actors.execution.sampling_extras``).  In :class:`StepRows`,
    ``position`` and ``token`` are the row's decode input (its position in
    the KV row and the token fed there)."""
    row: int
    col: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    index: int = 0
    record: dict = dataclasses.field(default_factory=dict)
    position: int = 0
    token: int = 0


@message
class StepRows:
    """A decode step's rows, as a change of the plan's previous step on the
    same device (the row state lives on the devices: positions, input
    tokens and sampling parameters, advanced there between steps).

    ``base``: the step of this plan whose rows these continue (-1: none,
    every row is in ``new``); a device whose last step of the plan is not
    ``base`` fails the step.  ``order``: the row of each sampled entry, in
    entry order (None: ``base``'s order).  ``new``: the rows that start
    here (admitted, or back from another plan's steps), with their
    position, input token and sampling; every other row of ``order`` was
    in ``base``: its position is one more, its input token is what the
    device sampled for it in ``base``, its output index one more.  A row
    of ``base`` not in ``order`` becomes padding, which writes position
    ``pad`` (the last cache slot).  ``tokens`` (a device reading input_ids
    that does not sample: split deployments): every entry's input token,
    in entry order.  ``records``: ``[[entry, record]]`` of the records that
    change every step (the tokens so far of penalties, JSON mode's mask),
    merged over the row's fixed record."""
    base: int = -1
    order: list | None = None
    new: list = dataclasses.field(default_factory=list)
    pad: int = 0
    tokens: list = dataclasses.field(default_factory=list)
    records: list = dataclasses.field(default_factory=list)


@message
class ChunkRows:
    """A prompt-chunk step's rows, as ints; the device that reads the step's
    inputs builds ``input_ids`` and ``positions`` ``[rows, size]``, ``rows``
    and ``last`` ``[rows]`` from them.  Row ``i`` feeds ``tokens[i]`` into
    KV row ``slots[i]`` from position ``starts[i]`` on (its columns past
    them: token 0 at the next positions, none past ``pad``; ``last`` is its
    last real token); a row past ``tokens`` is padding: token 0 at position
    ``pad`` (the last cache slot) of KV row ``slots[0]``."""
    size: int = 0
    rows: int = 0
    slots: list = dataclasses.field(default_factory=list)
    starts: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)
    pad: int = 0


@message
class RunStep:
    """Run one step of an installed plan. ``inputs`` maps step-input names to
    tensors (only those this device reads are needed). Reply: ``StepDone``
    once the device finished its program for this step.

    ``sample`` (serving): the entries of the first output (logits ``[B, T,
    V]``) to sample on the device that holds them, each a
    :class:`SampleRow` (or the list ``[row, col, temperature, top_p,
    top_k, seed, index]`` with an optional eighth element, the record);
    that device answers with ``tokens``.  ``rows`` (a decode step): its
    rows as :class:`StepRows` instead of ``sample`` and of the
    ``input_ids`` and ``positions`` inputs; ``chunk`` (a prompt-chunk
    step): its rows as :class:`ChunkRows` instead of the token inputs.
    ``outputs=False``: no output bytes in the reply (the engine needs only
    the tokens).  ``trace``: answer with ``StepDone.spans`` (what the
    device did when, for a trace file).  ``probe``: answer with
    ``StepDone.timeline`` (the step's intervals by resource: kernels,
    copies, hand-offs; the step runs as unprobed ones do)."""
    plan_id: str
    step: int
    inputs: dict = dataclasses.field(default_factory=dict)
    sample: list = dataclasses.field(default_factory=list)
    outputs: bool = True
    trace: bool = False
    rows: StepRows | None = None
    chunk: ChunkRows | None = None
    probe: bool = False


@message
class StepDone:
    """``ranges[i] = [buffer, start, end]`` of final output bytes in ``data[i]``;
    ``tokens``: one sampled id per ``RunStep.sample`` (or ``rows.order``) entry, from the device
    holding the logits (empty elsewhere), with its log probability in
    ``logprobs``.  ``spans`` (when traced): ``[what, start, end]`` in wall-clock
    seconds (``time.time()``) for each run of kernels, transfer wait and
    sampling, in order.  ``replays`` / ``eager_runs`` / ``capture_failures``:
    this device's runs of kernels in the step replayed as CUDA graphs, run
    eagerly (a first run, a CPU, graphs off, or a capture that failed), and
    captures that failed.  ``top_logprobs``: when an entry's record asked
    for them, per entry ``[[id, logprob], ...]`` of the most likely ids.
    ``streamed_bytes``: weight bytes copied into this device's staging ring
    from host memory (PCIe on a GPU) since its previous answered step of
    the plan (copies queued a step ahead count in the step that queued them).
    ``kernel_s``: of ``busy_s``, the seconds inside runs of kernels (a CPU
    computes there; a GPU queues or replays them); ``host_s``: the worker
    thread's CPU seconds on the step outside them (the step path's own host
    work: inputs, sampling, copies).  ``timeline`` (a probed step): the
    records of :mod:`tessera_actors.planning.offload.timeline` this device
    resolved since its last probed answer (host ``perf_counter`` seconds)."""
    plan_id: str
    step: int
    device: int
    ranges: list = dataclasses.field(default_factory=list)
    data: list = dataclasses.field(default_factory=list)
    busy_s: float = 0.0
    wait_s: float = 0.0
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    spans: list = dataclasses.field(default_factory=list)
    replays: int = 0
    eager_runs: int = 0
    capture_failures: int = 0
    top_logprobs: list = dataclasses.field(default_factory=list)
    streamed_bytes: int = 0
    kernel_s: float = 0.0
    host_s: float = 0.0
    timeline: list = dataclasses.field(default_factory=list)


@message
class Ship:
    """To a node's transfer actor: move ``data`` (transfer ``tag`` of step
    ``step``) to plan device ``dst``. Never answered."""
    plan_id: str
    step: int
    tag: int
    dst: int
    data: object = None


@message
class Deliver:
    """To a device actor: the bytes of transfer ``tag`` for step ``step``,
    or one span of them starting at byte ``offset`` of the transfer's byte
    stream.  A non-empty ``error`` (``data`` None) says the bytes will not
    come: the sender or its data-plane link failed."""
    plan_id: str
    step: int
    tag: int
    data: object = None
    offset: int = 0
    error: str = ""


@message
class Incoming:
    """To a node's transfer actor, over ZeroMQ: the header of bytes that
    travel on torch.distributed link ``link`` (its ``seq``-th message, seq
    counting from 0): ``nbytes`` bytes of transfer ``tag`` of step ``step``
    starting at byte ``offset``, for local actor ``actor``.  ``store`` is the
    link's rendezvous (``host:port`` of a TCPStore held by the sender),
    ``backend`` gloo | nccl, ``device`` the receiving device spec.  Never
    answered; a failed receive reaches ``actor`` as ``Deliver`` with an error."""
    link: str
    seq: int
    plan_id: str
    step: int
    tag: int
    actor: str
    offset: int = 0
    nbytes: int = 0
    store: str = ""
    backend: str = "gloo"
    device: str = "cpu"


@message
class Routes:
    """To a transfer actor: where each plan device lives, and its device spec
    (``devices[i]`` of plan device ``i``; empty from older schedulers)."""
    plan_id: str
    routes: list = dataclasses.field(default_factory=list)
    devices: list = dataclasses.field(default_factory=list)


@message
class GetStats:
    """Ask an actor for its counters; reply: ``Stats``."""


@message
class Stats:
    values: dict = dataclasses.field(default_factory=dict)


@message
class Uninstall:
    """Drop plan ``plan_id``; ``wait``: answer only once its memory is free
    (after the work already queued on the device), else at once."""
    plan_id: str
    wait: bool = False


@message
class GetGraph:
    """Ask the graph actor for graph ``name`` ("" = its first); reply:
    ``GraphBlob``.  ``objects`` (an asker in the graph actor's process):
    the reply holds the ``KernelGraph`` itself, not its bytes."""
    name: str = ""
    objects: bool = False


@message
class GraphBlob:
    data: bytes
    summary: dict = dataclasses.field(default_factory=dict)
    graph: object = None


@message
class Place:
    """To the scheduler: plan the graph on the registered devices with its
    planner (``mode`` latency | throughput) and deploy it. Reply: ``Placed``.
    ``graph`` names the graph (a bucket of a served model; "" = the first);
    ``pins`` maps state-buffer names to inventory device indices: kernels
    touching that state run there (the KV cache stays where it lives), and
    the rest follow their state (``planning.pinning``); a pin is the
    ``[endpoint, actor]`` of the device actor holding the state.  ``share``
    is passed on to ``InstallPlan``.  ``devices`` (inventory indices)
    restricts the placement to those devices.  ``objects`` (an asker in
    the scheduler's process): ``Placed.plan`` is the ``Plan`` itself."""
    plan_id: str
    mode: str = "latency"
    graph: str = ""
    pins: dict = dataclasses.field(default_factory=dict)
    share: str = ""
    devices: list = dataclasses.field(default_factory=list)
    weights: dict = dataclasses.field(default_factory=dict)   # weight name -> [[endpoint, actor], ...] holding it
    objects: bool = False


@message
class Placed:
    """Where each plan device lives (``[device, endpoint, actor]``) and the
    plan (its bytes, or with ``Place.objects`` the ``Plan``)."""
    plan_id: str
    routes: list = dataclasses.field(default_factory=list)
    plan: object = b""


@message
class Shutdown:
    """Ask a node to shut down in order (as SIGTERM does)."""


@message
class ReportLost:
    """To the scheduler: the node serving ``endpoint`` stopped answering;
    later placements leave it out. Reply: ``Ok``."""
    endpoint: str
    reason: str = ""


@message
class Readmit:
    """To the scheduler: the node serving ``endpoint``, reported lost, answers
    again (it was paused, not dead).  The scheduler checks it is the node it
    registered (same name and process), uninstalls the plans it held when it
    was reported lost, and lets later placements use it. Reply: ``Ok``."""
    endpoint: str

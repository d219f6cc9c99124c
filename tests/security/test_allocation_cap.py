"""The allocation cap, against an authenticated but hostile peer: a node with
one ``cpu?mem=64MiB`` device (a real daemon, ``LocalCluster``) is sent
one-kernel plans whose kernel would allocate far more than 64 MiB through an
argument that is not a size (a pad, a repeat count, a scale factor, an
``out=`` or ``resize_`` to grow).  Each install is refused by name before any
memory is touched - every kernel's outputs are sized on meta tensors at
install - the node's resident memory stays put, and it keeps installing
plans that fit, and refuses a kernel that names a device of its own."""
import msgpack
import pytest
import pytest_asyncio
import torch

from tessera_actors.cluster import LocalCluster
from tessera_actors.execution.allow import meta_bytes
from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.plan import plan_to_dict, single_device_plan
from tessera_actors.runtime.errors import RemoteError
from tessera_actors.runtime.messages import GetStats, InstallPlan, RunStep, Uninstall
from transport.system import ActorSystem

MiB = 1 << 20
SPEC = "cpu?mem=64MiB"


def ref(buffer: int, shape: list, dtype: str = "uint8", stride: list | None = None) -> dict:
    if stride is None:
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
    return {"t": [buffer, 0, shape, stride, dtype]}


def plan_of(op: str, args: list, kwargs: dict, out_bytes: int = 64, alias: bool = False) -> tuple[bytes, bytes]:
    """One kernel reading buffer 0 (1 KiB) and writing buffer 1 (``out_bytes``)."""
    out = {"ref": ref(1, [out_bytes]), "alias": alias}
    kernel = Kernel(0, "k", "library", (Access(0, 0, 1024, "r"), Access(1, 0, out_bytes, "w")),
                    payload={"op": op, "args": args, "kwargs": kwargs, "outs": [out]})
    graph = KernelGraph([kernel], {0: Buffer(0, 1024, "temp"), 1: Buffer(1, out_bytes, "output")}, outputs=[1])
    plan = single_device_plan(graph, SPEC)
    return msgpack.packb(graph.to_dict(), use_bin_type=True), msgpack.packb(plan_to_dict(plan), use_bin_type=True)


X = ref(0, [64])                       # 64 bytes of buffer 0
F = ref(0, [1, 1, 16], "float32")      # 16 floats of it
HUGE = [
    ("constant_pad_nd", "aten.constant_pad_nd.default", [X, [0, 536870912]], {}, False),   # 512 MiB of padding
    ("tile", "aten.tile.default", [X, [1 << 23]], {}, False),                                # 512 MiB
    ("repeat", "aten.repeat.default", [X, [1 << 23]], {}, False),                            # 512 MiB
    ("upsample_nearest1d", "aten.upsample_nearest1d.vec", [F, None, [4e7]], {}, False),      # 2.4 GiB of floats
    ("mm.out grown", "aten.mm.out", [ref(0, [8192, 1], "float32", [0, 0]), ref(0, [1, 8192], "float32", [0, 0])],
     {"out": ref(1, [16], "float32")}, True),                                                   # out= resized to 256 MiB
    ("resize_", "aten.resize_.default", [ref(1, [64]), [1 << 30]], {}, True),                # 1 GiB
]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")   # the node fixture lives as long as the module


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node_device():
    """(this process's actor system, the node) - one capped node for the module, warmed up by one plan
    that fits (the node's first meta-tensor run imports for a while: its memory is not the attack's)."""
    async with ActorSystem("hostile") as system, LocalCluster([SPEC]) as cluster:
        device = await system.remote_ref(cluster.nodes[0].endpoint, "device0")
        graph, plan = plan_of("aten.constant_pad_nd.default", [X, [0, 64]], {}, out_bytes=128)
        await device.ask(InstallPlan("warm", 0, graph, plan, [[0, "", "device0"]]), timeout=120)
        await device.ask(Uninstall("warm", wait=True), timeout=30)
        yield system, cluster.nodes[0]


@MODULE_LOOP
@pytest.mark.parametrize("name,op,args,kwargs,alias", HUGE, ids=[h[0] for h in HUGE])
async def test_a_kernel_that_would_allocate_past_the_devices_cap_is_refused_at_install(node_device, name, op, args,
                                                                                     kwargs, alias):
    system, node = node_device
    device = await system.remote_ref(node.endpoint, "device0")
    await device.ask(GetStats(), timeout=30)
    before = rss(node.proc.pid)
    graph, plan = plan_of(op, args, kwargs, alias=alias)
    with pytest.raises(RemoteError, match="memory cap of") as info:
        await device.ask(InstallPlan("evil", 0, graph, plan, [[0, "", "device0"]]), timeout=60)
    assert info.value.kind == "KernelRefused" and op in info.value.message
    with pytest.raises(RemoteError, match="not installed"):   # nothing to run: the kernel never ran
        await device.ask(RunStep("evil", 0, {}), timeout=30)
    assert rss(node.proc.pid) - before < 64 * MiB   # the cap (first meta runs of an op kind import some code)
    assert (await device.ask(GetStats(), timeout=10)).values["plans"] == []


@MODULE_LOOP
async def test_kernels_within_the_cap_install_and_run(node_device):
    system, node = node_device
    device = await system.remote_ref(node.endpoint, "device0")
    for i, (op, args) in enumerate([("aten.constant_pad_nd.default", [X, [0, 64]]), ("aten.repeat.default", [X, [2]])]):
        graph, plan = plan_of(op, args, {}, out_bytes=128)
        await device.ask(InstallPlan(f"fine{i}", 0, graph, plan, [[0, "", "device0"]]), timeout=60)
        done = await device.ask(RunStep(f"fine{i}", 0, {}), timeout=30)
        assert [bytes(d).count(0) for d in done.data] == [128]   # zeros in, zeros padded: the kernel ran


@MODULE_LOOP
async def test_a_kernel_that_names_a_device_of_its_own_is_refused(node_device):
    """A device is a record (``{"dev": ...}``: the plan's device); a named one
    (on a GPU node, another GPU than the capped one) is refused."""
    system, node = node_device
    device = await system.remote_ref(node.endpoint, "device0")
    graph, plan = plan_of("aten.empty.memory_format", [[64]], {"dtype": {"dt": "uint8"}, "device": "cpu"})
    with pytest.raises(RemoteError, match="its device argument names 'cpu'"):
        await device.ask(InstallPlan("named", 0, graph, plan, [[0, "", "device0"]]), timeout=60)
    graph, plan = plan_of("aten.empty.memory_format", [[64]], {"dtype": {"dt": "uint8"}, "device": {"dev": "cpu"}})
    await device.ask(InstallPlan("recorded", 0, graph, plan, [[0, "", "device0"]]), timeout=60)


def test_ops_whose_values_decide_their_size_are_bounded_by_their_inputs_or_refused():
    meta = {"device": "meta"}
    x, mask = torch.empty(1000, **meta), torch.empty(1000, dtype=torch.bool, **meta)
    ops = torch.ops.aten
    assert meta_bytes("aten.index.Tensor", ops.index.Tensor, [x, [mask]], {}) == 4000   # each element at most once
    assert meta_bytes("aten.nonzero.default", ops.nonzero.default, [mask], {}) == 8000  # one int64 per element
    assert meta_bytes("aten.index.Tensor", ops.index.Tensor, [x, [torch.empty(5, dtype=torch.long, **meta)]], {}) == 20
    assert "cannot be known before it runs" in meta_bytes("aten.unique_consecutive.default",
                                                          ops.unique_consecutive.default, [x], {})

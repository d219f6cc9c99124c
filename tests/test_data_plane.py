"""Node processes moving transfer bytes over each data plane: the split run
gives the single-device tokens and logits, counts the bytes it moved, and a
lost peer fails the step with a clear error in bounded time.  The same test
runs on two GPUs (NCCL links) on the GPU machine."""
import asyncio
import time

import pytest
import torch

from tessera_actors.execution.spans import split_spans
from tessera_actors import models
from tessera_actors.capture import capture_module
from plan_stepper import StepFailed, split_on_nodes
from tessera_actors.testing import greedy_decode
from tessera_actors.runtime.errors import RemoteError
from tessera_actors.runtime.messages import RunStep
from tessera_actors.plan import single_device_plan
from tessera_actors.execution.reference import PlanRunner

PROMPT = [3, 1, 4, 1]
NEW = 6


def step_inputs(tok, pos):
    return {"input_ids": torch.tensor([[tok]]), "positions": torch.tensor([pos])}


@pytest.fixture(scope="module")
def decode_graph():
    torch.manual_seed(0)
    torch.set_num_threads(1)   # the nodes run cpu?threads=1: same kernels, same bits
    model = models.get("llama", "tiny", dtype=torch.float32, seed=0)
    cap = capture_module(model, model.example_inputs("decode", batch=1), meta={"model": "llama"})
    return cap.graph, cap.values


def single_device(graph, values, device):
    runner = PlanRunner(graph, single_device_plan(graph, device), values, device_of=lambda d: torch.device(device))
    return asyncio.run(greedy_decode(runner.step, PROMPT, NEW))


async def split_decode(graph, values, nodes, node_args):
    async with split_on_nodes(graph, values, nodes, node_args=node_args) as run:
        tokens, logits = await greedy_decode(run.engine.step, PROMPT, NEW)
        stats = await run.transfer_stats()
        routes = {d: ep for d, ep, _ in run.routes}
    return tokens, logits, run.plan, run.engine.steps, stats, routes, [n.exit_code for n in run.cluster.nodes]


def check_bytes_moved(plan, steps, stats, routes, plane, span):
    """Every transfer crossed processes once per step, in the expected number
    of messages; on the dist plane the links carried exactly those bytes."""
    assert len(set(routes.values())) == len(routes)            # one device per node: every transfer is remote
    total = sum(st["remote_bytes"] for st in stats.values())
    assert total == plan.bytes_per_step() * steps > 0
    assert sum(st["local_bytes"] for st in stats.values()) == 0
    assert sum(st["remote_transfers"] for st in stats.values()) == len(plan.transfers) * steps
    messages = sum(len(split_spans(t.nbytes, span)) for t in plan.transfers) * steps
    assert sum(st["remote_spans"] for st in stats.values()) == messages
    for ep, st in stats.items():
        assert st["data_plane"] == plane and st["link_errors"] == 0
        sent = sum(t.nbytes for t in plan.transfers if routes[t.src] == ep) * steps
        received = sum(t.nbytes for t in plan.transfers if routes[t.dst] == ep) * steps
        assert st["remote_bytes"] == sent
        if plane == "dist":
            assert st["link_bytes_sent"] == sent and st["link_bytes_received"] == received
        else:
            assert st["link_bytes_sent"] == st["link_bytes_received"] == 0


@pytest.mark.parametrize("plane,span", [("dist", None), ("dist", 16), ("zmq", 16)],
                         ids=["gloo", "gloo-spans", "zmq-spans"])
def test_split_over_node_processes_is_bitwise_single_device(decode_graph, plane, span):
    graph, values = decode_graph
    ref_tokens, ref_logits = single_device(graph, values, "cpu")
    args = ["--data-plane", plane] + (["--span-bytes", str(span)] if span else [])
    nodes = ("cpu?threads=1", "cpu?threads=1")
    tokens, logits, plan, steps, stats, routes, codes = asyncio.run(split_decode(graph, values, nodes, args))
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    if span:   # the test forces spans: some transfer really was split
        assert any(t.nbytes > span for t in plan.transfers)
    check_bytes_moved(plan, steps, stats, routes, plane, span or 4 << 20)
    if plane == "dist":
        assert any("gloo:send" in st["links"] for st in stats.values())
        assert any("gloo:recv" in st["links"] for st in stats.values())
    assert codes == [0, 0]


async def test_dist_plane_peer_killed_mid_run_fails_steps_with_clear_errors_in_bounded_time(decode_graph):
    graph, values = decode_graph
    args = ["--data-plane", "dist", "--recv-timeout", "2", "--link-timeout", "5"]
    nodes = ("cpu?threads=1", "cpu?threads=1")
    async with split_on_nodes(graph, values, nodes, node_args=args, step_timeout=4) as run:
        assert {(t.src, t.dst) for t in run.plan.transfers} == {(0, 1)}
        await run.engine.step(step_inputs(PROMPT[0], 0))
        await run.engine.step(step_inputs(PROMPT[1], 1))
        sender = next(n for n in run.cluster.nodes if n.endpoint == run.routes[0][1])
        sender.proc.kill()
        await sender.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(StepFailed, match=r"step 2: device 0 \(cpu\?threads=1\) failed: AskTimeout"):
            await run.engine.step(step_inputs(PROMPT[2], 2))
        assert time.monotonic() - t0 < 4 + 3
        # the surviving receiver names the transfer that stopped coming
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match=r"transfer \d+ from device 0 \(cpu\?threads=1\) of step 3: "
                                              r"0 of \d+ bytes arrived, then nothing within 2 s"):
            await run.engine.devices[1].ask(RunStep("demo", 3, step_inputs(PROMPT[3], 3)), timeout=20)
        assert time.monotonic() - t0 < 8
    survivor = next(n for n in run.cluster.nodes if n is not sender)
    assert survivor.exit_code == 0


@pytest.mark.gpu
@pytest.mark.parametrize("span", [None, 64], ids=["whole", "spans"])
def test_nccl_links_between_node_processes_on_two_gpus_match_single_gpu(decode_graph, span):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: one node process per GPU")
    graph, values = decode_graph
    ref_tokens, ref_logits = single_device(graph, values, "cuda:0")
    args = ["--data-plane", "dist"] + (["--span-bytes", str(span)] if span else [])
    tokens, logits, plan, steps, stats, routes, codes = asyncio.run(
        split_decode(graph, values, ("cuda:0", "cuda:1"), args))
    assert tokens == ref_tokens
    cos = min(torch.nn.functional.cosine_similarity(a.double().flatten().cpu(), b.double().flatten().cpu(), dim=0)
              for a, b in zip(logits, ref_logits))
    assert cos >= 0.999
    check_bytes_moved(plan, steps, stats, routes, "dist", span or 4 << 20)
    assert any("nccl:send" in st["links"] for st in stats.values())
    assert any("nccl:recv" in st["links"] for st in stats.values())
    assert codes == [0, 0]

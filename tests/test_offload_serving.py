"""Offload placement served by the engine, on CPU devices: a budgeted
device (``cpu?threads=1&mem=...``, the GPU's stand-in) beside ``cpu``, every
bucket of the model placed by the offload planner in one share group -
one resident copy, one host home per streamed weight and one staging ring
for all buckets - with greedy tokens bitwise equal to one device's."""
import asyncio

import pytest
import torch

from tessera_actors import AsyncEngine, SamplingParams, models
from tessera_actors.capture import capture_module
from tessera_actors.runtime.messages import GetStats

CFG = dict(model="llama", size="tiny", max_seqs=4, max_model_len=64, decode_buckets=(1, 4), prefill_buckets=(8, 16),
           kv_windows=(), mode="latency", embeddings=False)   # the buckets of generation only
# rates under which the tiny model's plans use all three homes (the planning tests' rates)
OPTIONS = dict(pcie_bps=1e8, cpu_bps=1e8, switch_s=1e-5)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21]]


def budget() -> int:
    """Bytes that hold the KV cache, activations and half the weights (less the other buckets' own buffers)."""
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0, max_batch=4, max_seq=64)
    g = capture_module(m, m.example_inputs("decode", batch=4)).graph
    w = sum(b.nbytes for b in g.buffers.values() if b.role == "weight")
    rest = sum(b.nbytes for b in g.buffers.values() if b.role != "weight")
    return rest + w // 2


async def _greedy(eng, prompt, n=10):
    out = []
    async for piece in eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        out += piece.token_ids
    return out


def _names(graph, ids):
    """Names of the heavy weights (matrices, not norms) among ``ids``."""
    top = max(b.nbytes for b in graph.buffers.values() if b.role == "weight")
    return {graph.buffers[b].name for b in ids if graph.buffers[b].role == "weight" and graph.buffers[b].nbytes >= top / 100}


async def test_served_offload_plans_share_one_ring_and_give_single_device_tokens():
    async with AsyncEngine(devices="cpu", **CFG) as single:
        want = [await _greedy(single, p) for p in PROMPTS]
    devices = f"cpu?threads=1&mem={budget()},cpu"
    async with AsyncEngine(devices=devices, planner="offload", planner_options=OPTIONS, **CFG) as eng:
        await eng.wait_placed()
        alone = [await _greedy(eng, p) for p in PROMPTS]
        together = await asyncio.gather(*(_greedy(eng, p) for p in PROMPTS))
        placed = dict(eng.deployment.placed)
        stats = (await eng.deployment.system.ref("device0").ask(GetStats())).values
    assert alone == want and list(together) == want
    assert set(placed) == {"decode:4@0", "decode:1@0", "prefill:8", "prefill:16"}
    graphs = {name: eng.served.graphs[name] for name in placed}
    offs = {name: p.plan.meta["offload"] for name, p in placed.items()}
    ref = offs["decode:4@0"]
    assert set(ref["choices"]) == {"R", "S", "C"}, ref["choices"]
    # no bucket holds a weight on the budgeted device that the reference did not make resident there
    # (one copy serves them all; a bucket may compute a resident weight's reader on the CPU)
    resident = {name: _names(graphs[name], set(p.plan.resident[0]) - set(offs[name]["streamed"]))
                for name, p in placed.items()}
    assert all(r <= resident["decode:4@0"] for r in resident.values()) and resident["decode:4@0"]
    # one staging ring of the reference's slots, one host home per streamed weight (by name)
    assert {(o["slots"], o["slot_bytes"]) for o in offs.values() if o["streamed"]} == {(ref["slots"], ref["slot_bytes"])}
    assert stats["staging_bytes"] == ref["slots"] * ref["slot_bytes"]
    streamed = {graphs[n].buffers[b].name: graphs[n].buffers[b].nbytes for n, o in offs.items() for b in o["streamed"]}
    assert stats["home_bytes"] == sum(streamed.values())
    assert stats["shared_bytes"] + stats["staging_bytes"] <= budget()


def test_planner_options_from_flags_and_a_bad_one_is_refused_by_name():
    from tessera_actors.serving.flags import planner_options
    assert planner_options(["policy=streaming", "cpu_bps=3.9e10", "reserve=1024"]) == {
        "policy": "streaming", "cpu_bps": 3.9e10, "reserve": 1024}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        planner_options(["policy"])


async def test_an_unknown_planner_option_or_policy_stops_the_engine_with_its_name():
    devices = f"cpu?threads=1&mem={budget()},cpu"
    with pytest.raises(ValueError, match="polcy"):
        async with AsyncEngine(devices=devices, planner="offload", planner_options={"polcy": "tessera"}, **CFG):
            pass
    with pytest.raises(Exception, match="unknown offload policy 'fastest'"):
        async with AsyncEngine(devices=devices, planner="offload", planner_options={"policy": "fastest"}, **CFG):
            pass

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


@pytest.mark.parametrize("policy", ["streaming", "tessera"])
async def test_the_budgeted_device_counts_every_byte_it_holds_for_every_bucket(policy):
    """What the budgeted device keeps alive - found by walking the objects it
    holds, after steps of every bucket - is what it reports (``allocated_bytes``
    on the device, ``home_bytes`` in host memory), and within the budget the
    planner planned every bucket for: the decode rows and sampling state a
    plan keeps between steps included (they were not counted)."""
    from held_walk import reachable_bytes
    async with AsyncEngine(devices="cpu?threads=1,cpu", gpu_budget=budget(),
                           planner_options=dict(OPTIONS, policy=policy), **CFG) as eng:
        await eng.wait_placed()
        await asyncio.gather(*(_greedy(eng, p, 4) for p in PROMPTS))   # decode:4, prefill:8 and :16
        await _greedy(eng, [7, 8], 4)                                  # decode:1
        stepped = {b for b, c in eng.stats()["bucket_stats"].items() if c.get("replays", 0) + c.get("eager_runs", 0)}
        placed = dict(eng.deployment.placed)
        device = eng.deployment.system.ref("device0")
        stats = (await device.ask(GetStats())).values
        walked = reachable_bytes(device._actor)
    assert set(placed) == {"decode:4@0", "decode:1@0", "prefill:8", "prefill:16"} and stepped >= set(placed), stepped
    assert len(stats["plans"]) == 4
    assert walked == stats["allocated_bytes"] + stats["home_bytes"]
    assert stats["step_state_bytes"] > 0
    assert stats["allocated_bytes"] <= budget()
    assert all(p.plan.meta["offload"]["gpu_bytes"] <= p.plan.meta["offload"]["budget"] == budget()
               for p in placed.values())


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


async def test_a_gpu_budget_serves_through_the_offload_plan_and_counts_the_bytes_streamed():
    """``EngineConfig.gpu_budget``: the budget goes on the GPU (here the CPU
    standing in for it), the offload planner places every bucket, and the
    engine counts the weight bytes each step streams to it (PCIe on a GPU)."""
    async with AsyncEngine(devices="cpu", **CFG) as single:
        want = [await _greedy(single, p) for p in PROMPTS]
    async with AsyncEngine(devices="cpu?threads=1,cpu", gpu_budget=budget(), planner_options=dict(OPTIONS, policy="streaming"),
                           **CFG) as eng:
        assert eng.cfg.planner == "offload" and eng.cfg.devices == f"cpu?threads=1&mem={budget()},cpu"
        got = [await _greedy(eng, p) for p in PROMPTS]
        stats = eng.stats()
        placed = dict(eng.deployment.placed)
    assert got == want
    streamed = {name: sum(eng.served.graphs[name].buffers[b].nbytes for b in p.plan.meta["offload"]["streamed"])
                for name, p in placed.items()}
    assert all(streamed.values())
    total = sum(c.get("streamed_bytes", 0) for c in stats["bucket_stats"].values())
    assert stats["pcie_bytes"] == total > 0
    assert stats["pcie_bytes_per_step"] == pytest.approx(total / stats["steps"])
    # each step streams its bucket's weights once (a step's first copies are queued by the step before it)
    assert min(streamed.values()) <= stats["pcie_bytes_per_step"] <= 2 * max(streamed.values())


def test_gpu_budget_needs_a_gpu_and_a_cpu_and_one_budget():
    from tessera_actors.serving.config import EngineConfig
    c = EngineConfig(devices="cuda:0,cpu?threads=12", gpu_budget="8GiB")
    assert c.devices == f"cuda:0?mem={8 << 30},cpu?threads=12" and c.planner == "offload"
    # a GPU keeps a reserve of its budget for what no graph names (a given one stays); a CPU stand-in none
    assert c.planner_options == {"reserve": 320 << 20}
    assert EngineConfig(devices="cuda:0,cpu", gpu_budget="8GiB", planner_options={"reserve": 5}).planner_options == {
        "reserve": 5}
    assert EngineConfig(devices="cpu?threads=1,cpu", gpu_budget="8GiB").planner_options == {}
    for bad, why in ((dict(devices="cpu"), "a GPU and a CPU"), (dict(devices="cuda:0,cuda:1"), "a GPU and a CPU"),
                     (dict(devices="cuda:0?mem=1GiB,cpu"), "give one"), (dict(devices="cuda:0,cpu", planner="milp"),
                                                                          "offload planner"),
                     (dict(devices="cuda:0,cpu", gpu_budget="lots"), "8GiB")):
        with pytest.raises(ValueError, match=why):
            EngineConfig(**{"gpu_budget": "8GiB", **bad})


def test_serve_gpu_budget_flag_and_pcie_metrics():
    """``tessera serve --gpu-budget``: a served model bigger than its budget;
    /metrics shows the bytes streamed host -> device and both devices' busy time."""
    import json
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    from tessera_actors.serving.testing import ServerProcess
    args = ["--model", "llama", "--size", "tiny", "--devices", "cpu?threads=1,cpu", "--gpu-budget", str(2 * budget()),
            "--planner-option", "policy=streaming", "--max-seqs", "4", "--max-model-len", "64"]
    with ServerProcess(*args) as srv:
        body = json.dumps({"model": "llama", "prompt": [1, 2, 3], "max_tokens": 6}).encode()
        req = urllib.request.Request(srv.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 6
        with urllib.request.urlopen(srv.url + "/metrics", timeout=60) as r:
            text = r.read().decode()
    got = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}
    assert got["tessera_pcie_bytes_total"].value > 0 and got["tessera_pcie_bytes_per_step"].value > 0
    busy = [s for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "tessera_device_busy_seconds_total"]
    assert len(busy) == 2 and "mem=" in busy[0].labels["device"]


async def test_a_mixture_of_experts_served_with_its_routed_experts_on_the_cpu():
    """Expert offload (llama.cpp / KTransformers ``-ot exps=CPU``) as a served
    policy: in every bucket the kernels reading a routed expert's weights run
    on the CPU, the rest is resident, and the tokens are one device's."""
    cfg = dict(CFG, model="moe")
    async with AsyncEngine(devices="cpu", **cfg) as single:
        want = [await _greedy(single, p) for p in PROMPTS]
    async with AsyncEngine(devices="cpu?threads=1,cpu", gpu_budget=MOE_BUDGET,
                           planner_options=dict(OPTIONS, policy="expert_offload"), **cfg) as eng:
        got = [await _greedy(eng, p) for p in PROMPTS]
        placed = dict(eng.deployment.placed)
        graphs = eng.served.graphs
    assert got == want
    for name, p in placed.items():
        g, plan = graphs[name], p.plan
        assert plan.name == "offload-expert_offload" and not plan.meta["offload"]["streamed"], name
        for k in g.kernels:
            names = {g.buffers[a.buffer].name for a in k.accesses if g.buffers[a.buffer].role == "weight"}
            heavy = {n for n in names if ".experts.gate_up" in n or n.endswith(".experts.down")}
            if heavy:
                assert plan.assignment[k.id] == 1, (name, k.name, heavy)   # on the CPU
            elif any(".attn.w" in n for n in names):
                assert plan.assignment[k.id] == 0, (name, k.name, names)   # resident on the budgeted device


MOE_BUDGET = 6 << 20   # room for every bucket of the tiny MoE: the policy, not the budget, moves its experts

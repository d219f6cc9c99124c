"""The serving engine on a GPU (run on the device machine: pytest -m gpu)."""
import asyncio

import pytest
import torch

from tessera_actors import AsyncEngine, SamplingParams

pytestmark = pytest.mark.gpu
CFG = dict(model="llama", size="tiny", max_model_len=64, max_seqs=8, decode_buckets=(1, 2, 4, 8),
           prefill_buckets=(4, 16), embeddings=False)
PROMPTS = [[i + 1, 2 * i + 3, 7, 11 + i] for i in range(8)]


async def _run(eng, params):
    async def one(p):
        toks = []
        async for o in eng.generate(p, params):
            toks += o.token_ids
        return toks
    return await asyncio.gather(*(one(p) for p in PROMPTS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_split_over_two_partitions_gives_the_single_gpu_tokens():
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    async with AsyncEngine(devices="cuda:0", **CFG) as one:
        ref, ref_s = await _run(one, greedy), await _run(one, seeded)
    async with AsyncEngine(devices="cuda:0,cuda:0?sms=32", **CFG) as two:
        got, got_s = await _run(two, greedy), await _run(two, seeded)
        assert min(two.stats()["placement"]["kernels_per_device"]) > 0
    assert got == ref
    assert got_s == ref_s


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_a_gpu_deployment_serves_inductor_captures_replayed_as_cuda_graphs_with_the_aten_tokens():
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    async with AsyncEngine(devices="cuda:0", capture="aten", **CFG) as aten:
        ref = await _run(aten, greedy)
    async with AsyncEngine(devices="cuda:0", **CFG) as ind:   # capture="auto": inductor on a GPU
        got = await _run(ind, greedy)
        stats = ind.stats()["bucket_stats"]
        heads = {name: g.meta.get("greedy_outputs") for name, g in ind.served.graphs.items()}
    assert got == ref
    assert heads and all(heads.values()), heads   # every bucket computes the greedy argmax in its graph
    ran = {name: s for name, s in stats.items() if s.get("replays", 0) + s.get("eager_runs", 0)}
    assert ran and all(s["capture"] == "inductor" for s in stats.values()), stats
    assert any(s["replays"] > 0 for s in ran.values()) and all(s["capture_failures"] == 0 for s in ran.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_prompt_chunks_pipelined_over_a_layer_split_give_the_single_gpu_tokens():
    """The layers planner pipelines the prompt plan over two partitions: the
    engine keeps its micro-batches of prompt-chunk steps in flight (each
    another request's), as ``tessera advise`` predicts, with one GPU's tokens."""
    from tessera_actors.planning.inflight import prompt_inflight
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    cfg = {**CFG, "prefill_rows": (1,), "prefix_caching": False}
    async with AsyncEngine(devices="cuda:0", **cfg) as one:
        ref = await _run(one, greedy)
    async with AsyncEngine(devices="cuda:0,cuda:0?sms=32", planner="layers", **cfg) as two:
        await two.wait_placed()
        got = await _run(two, greedy)
        pipelined = two.stats()["pipelined_prompt_steps"]
        plan = two.deployment.placed["prefill:4"].plan
    assert got == ref
    assert prompt_inflight(plan) >= 2 and pipelined > 0

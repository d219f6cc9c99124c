"""Where a served model's memory goes: one scratch per device for every
bucket's temporaries, a KV cache resident only as far as sequences wrote it,
one copy of the weights in the process, and ``tessera serve --model smollm2``
under 1.5 GB at its defaults (README "Start-up and memory")."""
import asyncio

import pytest

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.execution.sharing import SCRATCH_ALIGN, scratch_layout
from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.plan import build_plan
from tessera_actors.serving.launch import rss_bytes

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _k(i, *acc):
    return Kernel(i, f"k{i}", "library", tuple(Access(*a) for a in acc))


def test_the_scratch_holds_only_temporaries_that_live_within_one_segment():
    """T lives inside device 0's first segment: scratch.  U crosses to device 1
    (a transfer), W is read again by device 0's second segment, x is a step
    input and Y the output: none of them may be overwritten by another
    plan's run, so they stay the plan's own."""
    bufs = {0: Buffer(0, 64, "input"), 1: Buffer(1, 100, "temp"), 2: Buffer(2, 64, "temp"),
            3: Buffer(3, 64, "temp"), 4: Buffer(4, 64, "output"), 5: Buffer(5, 64, "temp")}
    ks = [_k(0, (0, 0, 64, "r"), (1, 0, 100, "w"), (5, 0, 64, "w")),   # device 0
          _k(1, (1, 0, 100, "r"), (2, 0, 64, "w")),                    # device 0
          _k(2, (2, 0, 64, "r"), (3, 0, 64, "w")),                     # device 1
          _k(3, (3, 0, 64, "r"), (4, 0, 32, "w")),                     # device 1
          _k(4, (5, 0, 64, "r"), (4, 32, 64, "w"))]                    # device 0, its second segment
    g = KernelGraph(ks, bufs, inputs={"x": 0}, outputs=[4])
    plan = build_plan(g, ["cpu", "cpu?threads=1"], [0, 0, 1, 1, 0])
    assert scratch_layout(g, plan, 0) == ({1: 0}, SCRATCH_ALIGN)
    assert scratch_layout(g, plan, 1) == ({3: 0}, SCRATCH_ALIGN)
    alone = build_plan(g, ["cpu"], [0] * 5)   # one device, one segment: every temporary
    assert scratch_layout(g, alone, 0) == ({1: 0, 2: SCRATCH_ALIGN, 3: 2 * SCRATCH_ALIGN, 5: 3 * SCRATCH_ALIGN},
                                           4 * SCRATCH_ALIGN)


async def test_every_bucket_of_a_device_shares_one_scratch_and_serves_the_same_tokens():
    """Twelve buckets on one device (decode, eight prompt chunks,
    embeddings): their activation buffers take about what the largest
    needs, not their sum, and the tokens are those of a deployment that
    places one prompt bucket."""
    cfg = {"model": "llama", "size": "tiny", "devices": "cpu", "max_seqs": 2, "max_model_len": 128,
           "prefix_caching": False, "decode_buckets": (1, 2), "kv_windows": ()}
    prompt = list(range(1, 40))
    async with AsyncEngine(prefill_buckets=(48,), **cfg) as one:
        want = [(await _tokens(one, prompt[:n], GREEDY)) for n in (5, 20, 39)]
    async with AsyncEngine(prefill_buckets=(8, 16, 24, 32, 40, 48, 56, 64), **cfg) as eng:
        await eng.wait_placed()
        got = await asyncio.gather(*(_tokens(eng, prompt[:n], GREEDY) for n in (5, 20, 39)))
        mem = eng.stats()["memory"]
        own = [sum(b.nbytes for b in g.buffers.values() if b.role not in ("weight", "state"))
               for g in eng.served.graphs.values()]
    assert got == want
    assert len(own) == 12 and mem["activation_bytes"] < max(own) + sum(own) / 4
    assert mem["device_bytes"] >= mem["weight_bytes"] + mem["kv_cache_bytes"] + mem["activation_bytes"]


async def test_the_kv_cache_is_resident_only_where_sequences_wrote_it():
    """A 256 MiB KV cache (16 rows of 32768 positions) of the tiny model:
    the server's resident memory grows by a small part of it until rows
    fill, and a served request's positions are what it adds."""
    cfg = {"model": "llama", "size": "tiny", "devices": "cpu", "max_seqs": 16, "max_model_len": 32768,
           "decode_buckets": (16,), "prefill_buckets": (16,), "kv_windows": (), "embeddings": False}
    before = rss_bytes()
    async with AsyncEngine(**cfg) as eng:
        await eng.wait_placed()
        toks = await _tokens(eng, list(range(1, 12)), GREEDY)
        grown = rss_bytes() - before
        kv = eng.stats()["memory"]["kv_cache_bytes"]
    assert kv == 256 << 20 and len(toks) == 6
    assert grown < kv // 4, (grown, kv)


@pytest.mark.slow
async def test_tessera_serve_smollm2_stays_under_1_5_gb_at_its_defaults():
    """``tessera serve --model smollm2`` (SmolLM2-135M) as a user starts it:
    its weights are the GGUF's, quantized (91 MiB, not float32's 513), and
    its RSS stays under 1.5 GB from its first /health ok, through every
    bucket placed and a served request; /metrics reports both; SIGINT ends
    it at once."""
    aiohttp = pytest.importorskip("aiohttp")
    from tessera_actors.serving.launch import LaunchedServer
    server = LaunchedServer("--model smollm2")
    try:
        async with aiohttp.ClientSession() as session:
            url = await server.start(session, timeout=600)
            body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] >= 1
            async with session.get(url + "/metrics") as r:
                text = await r.text()
    finally:
        report = server.stop()
    def gauge(name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))
    rss = report.rss
    assert report.exit_code == 0 and report.exit_s < 5.0, report
    assert 0 < gauge("tessera_weight_bytes") < 100 * 2**20
    assert 0 < gauge("tessera_process_resident_bytes") < 1.5e9
    assert max(rss["ready"], rss["placed"], rss["after_trace"]) < 1.5e9, rss


async def _tokens(eng, prompt, params):
    toks = []
    async for out in eng.generate(prompt, params):
        toks += out.token_ids
    return toks

"""The serving engine end to end, on CPU devices: continuous batching through
the actor system (in-process devices and node processes), seeded sampling,
abort, chunked prefill, busy queue, bad requests and a killed node."""
import asyncio
import math
import os
import signal

import pytest

from tessera_actors import AsyncEngine, SamplingParams
from tessera_actors.serving import EngineBusy, InvalidRequest

SMALL = dict(model="smollm2", size="tiny", max_model_len=512, decode_buckets=(1, 2, 4, 8, 16),
             prefill_buckets=(16, 64))
NODES = ["cpu?threads=1", "cpu?threads=1"]
PROMPTS = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(16)]


async def _tokens(eng, prompt, params, rid=None):
    toks, text, last = [], [], None
    async for out in eng.generate(prompt, params, request_id=rid):
        toks += out.token_ids
        text.append(out.text)
        last = out
    return toks, "".join(text), last


async def test_sixteen_concurrent_requests_on_two_node_processes_match_each_alone_and_one_device():
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    async with AsyncEngine(devices="cpu", max_seqs=16, **SMALL) as single:
        reference = [(await _tokens(single, p, greedy))[0] for p in PROMPTS]
    async with AsyncEngine(nodes=NODES, max_seqs=16, **SMALL) as eng:
        alone = [(await _tokens(eng, p, greedy))[0] for p in PROMPTS[:4]]
        together = await asyncio.gather(*(_tokens(eng, p, greedy) for p in PROMPTS))
        stats = eng.stats()
    assert [t for t, _, _ in together] == reference
    assert alone == reference[:4]
    assert all(last.finish_reason == "length" and last.usage.completion_tokens == 16 for _, _, last in together)
    assert stats["placement"]["devices"] == NODES and min(stats["placement"]["kernels_per_device"]) > 0
    assert stats["slots_in_use"] == 0 and stats["generated_tokens"] == 16 * 20
    assert [d["name"] for d in stats["devices"]] == NODES and all(0 < d["busy_fraction"] <= 1
                                                                     for d in stats["devices"])


async def test_concurrent_prompts_are_prefilled_several_a_step_with_the_tokens_of_each_alone():
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    async with AsyncEngine(devices="cpu", max_seqs=16, prefill_rows=(1, 4, 8), max_batched_tokens=512,
                           prefix_caching=False, **SMALL) as eng:
        await eng.wait_placed()
        alone = [(await _tokens(eng, p, greedy))[0] for p in PROMPTS]
        before = eng.stats()["prefill_steps"]
        together = await asyncio.gather(*(_tokens(eng, p, greedy) for p in PROMPTS))
        steps = eng.stats()["prefill_steps"] - before
        batched = [b for b in eng.step_time if b.startswith("prefill:") and "x" in b]
    assert [t for t, _, _ in together] == alone
    assert steps <= 4 and batched   # 16 prompts of one chunk each, up to 8 a step
    assert all(int(b.split(":")[1].split("x")[0]) * int(b.split("x")[1].split("~")[0]) <= 512 for b in batched)


async def test_a_repeated_prompt_reuses_its_kv_row_and_a_shared_prefix_gives_a_fresh_engines_tokens():
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = list(range(100, 390))
    branch = prompt[:200] + [7, 8, 9]
    async with AsyncEngine(devices="cpu", max_seqs=4, **SMALL) as fresh:
        want = (await _tokens(fresh, branch, greedy))[0]
    async with AsyncEngine(devices="cpu", max_seqs=4, **SMALL) as eng:
        first = (await _tokens(eng, prompt, greedy))[0]
        before = eng.stats()["prefill_steps"]
        again = (await _tokens(eng, prompt, greedy))[0]
        steps = eng.stats()["prefill_steps"] - before
        got = (await _tokens(eng, branch, greedy))[0]
        stats = eng.stats()
    assert again == first and steps == 1   # only its last token is fed: its logits give the first token
    assert got == want
    assert stats["prefix_hits"] == 2 and stats["prefix_tokens"] == 289 + 200


@pytest.fixture
async def engine():
    async with AsyncEngine(devices="cpu,cpu", max_seqs=4, decode_buckets=(1, 2, 4), **{
            k: v for k, v in SMALL.items() if k != "decode_buckets"}) as eng:
        yield eng


async def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = (await _tokens(engine, "The weather today is", params))[0]
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in (1, 2, 3)]
    mixed = await asyncio.gather(_tokens(engine, "The weather today is", params),
                                 *(_tokens(engine, f"Other prompt {i}", p) for i, p in enumerate(others)))
    assert mixed[0][0] == alone
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=99)
    assert (await _tokens(engine, "The weather today is", other_seed))[0] != alone


async def test_abort_and_early_exit_free_the_slot_for_a_waiting_request():
    async with AsyncEngine(devices="cpu", max_seqs=1, decode_buckets=(1,), max_queue=4,
                           **{k: v for k, v in SMALL.items() if k != "decode_buckets"}) as eng:
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        first = eng.generate("A long story:", long, request_id="a")
        assert (await first.__anext__()).finish_reason is None
        waiting = asyncio.ensure_future(_tokens(eng, "short one", SamplingParams(max_tokens=3), "b"))
        await asyncio.sleep(0)   # let it queue (no timing involved: it needs the only slot)
        assert eng.stats()["queue_depth"] == 1
        assert await eng.abort("a")
        rest = [o async for o in first]
        assert rest[-1].finish_reason == "abort"
        toks, _, last = await asyncio.wait_for(waiting, 60)
        assert last.finish_reason == "length" and len(toks) == 3
        # leaving the iteration early aborts too
        gen = eng.generate("Another long story:", long, request_id="c")
        await gen.__anext__()
        await gen.aclose()
        # the only slot is free again once the step that carried its row lands: the next request is served
        assert (await _tokens(eng, "after", SamplingParams(max_tokens=2)))[2].finish_reason == "length"
        assert eng.stats()["slots_in_use"] == 0


async def test_a_300_token_prompt_is_prefilled_in_chunks_not_token_by_token(engine):
    ids = engine.tokenizer.encode(" ".join(["word"] * 400))[:300]
    assert len(ids) == 300
    before = engine.stats()["prefill_steps"]
    toks, _, last = await _tokens(engine, ids, SamplingParams(max_tokens=2))
    assert engine.stats()["prefill_steps"] - before <= math.ceil(300 / 64) + 1
    assert last.usage.prompt_tokens == 300


async def test_bad_requests_are_refused_before_any_work_and_a_full_queue_is_busy(engine):
    steps = engine.stats()["steps"]
    with pytest.raises(InvalidRequest, match="context"):
        await _tokens(engine, [1] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequest, match="token ids"):
        await _tokens(engine, [10 ** 9], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest):
        await _tokens(engine, [{"role": "user"}], SamplingParams())
    with pytest.raises(InvalidRequest):
        await _tokens(engine, "hi", SamplingParams(temperature=-1))
    assert engine.stats()["steps"] == steps
    engine.cfg.max_queue = 0
    with pytest.raises(EngineBusy):
        gens = [engine.generate("x", SamplingParams(max_tokens=50, ignore_eos=True)) for _ in range(6)]
        await asyncio.gather(*(g.__anext__() for g in gens))
    for g in gens:
        await g.aclose()


async def test_bad_input_is_an_invalid_request_or_served_and_the_engine_serves_on(engine):
    """A top_p that rounds to 0 keeps the most likely token (the greedy
    tokens); a seed or top_k past int64 (what node deployments carry) and a
    lone surrogate in the prompt are ``InvalidRequest`` naming the field."""
    prompt = "Once upon a time"
    greedy = (await _tokens(engine, prompt, SamplingParams(max_tokens=6, ignore_eos=True)))[0]
    tiny = SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-300, seed=3, ignore_eos=True)
    assert (await _tokens(engine, prompt, tiny))[0] == greedy
    for params, field in [(SamplingParams(seed=2 ** 64), "seed"), (SamplingParams(top_k=2 ** 64), "top_k")]:
        with pytest.raises(InvalidRequest) as e:
            await _tokens(engine, prompt, params)
        assert e.value.param == field
    for bad, field in [("a\ud800b", "prompt"), ([{"role": "user", "content": "x\udfffy"}], "messages")]:
        with pytest.raises(InvalidRequest, match="lone surrogate at character 1") as e:
            await _tokens(engine, bad, SamplingParams(max_tokens=2))
        assert e.value.param == field
        with pytest.raises(InvalidRequest, match="lone surrogate"):
            engine.count_tokens(bad)
    assert (await _tokens(engine, prompt, SamplingParams(max_tokens=6, ignore_eos=True)))[0] == greedy


async def test_chat_messages_use_the_models_template_and_stop_strings_end_the_reply(engine):
    chat = [{"role": "user", "content": "Say hello"}]
    n = engine.count_tokens(chat)
    toks, text, last = await _tokens(engine, chat, SamplingParams(max_tokens=8))
    assert last.usage.prompt_tokens == n > 10
    full = (await _tokens(engine, "Once upon a time", SamplingParams(max_tokens=12, ignore_eos=True)))[1]
    cut = full[3:8]
    if cut.strip():
        stopped = await _tokens(engine, "Once upon a time", SamplingParams(max_tokens=12, stop=[cut]))
        assert stopped[2].finish_reason == "stop" and stopped[1] == full[:full.index(cut)]


@pytest.mark.parametrize("detector", ["exit", "refused"])
async def test_a_node_killed_mid_stream_loses_no_request_and_changes_no_token(detector):
    """``exit``: the engine watches the node processes it started;
    ``refused``: only pings, with a ping timeout far beyond the test's
    patience - the loss is found because the dead node's port refuses."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:8]
    async with AsyncEngine(devices="cpu", max_seqs=8, **SMALL) as single:
        reference = [(await _tokens(single, p, greedy))[0] for p in prompts]
    detect = {} if detector == "exit" else {"watch_processes": False, "lost_after_s": 900.0}
    async with AsyncEngine(nodes=NODES, max_seqs=8, **SMALL, **detect) as eng:
        started = asyncio.Event()
        counts = [0] * len(prompts)

        async def stream(i):
            toks = []
            async for out in eng.generate(prompts[i], greedy):
                toks += out.token_ids
                counts[i] = len(toks)
                if min(counts) >= 4:
                    started.set()
            return toks
        tasks = [asyncio.ensure_future(stream(i)) for i in range(len(prompts))]
        await asyncio.wait_for(started.wait(), 120)
        victim = eng.deployment.cluster.nodes[1].proc
        os.kill(victim.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        stats = eng.stats()
    assert results == reference
    assert stats["recoveries"] == 1 and stats["generation"] == 1
    assert stats["placement"]["devices"] == [NODES[0]]


async def test_served_tokens_are_the_eager_pytorch_models_tokens():
    import torch

    from tessera_actors import models
    from tessera_actors.testing import greedy_decode
    prompt, n = [5, 6, 7, 8, 9], 8
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0)
    with torch.no_grad():
        want, _ = await greedy_decode(lambda inputs: m(**inputs), prompt, n, prefill=True)
    async with AsyncEngine(model="llama", size="tiny", devices="cpu,cpu", max_seqs=2, max_model_len=64,
                           prefill_buckets=(4, 16)) as eng:
        got, _, last = await _tokens(eng, prompt, SamplingParams(max_tokens=n))
        assert len(eng.stats()["placement"]["kernels_per_device"]) == 2
        ops = {k.name for g in eng.deployment.served.graphs.values() for k in g.kernels}
    assert got == want and last.finish_reason == "length"
    # attention is one kernel (the one eager PyTorch runs on this device), not SDPA's math decomposition
    assert "scaled_dot_product_attention" in ops and "_safe_softmax" not in ops


async def test_a_trace_of_served_steps_is_valid_trace_event_json_with_spans_per_device(tmp_path):
    import json
    async with AsyncEngine(nodes=NODES, max_seqs=2, trace_dir=str(tmp_path), **SMALL) as eng:
        await asyncio.gather(*(_tokens(eng, p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in PROMPTS[:2]))
        steps = eng.stats()["steps"]
        path = eng.write_trace()
    events = json.loads(open(path).read())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X"]
    engine_spans = [e for e in spans if tracks[e["tid"]] == "engine"]
    assert steps >= 20 and len(engine_spans) == steps
    assert any(e["name"].startswith("prefill:") for e in engine_spans)
    for d, spec in enumerate(NODES):
        mine = [e for e in spans if tracks[e["tid"]] == f"device {d}: {spec}"]
        assert len(mine) >= steps and all(e["dur"] >= 0 and e["ts"] > 0 for e in mine)
    assert any(e["name"].startswith("recv") for e in spans) and any(e["name"].startswith("sample") for e in spans)


async def test_attention_windows_give_the_tokens_of_the_whole_cache():
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    cfg = dict(model="llama", size="tiny", devices="cpu,cpu", max_seqs=4, max_model_len=128, prefill_buckets=(8, 16))
    prompts = [[i + 1] * (5 + 7 * i) for i in range(4)]      # prompts of 5..26 tokens, outputs cross windows
    async with AsyncEngine(kv_windows=(), **cfg) as whole:
        want = await asyncio.gather(*(_tokens(whole, p, greedy) for p in prompts))
    async with AsyncEngine(kv_windows=(16, 32, 64), **cfg) as windowed:
        await windowed.wait_placed()   # the windowed buckets themselves, not their stand-ins
        got = await asyncio.gather(*(_tokens(windowed, p, greedy) for p in prompts))
        used = set(windowed.stats()["step_s"])
    assert [t for t, _, _ in got] == [t for t, _, _ in want]
    assert {"decode:4@0~16", "decode:4@0~32", "decode:4@0~64"} & used and any(b.endswith("~16") and
                                                                            b.startswith("prefill") for b in used)


async def test_a_transformers_llama_with_smollm2s_real_weights_is_served_split_like_our_own():
    params = SamplingParams(max_tokens=12)
    chat = [{"role": "user", "content": "Name a color."}]
    cfg = dict(devices="cpu,cpu", max_seqs=2, max_model_len=256, prefill_buckets=(16, 64), kv_windows=())
    async with AsyncEngine(model="smollm2", size="tiny", **cfg) as ours:      # our Llama, first 2 layers
        want = await _tokens(ours, chat, params)
    async with AsyncEngine(model="hf:smollm2", overrides={"num_hidden_layers": 2}, **cfg) as theirs:
        got = await _tokens(theirs, chat, params)
        kernels = theirs.stats()["placement"]["kernels_per_device"]
    assert min(kernels) > 0
    assert got[0] == want[0] and got[1] == want[1]


async def test_a_device_memory_budget_covers_the_shared_weights_and_kv_cache():
    cfg = dict(model="llama", size="tiny", max_seqs=4, max_model_len=64, prefill_buckets=(8,))
    async with AsyncEngine(devices="cpu", **cfg) as eng:
        held = sum(b.nbytes for b in eng.served.graphs["decode:4@0"].buffers.values() if b.role in ("weight", "state"))
    with pytest.raises(Exception, match="budget"):
        async with AsyncEngine(devices=f"cpu?mem={held // 2}", **cfg):
            pass
    budget = int(held * 0.7)   # neither device holds the whole model: the plan must split it
    async with AsyncEngine(devices=f"cpu?mem={budget},cpu?mem={budget}", planner="milp", **cfg) as split:
        toks, _, _ = await _tokens(split, [1, 2, 3], SamplingParams(max_tokens=3))
        assert len(toks) == 3 and min(split.stats()["placement"]["kernels_per_device"]) > 0


async def test_the_detector_tells_a_refused_port_from_a_listening_one():
    from tessera_actors.serving.detector import refused as _refused
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    assert not await _refused(f"tcp://127.0.0.1:{port}")
    server.close()
    await server.wait_closed()
    assert await _refused(f"tcp://127.0.0.1:{port}")
    assert not await _refused("ipc:///tmp/no-such-socket")


async def test_the_engine_serves_once_its_largest_buckets_are_placed_the_rest_follow_in_the_background():
    """In-process devices: the engine serves once the reference decode bucket
    and the longest prompt chunk are captured and placed; a request that
    arrives before its own buckets are placed runs padded in those, with the
    tokens it gets once every bucket is in place; /health's progress counts
    the placements."""
    cfg = dict(model="llama", size="tiny", devices="cpu", max_seqs=2, max_model_len=128, prefix_caching=False,
               decode_buckets=(1, 2), prefill_buckets=(8, 16, 24, 32, 48))
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = list(range(1, 21))                     # 20 tokens: a 24-token chunk once it is placed
    seen = []
    eng = AsyncEngine(**cfg)
    assert eng.health()["status"] != "ok"
    await eng.start(lambda phase, done, total: seen.append((phase, done, total)))
    try:
        assert eng.deployment.core_buckets() == {"decode:2@0", "prefill:48"}
        assert seen[0] == ("loading", 0, 1) and seen[1][:2] == ("placing", 1)
        assert eng.health()["status"] == "ok"
        early, _, _ = await _tokens(eng, prompt, greedy)
        await eng.wait_placed()
        h = eng.health()
        assert h["buckets_placed"] == h["buckets"] == len(eng.served.buckets) == len(eng.served.graphs)
        assert seen[-1] == ("placing", h["buckets"], h["buckets"])
        late, _, _ = await _tokens(eng, prompt, greedy)
        assert "prefill:24" in eng.stats()["step_s"]
    finally:
        await eng.stop()
    assert early == late and len(late) == 6
    assert eng.health()["status"] == "unhealthy"


async def test_decode_steps_sent_ahead_of_their_tokens_stream_what_waiting_for_them_does():
    """One device reads input_ids and samples: with lookahead a decode step
    is sent before the previous one's tokens are back, the device feeding
    them; rows that end meanwhile (a stop string, max_tokens) lose only the
    throw-away token, never a streamed one."""
    cfg = dict(model="smollm2", size="tiny", max_model_len=256, devices="cpu", max_seqs=4,
               decode_buckets=(1, 2, 4), prefill_buckets=(16, 64))
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(4)]
    prompts = [f"Story {i}: once upon a time" for i in range(4)]
    runs = {}
    for ahead in (0, 1):
        async with AsyncEngine(lookahead=ahead, **cfg) as eng:
            free = await asyncio.gather(*(_tokens(eng, p, q) for p, q in zip(prompts, params)))
            cut = free[3][1][10:16]
            assert cut.strip()
            stopped = await asyncio.gather(
                _tokens(eng, prompts[3], SamplingParams(max_tokens=26, temperature=0.0, stop=[cut])),
                _tokens(eng, prompts[2], params[2]))
            runs[ahead] = (free, stopped, eng.stats())
    (free0, stop0, st0), (free1, stop1, st1) = runs[0], runs[1]
    assert [(t, x) for t, x, _ in free1] == [(t, x) for t, x, _ in free0]
    assert [(t, x, o.finish_reason) for t, x, o in stop1] == [(t, x, o.finish_reason) for t, x, o in stop0]
    assert stop1[0][2].finish_reason == "stop" and stop1[0][1] == free1[3][1][:free1[3][1].index(cut)]
    assert st0["lookahead_steps"] == 0 and st1["lookahead_steps"] > 20
    assert st1["discarded_tokens"] >= 1 and st1["slots_in_use"] == 0   # the stop string's row had a step ahead
    assert st1["generated_tokens"] == st0["generated_tokens"]


async def test_a_split_plan_hands_its_sampled_tokens_to_the_device_that_embeds_them():
    """cpu,cpu: one device reads input_ids, the other samples. The sampler
    hands each step's tokens to the reader thread to thread, so decode steps
    go ahead of their tokens as on one device, and the streams are the
    single-device engine's (fp32, one thread each: bit for bit)."""
    cfg = dict(model="llama", size="tiny", max_model_len=128, max_seqs=4, decode_buckets=(1, 2, 4),
               prefill_buckets=(8, 16), mode="latency")
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(4)]
    prompts = [[i + 1] * (3 + 2 * i) for i in range(4)]
    runs = {}
    for devices, ahead in (("cpu", 0), ("cpu,cpu", 1)):
        async with AsyncEngine(devices=devices, lookahead=ahead, **cfg) as eng:
            got = await asyncio.gather(*(_tokens(eng, p, q) for p, q in zip(prompts, params)))
            placed = next(p for n, p in sorted(eng.deployment.placed.items()) if n.startswith("decode:4"))
            runs[devices] = (got, eng.stats(), placed)
    (one, st1, _), (split, st2, placed) = runs["cpu"], runs["cpu,cpu"]
    graph_ids = [d for d, bufs in enumerate(placed.plan.inputs) if bufs]
    samplers = {dev for _, _, _, dev in placed.plan.outputs}
    assert len(placed.plan.devices) == 2 and placed.feeds is not None
    assert samplers and placed.feeds not in samplers and placed.feeds in graph_ids   # reads ids here, samples there
    assert [(t, x) for t, x, _ in split] == [(t, x) for t, x, _ in one]
    assert st1["lookahead_steps"] == 0 and st2["lookahead_steps"] >= 10
    unrun = [s for s in st2["bucket_stats"].values() if not s["replays"] + s["eager_runs"]]
    assert unrun and all(s["capture_failures"] == 0 for s in unrun)   # every bucket reports its counts


async def test_on_a_split_a_step_whose_tokens_were_never_sampled_fails_at_once_by_name():
    """cpu,cpu: the device that samples fails a step (a record naming a
    token outside the vocabulary); the next step, whose rows continue it,
    fails on the device that embeds them, saying which tokens it missed -
    at once, not after a receive timeout - and the rows given again go on."""
    from tessera_actors.runtime.messages import SampleRow, StepRows
    from tessera_actors.serving.deployment import StepFailed
    async with AsyncEngine(model="llama", size="tiny", devices="cpu,cpu", max_seqs=2, max_model_len=64,
                           decode_buckets=(2,), prefill_buckets=(8,)) as eng:
        dep = eng.deployment
        bucket = dep.reference_bucket()
        rows = [SampleRow(r, position=0, token=t) for r, t in enumerate((5, 9))]
        first = dep.reserve(bucket)
        await dep.step(bucket, {}, [], ["a", "b"], first, decode=StepRows(-1, [0, 1], rows, 63))
        bad = dep.reserve(bucket)
        with pytest.raises(StepFailed, match="token ids must be in"):
            await dep.step(bucket, {}, [], ["a", "b"], bad,
                           decode=StepRows(first, pad=63, records=[[0, {"bias": [[10 ** 9, 1.0]]}]]))
        with pytest.raises(StepFailed, match=f"the tokens of step {bad} were not sampled: ValueError"):
            await asyncio.wait_for(dep.step(bucket, {}, [], ["a", "b"], dep.reserve(bucket),
                                            decode=StepRows(bad, pad=63)), timeout=60)
        again = await dep.step(bucket, {}, [], ["a", "b"], dep.reserve(bucket), decode=StepRows(-1, [0, 1], rows, 63))
    assert len(again.tokens) == 2


async def test_a_decode_step_continuing_a_step_its_device_did_not_run_fails_by_name():
    import torch

    from tessera_actors.runtime.messages import SampleRow, StepRows
    from tessera_actors.serving.deployment import StepFailed
    async with AsyncEngine(model="llama", size="tiny", devices="cpu", max_seqs=2, max_model_len=64,
                           decode_buckets=(2,), prefill_buckets=(8,)) as eng:
        dep = eng.deployment
        bucket = dep.reference_bucket()
        inputs = {"input_ids": torch.tensor([[5], [9]]), "positions": torch.tensor([0, 0])}
        want = await dep.step(bucket, inputs, [SampleRow(r) for r in range(2)], ["a", "b"])
        first = dep.reserve(bucket)
        rows = [SampleRow(r, position=0, token=t) for r, t in enumerate((5, 9))]
        full = await dep.step(bucket, {}, [], ["a", "b"], first, decode=StepRows(-1, [0, 1], rows, 63))
        assert full.tokens == want.tokens   # the same inputs as rows kept on the device
        with pytest.raises(StepFailed, match=f"continue step {first + 7} of the plan, but the last step of it on "
                                             f"this device is {first}"):
            await dep.step(bucket, {}, [], ["a", "b"], dep.reserve(bucket), decode=StepRows(first + 7, pad=63))
        again = await dep.step(bucket, {}, [], ["b", "a"], dep.reserve(bucket), decode=StepRows(first, [1, 0], pad=63))
        assert len(again.tokens) == 2


async def test_an_in_process_placement_hands_the_devices_the_graph_and_plan_themselves():
    """Nothing is encoded or decoded between the engine, the scheduler and
    device actors of its process: every device holds the engine's own graph
    of the bucket and the plan the engine holds."""
    async with AsyncEngine(model="llama", size="tiny", devices="cpu,cpu", max_seqs=2, max_model_len=64,
                           decode_buckets=(2,), prefill_buckets=(8,)) as eng:
        await eng.wait_placed()
        for name, placed in eng.deployment.placed.items():
            held = [ref._actor.plans[placed.plan_id] for ref in placed.refs]
            assert all(h.graph is eng.served.graphs[name] and h.plan is placed.plan for h in held)
        got, _, _ = await _tokens(eng, [3, 4, 5], SamplingParams(max_tokens=4))
    assert len(got) == 4


async def test_a_plan_switch_under_load_happens_while_decode_steps_go_ahead():
    """auto mode on one device (decode steps are sent ahead there): once the
    monitor asks for the throughput plan, the steps in flight drain and the
    rows split into groups; the tokens are those of the latency plan."""
    cfg = dict(model="llama", size="tiny", devices="cpu", max_seqs=4, max_model_len=128, decode_buckets=(1, 2, 4),
               prefill_buckets=(8, 16), groups=2)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[i + 1] * (3 + i) for i in range(4)]
    async with AsyncEngine(mode="latency", **cfg) as fixed:
        want = await asyncio.gather(*(_tokens(fixed, p, greedy) for p in prompts))
    async with AsyncEngine(mode="auto", **cfg) as eng:
        await eng.wait_placed()   # the groups' buckets too (their placement would outlast the monitor's window)
        gens = [eng.generate(p, greedy) for p in prompts]
        got = [list((await g.__anext__()).token_ids) for g in gens]   # every row decoding, steps going ahead
        assert eng.plan_in_use() == "latency"
        for _ in range(8):   # finished requests that queued for 10x their execution time: the system is loaded
            eng.monitor.record(1.0, 0.1)

        async def take(i: int, n: int) -> None:
            while len(got[i]) < n:
                got[i] += (await gens[i].__anext__()).token_ids
        await asyncio.gather(*(take(i, 20) for i in range(4)))
        assert eng.plan_in_use() == "throughput" and eng.stats()["groups"] == 2   # switched mid-stream
        await asyncio.gather(*(take(i, 40) for i in range(4)))
        stats = eng.stats()
    assert stats["plan_switches"] >= 1 and stats["lookahead_steps"] > 0
    assert got == [t for t, _, _ in want]


async def test_the_kv_cache_is_sized_from_its_memory_budget():
    """A budget for 2.5 rows gives 2 KV slots (not the 4 asked for): a third
    request waits for a slot, every request is served, and the memory report
    says what the cache holds."""
    import torch

    from tessera_actors import models
    from tessera_actors.serving.memory import state_bytes
    meta = models.get("llama", "tiny", dtype=torch.float32, device="meta", max_batch=4, max_seq=64)
    row = state_bytes(meta) // 4
    async with AsyncEngine(model="llama", size="tiny", devices="cpu", max_seqs=4, max_model_len=64,
                           prefill_buckets=(8,), kv_cache_memory=int(2.5 * row)) as eng:
        assert eng.stats()["slots_total"] == 2 and eng.cfg.max_seqs == 2
        got = await asyncio.gather(*(_tokens(eng, [i + 1] * 5, SamplingParams(max_tokens=6)) for i in range(3)))
        mem = eng.stats()["memory"]
    assert all(len(t) == 6 for t, _, _ in got)
    assert mem["kv_cache_bytes"] == 2 * row and mem["kv_rows"] == 2 and mem["kv_cache_budget_bytes"] == int(2.5 * row)
    assert mem["rss_bytes"] > mem["weight_bytes"] > 0

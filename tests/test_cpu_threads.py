"""``tessera serve``'s default CPU deployment (issue #33): the intra-op
thread count chosen from measured probe times, the line it prints, what
``engine.stats()`` reports, and explicit device flags left as they are.
The choice is tested on given times (no timing asserted); the probe itself
runs once, for its shape only."""
from __future__ import annotations

import argparse

import pytest

from tessera_actors.devices import DeviceSpecError
from tessera_actors.serving.cpu_threads import ThreadTimes, candidates, choose_threads, measure_threads
from tessera_actors.serving.flags import (add_serve_arguments, chosen_deployment, default_deployment, devices_line,
                                          engine_kwargs)


def _flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_candidates_leave_one_core_to_the_serving_loop():
    assert candidates(1) == (1,)
    assert candidates(2) == (1,)
    assert candidates(4) == (3, 2, 1)
    assert candidates(16) == (15, 8, 1)


def test_the_fewest_threads_within_the_margin_of_the_fastest_are_chosen():
    # one thread faster at batch 1, two barely faster at 16 rows: one
    close = [ThreadTimes(2, 25.5, 81.2), ThreadTimes(1, 15.5, 88.2)]
    assert choose_threads(close).threads == 1
    # two threads faster at both batches by more than the margin: two
    assert choose_threads([ThreadTimes(2, 10.0, 40.0), ThreadTimes(1, 15.0, 80.0)]).threads == 2
    # a 16-core machine with 8 physical cores: half the threads within 10% of 15
    many = [ThreadTimes(15, 10.0, 20.0), ThreadTimes(8, 10.4, 21.0), ThreadTimes(1, 20.0, 200.0)]
    assert choose_threads(many).threads == 8
    assert choose_threads(many, margin=0.0).threads == 15
    choice = choose_threads(close)
    assert "2: 25.5/81.2, 1: 15.5/88.2" in choice.why and choice.times == tuple(close)
    with pytest.raises(ValueError, match="no measured"):
        choose_threads([])


def test_two_cores_decode_on_one_thread_and_prefill_on_both_without_a_probe():
    def measure(counts):
        raise AssertionError("nothing to choose from: no probe")
    chosen = default_deployment(cores=2, gpus=0, measure=measure)
    assert chosen.devices == "cpu?threads=1&prefill_threads=2"
    assert devices_line(chosen) == ("tessera serve: devices cpu?threads=1&prefill_threads=2 (2 CPU cores, no GPU: one "
                                    "device, 1 intra-op thread (every core but one, left to the serving loop), prompt "
                                    "chunks on all 2; a CPU split only where asked for: --devices cpu,cpu)")
    assert default_deployment(cores=1, gpus=0, measure=measure).devices == "cpu?threads=1"   # nothing more to give


def test_more_cores_serve_at_the_count_the_probe_chose_and_say_why():
    asked = []

    def measure(counts):
        asked.append(counts)
        return [ThreadTimes(3, 30.0, 40.0), ThreadTimes(2, 20.0, 50.0), ThreadTimes(1, 15.5, 120.0)]
    chosen = default_deployment(cores=4, gpus=0, measure=measure)
    assert asked == [(3, 2, 1)]
    assert chosen.devices == "cpu?threads=2&prefill_threads=4"
    line = devices_line(chosen)
    assert line.startswith("tessera serve: devices cpu?threads=2&prefill_threads=4 (4 CPU cores, no GPU: one device, "
                           "2 intra-op threads, prompt chunks on all 4;")
    assert "3: 30.0/40.0, 2: 20.0/50.0, 1: 15.5/120.0" in line and "--devices cpu,cpu" in line and "\n" not in line


def test_explicit_devices_and_nodes_are_never_overridden():
    for argv, key, value in ((["--devices", "cpu"], "devices", "cpu"),
                             (["--devices", "cpu,cpu?threads=2"], "devices", "cpu,cpu?threads=2"),
                             (["--nodes", "cpu;cpu?threads=1"], "nodes", ["cpu", "cpu?threads=1"])):
        a = _flags(*argv)
        assert chosen_deployment(a) is None
        kw = engine_kwargs(a)
        assert kw[key] == value and "devices_chosen" not in kw


async def test_the_chosen_deployment_reaches_the_engine_and_its_stats():
    from tessera_actors import AsyncEngine
    chosen = default_deployment(cores=2, gpus=0)
    kw = engine_kwargs(_flags("--size", "tiny"), None, chosen)
    assert kw["devices"] == "cpu?threads=1&prefill_threads=2" and kw["devices_chosen"] == chosen.why
    eng = AsyncEngine(**kw)   # not started: stats() reports the configuration
    assert eng.stats()["devices_chosen"] == chosen.why


def test_the_probe_times_every_count_it_is_given():
    times = measure_threads((2, 1), budget_s=0.0, reps=1)   # one round
    assert [t.threads for t in times] == [2, 1]
    assert all(t.batch1_ms > 0 and t.batch16_ms > 0 for t in times)


def test_a_machine_with_a_gpu_serves_on_it_by_default():
    one, two = default_deployment(cores=16, gpus=1), default_deployment(cores=16, gpus=2)
    assert one.devices == two.devices == "cuda:0"
    assert "1 GPU seen" in one.why and "cuda:0,cuda:1" in two.why


def test_prompt_chunks_run_at_prefill_threads_and_decode_steps_at_threads():
    from tessera_actors.devices import DeviceSpec
    from tessera_actors.execution.backends.cpu import INITIAL_THREADS, PREFILL_TOKENS, step_threads
    spec = DeviceSpec.parse("cpu?threads=1&prefill_threads=2")
    assert spec.name == "cpu?threads=1&prefill_threads=2" and DeviceSpec.parse(spec.name) == spec
    assert step_threads(spec, PREFILL_TOKENS) == 2 and step_threads(spec, 16) == 1
    assert step_threads(DeviceSpec.parse("cpu?prefill_threads=3"), 1) == INITIAL_THREADS
    assert step_threads(DeviceSpec.parse("cpu?threads=2"), 512) is None       # no per-step change asked
    for bad in ("cuda:0?prefill_threads=2", "cpu?prefill_threads=0"):
        with pytest.raises(DeviceSpecError, match="prefill_threads"):
            DeviceSpec.parse(bad)


async def test_a_device_with_prefill_threads_serves_the_same_tokens_and_says_its_counts():
    from tessera_actors import AsyncEngine, SamplingParams
    from tessera_actors.runtime.messages import GetStats
    cfg = dict(model="llama", size="tiny", max_seqs=4, max_model_len=96, decode_buckets=(1, 4),
               prefill_buckets=(8, 32), kv_windows=(), embeddings=False)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 70)]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)

    async def run(eng):
        out = []
        for p in prompts:
            toks = []
            async for o in eng.generate(p, greedy):
                toks += o.token_ids
            out.append(toks)
        return out
    async with AsyncEngine(devices="cpu?threads=1", **cfg) as plain:
        want = await run(plain)
    async with AsyncEngine(devices="cpu?threads=1&prefill_threads=2", **cfg) as eng:
        await eng.wait_placed()
        got = await run(eng)
        stats = (await eng.deployment.system.ref("device0").ask(GetStats())).values
    assert got == want
    threads = {p.partition(":")[2]: t for p, t in stats["step_threads"].items()}   # plan "g0:<bucket>"
    assert {t for b, t in threads.items() if b.startswith("prefill:32")} == {2}
    assert {t for b, t in threads.items() if b.startswith(("decode", "prefill:8"))} == {1}

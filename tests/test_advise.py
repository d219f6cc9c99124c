"""``tessera advise`` on small graphs: the --json format, the policies that
apply, and the budget recommendation."""
import gzip
import json

import msgpack
import pytest

from tessera_actors import cli
from tessera_actors.planning import advise


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """Tiny Llama graphs (meta-device capture) named as advise expects."""
    from tessera_actors.capture.aten import capture_module
    from tessera_actors.capture.cli import build_model
    d = tmp_path_factory.mktemp("advise")
    for bucket, name in (("decode:64", "decode-b64"), ("prefill:1:1024", "prefill-b1-t1024")):
        model, inputs, _ = build_model("llama", "tiny", bucket, "bfloat16", "meta", max_seq=2048)
        g = capture_module(model, inputs, meta={"model": "llama", "bucket": bucket}).graph
        (d / f"llama-{name}.tgraph.gz").write_bytes(gzip.compress(msgpack.packb(g.to_dict(), use_bin_type=True)))
    return str(d)


def test_json_format(tiny_data, capsys):
    assert cli.main(["advise", "--model", "llama", "--gpus", "A100,L40S", "--json", "--data", tiny_data]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == ["model", "gpus", "policies", "bound"]
    assert doc["model"] == "llama" and doc["gpus"] == ["A100", "L40S"]
    assert set(doc["policies"]) == set(advise.POLICIES)
    for v in doc["policies"].values():
        assert list(v) == ["tokens_per_s", "tokens_per_dollar", "batch"]
        assert isinstance(v["tokens_per_s"], float) and v["tokens_per_s"] > 0 and v["tokens_per_dollar"] > 0
        assert isinstance(v["batch"], int) and v["batch"] >= 64     # the one decode bucket here is b64
        # the bound is an upper bound of every policy, at equal memory
        assert v["tokens_per_s"] <= doc["bound"]["tokens_per_s"] * (1 + 1e-6)
    assert doc["bound"]["batch"] == 64
    rd, hl, hr = (doc["policies"][p]["tokens_per_s"] for p in ("Request Distribution", "Homo-L", "Homo-R"))
    assert rd == pytest.approx(hl + hr)
    # tokens per dollar: tokens/s over the rented GPUs' $/hour
    assert doc["policies"]["Homo-R"]["tokens_per_dollar"] == pytest.approx(hr * 3600 / 1.0)
    assert doc["policies"]["Tessera"]["tokens_per_dollar"] == pytest.approx(
        doc["policies"]["Tessera"]["tokens_per_s"] * 3600 / 2.5)


def test_budget_recommendation(tiny_data):
    pair = advise.evaluate("llama", ["A100", "L40S"], data=tiny_data)
    rec = advise.recommend("llama", ["A100", "L40S"], 2.0, pair=pair, data=tiny_data)
    assert rec["price_per_h"] <= 2.0 and rec["replicas"] == int(2.0 // rec["price_per_h"])
    # within $2/h only one A100 (1.5), one or two L40S (1.0, 2.0) can be rented
    homo = {"A100": pair["policies"]["Homo-L"]["tokens_per_dollar"], "L40S": pair["policies"]["Homo-R"]["tokens_per_dollar"]}
    assert rec["tokens_per_dollar"] >= max(homo.values()) * (1 - 1e-9)
    assert set(rec["gpus"]) <= {"A100", "L40S"} and "A100" not in rec["gpus"][1:]
    assert advise.recommend("llama", ["A100", "L40S"], 0.5, pair=pair, data=tiny_data) is None


def test_budget_in_json_and_bad_gpu(tiny_data, capsys):
    assert cli.main(["advise", "--model", "llama", "--gpus", "A100,L40S", "--json", "--budget", "10",
                     "--data", tiny_data]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommendation"]["price_per_h"] <= 10
    assert cli.main(["advise", "--model", "llama", "--gpus", "A100,V100", "--data", tiny_data]) == 2
    assert "unknown GPU 'V100'" in capsys.readouterr().err


def test_committed_graphs_exist():
    for model in advise.MODELS:
        for bucket in advise.buckets_of(model).values():
            assert advise.graph_path(model, bucket).exists()
    assert advise.load_params().eff_c["gemm"] > 0


def test_gpu_groups_with_counts():
    from tessera_actors.planning.policies import parse_gpus
    assert parse_gpus("A100,L40S") == ["A100", "L40S"]
    assert parse_gpus("2xa100, 3xL40S") == ["A100"] * 2 + ["L40S"] * 3
    for bad in ("A100", "A100,L40S,H100", "0xA100,L40S", "A100,V100"):
        with pytest.raises(ValueError):
            parse_gpus(bad)


def test_unit_s_is_time_sharing_on_one_gpu_and_pd_on_two():
    """The one formula of prefill and decode sharing GPUs: at least each
    plan's own time, each GPU's compute of both, and the link (PD's state)."""
    from tessera_actors.planning.policies import Option, unit_s
    pre0 = Option(100.0, (0.010, 0.0), 1, "prefill on 0")      # 10 ms a prompt
    dec1 = Option(1000.0, (0.0, 0.001), 1, "decode on 1")      # 1 ms a decode step
    dec0 = Option(1000.0, (0.001, 0.0), 1, "decode on 0")
    assert unit_s([(pre0, 1), (dec1, 16)], 0.002) == pytest.approx(0.016)     # PD, decode bound
    assert unit_s([(pre0, 4), (dec1, 16)], 0.008) == pytest.approx(0.040)     # PD, prefill bound
    assert unit_s([(pre0, 1), (dec1, 4)], 0.030) == pytest.approx(0.030)      # PD, the link bound
    assert unit_s([(pre0, 1), (dec0, 16)]) == pytest.approx(0.026)            # one GPU: time sharing


def test_the_prompt_is_served_where_the_decode_plan_keeps_the_weights():
    """A prompt planned on the other GPU alone would need a second copy of
    every weight: the engine serves it pinned to the decode plan's homes, and
    so does the Tessera row; a prompt plan that keeps them is taken as is."""
    from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
    from tessera_actors.plan import build_plan
    from tessera_actors.planning.costs import CostTable
    from tessera_actors.planning.policies import Option, served_prefill
    bufs = {0: Buffer(0, 64, "input", "x"), 1: Buffer(1, 64, "weight", "w1"), 2: Buffer(2, 64, "weight", "w2"),
            3: Buffer(3, 64, "temp"), 4: Buffer(4, 64, "output", "y")}
    ks = [Kernel(0, "a", "library", (Access(0, 0, 64, "r"), Access(1, 0, 64, "r"), Access(3, 0, 64, "w"))),
          Kernel(1, "b", "library", (Access(3, 0, 64, "r"), Access(2, 0, 64, "r"), Access(4, 0, 64, "w")))]
    g = KernelGraph(ks, bufs, {"x": 0}, [4])
    devs = ["cuda:0", "cuda:1"]
    costs = CostTable(devs, [[0.004, 0.001], [0.004, 0.001]], [[0.0, 1e-5], [1e-5, 0.0]],
                      [[float("inf"), 1e9], [1e9, float("inf")]], [None, None])
    plan = lambda a, name: build_plan(g, devs, a, name=name)  # noqa: E731
    dec = Option(1 / 0.008, (0.008, 0.0), 1, "on cuda:0", plan([0, 0], "homo[cuda:0]"))
    on_r = Option(1 / 0.002, (0.0, 0.002), 1, "on cuda:1", plan([1, 1], "homo[cuda:1]"))
    (served,) = served_prefill(g, costs, [on_r], g, dec)
    assert served.plan.assignment == [0, 0] and served.busy == pytest.approx((0.008, 0.0))
    assert served.rate == pytest.approx(1 / 0.008) and "pinned to decode's homes" in served.label
    split = Option(1 / 0.005, (0.004, 0.001), 1, "split", plan([0, 1], "split"))
    dec_split = Option(1 / 0.005, (0.004, 0.001), 1, "split", plan([0, 1], "split"))
    assert served_prefill(g, costs, [split], g, dec_split) == [split]


def test_the_tessera_row_serves_no_prompt_on_a_gpu_that_does_not_hold_the_decode_weights():
    """Llama on A100+L40S (the committed graphs): the decode plan keeps
    weights on the A100, so the prompt cannot run on the L40S alone (it did:
    a pair the engine cannot serve, 527 tokens/s, above PD and AF)."""
    res = advise.evaluate("llama", ["A100", "L40S"])
    tess = res["policies"]["Tessera"]
    assert "prefill on L40S" not in tess["note"] or "decode on L40S" in tess["note"]
    assert tess["tokens_per_s"] < res["policies"]["PD"]["tokens_per_s"]


def test_unit_s_is_the_step_time_models_makespan_of_prefill_and_decode_sharing_gpus():
    """``unit_s`` is the closed form of the one step-time model
    (:mod:`.timing`) for a prompt plan and a decode plan in flight together:
    on two GPUs (PD) and on one (time sharing) it is the simulated makespan."""
    from tessera_actors.planning.policies import Option, unit_s
    from tessera_actors.planning.timing import Programs, run
    for pre_dev, dec_dev in ((0, 1), (0, 0)):
        pre = Programs([[("run", 0)] if d == pre_dev else [] for d in range(2)], [0.010], {})
        dec = Programs([[("run", 0)] if d == dec_dev else [] for d in range(2)], [0.001], {})
        r = run([(pre, 1), (dec, 1)], [4, 16])
        parts = [(Option(100.0, tuple(0.010 if d == pre_dev else 0.0 for d in range(2)), 1, ""), 4),
                 (Option(1000.0, tuple(0.001 if d == dec_dev else 0.0 for d in range(2)), 1, ""), 16)]
        assert max(r.finish) == pytest.approx(unit_s(parts))


async def test_the_engine_keeps_the_prompt_steps_in_flight_that_the_tessera_row_predicts():
    """A prompt plan pipelined over two CPU devices (the layers planner, 2
    micro-batches): the engine keeps two prompt-chunk steps of different
    requests in flight, with the tokens of one device, and the Tessera row
    predicts that same plan with the same steps in flight, at its simulated
    rate (``prompt_inflight`` is the one rule of both)."""
    import asyncio
    from tessera_actors import AsyncEngine, SamplingParams
    from tessera_actors.planning.costs import Roofline
    from tessera_actors.planning.inflight import prompt_inflight
    from tessera_actors.planning.policies import Option, _planned, served_prefill
    from tessera_actors.planning.simulate import simulate
    cfg = dict(model="smollm2", size="tiny", max_model_len=512, max_seqs=8, decode_buckets=(1, 2, 4, 8),
               prefill_buckets=(16, 64), prefill_rows=(1,), prefix_caching=False)
    prompts = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(8)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)

    async def tokens(eng, prompt):
        return [t async for out in eng.generate(prompt, greedy) for t in out.token_ids]
    async with AsyncEngine(devices="cpu", **cfg) as one:
        want = [await tokens(one, p) for p in prompts]
    async with AsyncEngine(devices="cpu,cpu", planner="layers", **cfg) as eng:
        await eng.wait_placed()
        got = await asyncio.gather(*(tokens(eng, p) for p in prompts))
        stats, placed = eng.stats(), eng.deployment.placed
        served = placed["prefill:16"].plan
        ref = placed[eng.deployment.reference_bucket()].plan
        gp, g = eng.served.graphs["prefill:16"], eng.served.graphs[eng.deployment.reference_bucket()]
    assert got == want
    assert prompt_inflight(served) == 2 and stats["pipelined_prompt_steps"] > 0
    costs = Roofline().table(gp, served.devices)
    planned = _planned(gp, costs, "layers")
    assert planned.plan.assignment == served.assignment
    (row,) = served_prefill(gp, costs, [planned], g, Option(1.0, (0.0, 0.0), 1, "decode", ref))
    assert row.inflight == prompt_inflight(served) == 2
    assert row.rate == pytest.approx(simulate(served, costs, inflight=2).throughput)


def test_the_tessera_rows_decode_micro_batches_are_a_serve_flag():
    """The row's ``decode ... xN`` is N decode steps in flight: ``tessera
    serve --mode throughput --groups N`` runs them (N groups of rows)."""
    import argparse
    from tessera_actors import AsyncEngine
    from tessera_actors.serving.flags import add_serve_arguments, engine_kwargs
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    kw = engine_kwargs(p.parse_args(["--devices", "cpu,cpu", "--mode", "throughput", "--groups", "4",
                                     "--max-seqs", "8", "--size", "tiny"]))
    assert kw["groups"] == 4
    eng = AsyncEngine(**kw)   # not started: stats() reports the configuration
    assert eng.stats()["groups"] == 4 and len(eng.slots.bounds) == 4

"""The serving engine's pure parts: sampling, text, batch formation, pinning."""
import math

import pytest
import torch

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.planning.pinning import pinned_assignment, respects, state_homes, weight_homes
from tessera_actors.serving import InvalidRequest, SamplingParams
from tessera_actors.execution.inputs import chunk_inputs
from tessera_actors.serving.batch import Sequence, SlotAllocator, chunk_rows, decode_rows, prefill_batch, prefill_chunk
from tessera_actors.serving.config import EngineConfig
from tessera_actors.execution.sampling import SampleBatch, as_sample_row, uniform


def sample_rows(logits, rows):
    """The token ids the device step draws for ``rows`` (lists of SampleRow's fields)."""
    return SampleBatch([as_sample_row(r) for r in rows], logits.device).sample(logits)[0].tolist()


def test_greedy_rows_take_the_argmax_of_their_own_row_and_column():
    logits = torch.randn(3, 2, 50)
    got = sample_rows(logits, [[2, 1, 0.0, 1.0, 0, 0, 0], [0, 0, 0.0, 1.0, 0, 0, 5]])
    assert got == [int(logits[2, 1].argmax()), int(logits[0, 0].argmax())]


def test_top_k_one_is_greedy_and_a_seed_draws_the_same_token_anywhere():
    torch.manual_seed(0)
    logits = torch.randn(4, 1, 1000)
    assert sample_rows(logits, [[1, 0, 0.7, 1.0, 1, 123, 0]]) == [int(logits[1, 0].argmax())]
    row = [1, 0, 1.0, 0.95, 40, 77, 3]
    one = sample_rows(logits[1:2], [[0] + row[1:]])
    mixed = sample_rows(logits, [[0, 0, 0.0, 1.0, 0, 0, 0], row, [3, 0, 0.5, 1.0, 0, 9, 1]])
    assert mixed[1] == one[0]
    # different draw indices of one seed give different uniforms
    assert len({uniform(77, i) for i in range(100)}) == 100


def test_sampling_follows_the_distribution_and_respects_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[None, None]
    counts = [0] * 4
    for i in range(4000):
        counts[sample_rows(logits, [[0, 0, 1.0, 1.0, 0, 5, i]])[0]] += 1
    assert all(abs(c / 4000 - p) < 0.03 for c, p in zip(counts, [0.5, 0.3, 0.15, 0.05]))
    picks = {sample_rows(logits, [[0, 0, 1.0, 0.7, 0, 5, i]])[0] for i in range(500)}
    assert picks == {0, 1}     # 0.5 + 0.3 reaches top_p 0.7; the tail is never drawn


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    torch.manual_seed(1)
    logits = torch.randn(2, 1, 300)
    rows = [[r, 0, 1.0, top_p, 0, seed, 0] for r in (0, 1) for top_p in (1e-300, 1e-45) for seed in range(5)]
    assert sample_rows(logits, rows) == [int(logits[r, 0].argmax()) for r in (0, 1) for _ in range(10)]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.1),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("seed", "x"),
                                         ("stop", [""]), ("temperature", math.nan), ("max_tokens", True),
                                         ("seed", 2 ** 64), ("seed", -2 ** 63 - 1), ("top_k", 2 ** 64),
                                         ("stop", ["a\ud800"]), ("logit_bias", {2 ** 64: 1.0})])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field


def test_slots_balance_groups_and_release():
    a = SlotAllocator([(0, 2), (2, 4)])
    got = [a.take() for _ in range(4)]
    assert got == [0, 2, 1, 3] and a.take() is None
    a.release(2)
    assert a.take() == 2 and a.groups[3] == 1


def test_a_decode_step_names_its_rows_and_only_the_rows_that_start_there():
    p = SamplingParams(temperature=0.5, top_k=3).validate()
    s1 = Sequence("a", [1, 2, 3], p, 7, slot=5, generated=[9])
    s2 = Sequence("b", [4], p, 8, slot=4, generated=[7, 8])
    first = decode_rows([s1, s2], 4, "plan", -1, 0, None, 63, False)
    assert first.base == -1 and first.order == [1, 0] and first.pad == 63 and first.tokens == []
    assert [(e.row, e.position, e.token, e.index, e.seed, e.top_k) for e in first.new] == [(1, 3, 9, 1, 7, 3),
                                                                                           (0, 2, 8, 2, 8, 3)]
    s1.generated.append(5)
    s2.generated.append(6)
    s3 = Sequence("c", [1], p, 0, slot=6, generated=[3])
    steady = decode_rows([s1, s2], 4, "plan", 0, 1, first.order, 63, False)
    assert steady.order is None and steady.new == []             # the devices move both rows on themselves
    joined = decode_rows([s1, s2, s3], 4, "plan", 1, 2, [1, 0], 63, True)
    assert joined.order == [1, 0, 2] and [e.row for e in joined.new] == [2] and joined.tokens == [5, 6, 3]
    other = decode_rows([s1], 4, "another", 0, 0, [1], 63, False)   # a row back from another plan's steps starts
    assert [e.row for e in other.new] == [1] and other.new[0].position == 4


def test_a_token_in_flight_is_taken_on_the_device_one_position_on():
    p = SamplingParams(max_tokens=3).validate()
    s1 = Sequence("a", [1, 2, 3], p, 0, slot=1, generated=[9])
    decode_rows([s1], 0, "plan", -1, 0, None, 63, False)
    s1.pending = 1
    s2 = Sequence("b", [4], p, 0, slot=0, generated=[7])
    rows = decode_rows([s1, s2], 0, "plan", 0, 1, [1], 63, False)
    assert rows.order == [1, 0] and [(e.row, e.position, e.index) for e in rows.new] == [(0, 1, 1)]
    with pytest.raises(ValueError, match="in flight"):
        decode_rows([s1], 0, "plan", 7, 2, [1, 0], 63, False)   # not a row of the step it continues


def _chunks(length: int, buckets: list[int]) -> tuple[list[int], list[bool]]:
    p = SamplingParams().validate()
    s = Sequence("a", list(range(length)), p, 0, slot=3, context=list(range(length)))
    sizes, samples = [], []
    while s.prefilled < len(s.context):
        size, n = prefill_chunk(s, buckets)
        rows, sample = chunk_rows([s], [n], size, 1, max_len=512)
        assert rows.slots == [3] and rows.starts == [s.prefilled] and rows.pad == 511
        assert rows.tokens == [s.context[s.prefilled:s.prefilled + n]]
        sizes.append(size)
        samples.append(bool(sample))
        s.prefilled += n
    return sizes, samples


def test_a_batched_prefill_step_feeds_each_rows_chunk_and_samples_the_prompts_it_ends():
    p = SamplingParams().validate()
    a = Sequence("a", [1, 2, 3], p, 0, slot=5, context=[1, 2, 3])
    b = Sequence("b", list(range(10, 30)), p, 0, slot=2, context=list(range(10, 30)), prefilled=16)
    c = Sequence("c", list(range(40)), p, 0, slot=7, context=list(range(40)))
    rows, sample = chunk_rows([a, b, c], [3, 4, 16], size=16, rows=4, max_len=64)
    inp = chunk_inputs(rows)   # what the device that reads the inputs writes
    assert inp["rows"].tolist() == [5, 2, 7, 5]           # the padding row writes into the first row's last slot
    assert inp["last"].tolist() == [2, 3, 15, 0]
    assert inp["input_ids"][1, :4].tolist() == list(range(26, 30)) and inp["input_ids"][0, :3].tolist() == [1, 2, 3]
    assert inp["positions"][1, :4].tolist() == [16, 17, 18, 19] and inp["positions"][1, 4:].max() <= 63
    assert inp["positions"][3].tolist() == [63] * 16
    assert [(e.row, e.col) for e in sample] == [(0, 0), (1, 0)]   # c's chunk does not end its prompt: it does not sample
    with pytest.raises(ValueError, match="does not fit"):
        chunk_rows([c], [20], size=16, rows=1, max_len=64)


@pytest.mark.parametrize("length,buckets,want", [
    (300, [32, 128], [128, 128, 32, 32]),        # the 44 left: two small chunks pad less than one of 128
    (290, [32, 128, 256], [256, 32, 32]),
    (300, [128], [128, 128, 128]),
    (140, [32, 128], [128, 32]),
    (120, [32, 128], [128]),                     # one chunk: 96 + 16 (a step) would not pad less
    (300, [32, 256, 2048], [256, 256]),          # the rest of a split is not split again
])
def test_prefill_chunks_use_big_buckets_then_the_fewest_padded_tokens(length, buckets, want):
    sizes, samples = _chunks(length, buckets)
    assert sizes == want and samples == [False] * (len(want) - 1) + [True]
    assert len(sizes) <= math.ceil(length / max(buckets)) + 1


def _graph() -> KernelGraph:
    bufs = {0: Buffer(0, 64, "input", "x"), 1: Buffer(1, 64, "state", "kv0"), 2: Buffer(2, 64, "state", "kv1"),
            3: Buffer(3, 64, "temp"), 4: Buffer(4, 64, "output", "y")}
    ks = [Kernel(0, "a", "library", (Access(0, 0, 64, "r"), Access(3, 0, 64, "w"))),
          Kernel(1, "b", "library", (Access(3, 0, 64, "r"), Access(1, 0, 64, "rw"))),
          Kernel(2, "c", "library", (Access(1, 0, 64, "r"), Access(3, 0, 64, "w"))),
          Kernel(3, "d", "library", (Access(3, 0, 64, "r"), Access(2, 0, 64, "rw"))),
          Kernel(4, "e", "library", (Access(2, 0, 64, "r"), Access(4, 0, 64, "w")))]
    return KernelGraph(ks, bufs, {"x": 0}, [4])


def test_state_pinning_keeps_every_state_on_its_home():
    g = _graph()
    homes = state_homes(g, [0, 0, 0, 1, 1])
    assert homes == {"kv0": 0, "kv1": 1}
    flipped = pinned_assignment(g, {"kv0": 1, "kv1": 0})
    assert flipped == [1, 1, 1, 0, 0] and respects(g, flipped, {"kv0": 1, "kv1": 0})
    assert not respects(g, [0, 0, 0, 1, 1], {"kv0": 1})


def test_a_plan_served_under_other_homes_keeps_its_micro_batches_in_flight():
    """The scheduler's rule (``served_plan``): a plan that keeps the homes is
    served as it is; one that breaks them is pinned, at the planned
    micro-batches (the engine keeps that many prompt steps in flight)."""
    from tessera_actors.plan import build_plan
    from tessera_actors.planning.inflight import prompt_inflight
    from tessera_actors.planning.pinning import served_plan
    g = _graph()
    devs = ["cpu", "cpu"]
    planned = build_plan(g, devs, [0, 0, 0, 1, 1], name="split", microbatches=3)
    assert served_plan(g, planned, devs, {"kv0": 0, "kv1": 1}) is planned
    pinned = served_plan(g, planned, devs, {"kv0": 1, "kv1": 0})
    assert pinned.assignment == [1, 1, 1, 0, 0] and pinned.name == "split, state-pinned"
    assert prompt_inflight(pinned) == prompt_inflight(planned) == 3


def test_weights_held_on_one_device_pin_their_readers_there():
    bufs = {0: Buffer(0, 64, "input", "x"), 1: Buffer(1, 64, "weight", "w1"), 2: Buffer(2, 64, "weight", "w2"),
            3: Buffer(3, 64, "temp"), 4: Buffer(4, 64, "output", "y")}
    ks = [Kernel(0, "a", "library", (Access(0, 0, 64, "r"), Access(1, 0, 64, "r"), Access(3, 0, 64, "w"))),
          Kernel(1, "b", "library", (Access(3, 0, 64, "r"), Access(2, 0, 64, "r"), Access(4, 0, 64, "w")))]
    g = KernelGraph(ks, bufs, {"x": 0}, [4])
    assert weight_homes(g, [0, 1]) == {"w1": {0}, "w2": {1}}
    assert not respects(g, [0, 0], {}, {"w1": {0}, "w2": {1}})      # w2 would get a second copy on device 0
    assert pinned_assignment(g, {}, {"w1": {0}, "w2": {1}}) == [0, 1]


def test_engine_config_refuses_bad_values():
    with pytest.raises(ValueError, match="max_seqs"):
        EngineConfig(max_seqs=0)
    with pytest.raises(ValueError, match="mode"):
        EngineConfig(mode="fast")
    assert EngineConfig(max_seqs=6, decode_buckets=(1, 4, 8)).decode_buckets == (1, 4, 6)
    with pytest.raises(ValueError, match="prompt_steps"):
        EngineConfig(prompt_steps=0)


async def test_an_engine_that_was_not_started_says_so():
    from tessera_actors import AsyncEngine
    from tessera_actors.serving import EngineDead
    eng = AsyncEngine(model="llama", size="tiny", devices="cpu")
    with pytest.raises(EngineDead, match="not running"):
        async for _ in eng.generate([1, 2], SamplingParams(max_tokens=1)):
            pass


async def test_a_failed_placement_is_tried_again_by_the_next_step_that_needs_it():
    """(After a loss every bucket is placed anew; one failed attempt - a
    timeout, a full device - must not fail every later step at once.)"""
    import types

    from tessera_actors.serving.deployment import Deployment
    rt = Deployment.__new__(Deployment)
    rt.placed, rt._placing, rt.generation, rt.pins, rt.weights = {}, {}, 0, {}, {}
    rt.served, rt.progress = types.SimpleNamespace(buckets={"prefill:32": object()}), None
    calls = []

    async def place(bucket, pins, weights):
        calls.append(bucket)
        if len(calls) == 1:
            raise RuntimeError("device busy")
        return "placed"
    rt._place = place
    with pytest.raises(RuntimeError):
        await rt._placed("prefill:32")
    assert await rt._placed("prefill:32") == "placed" and calls == ["prefill:32"] * 2
    assert rt.placed["prefill:32"] == "placed"


def test_every_deployment_captures_attention_as_one_kernel_and_only_gpus_ask_for_inductor():
    from tessera_actors.serving.deploy import all_cuda, capture_kind, load_served_model
    assert capture_kind(EngineConfig(devices="cpu,cpu?threads=1")) == "aten"
    assert capture_kind(EngineConfig(devices="cuda:0,cpu")) == "aten"       # a CPU runs no Triton kernel
    assert all_cuda(EngineConfig(nodes=("cuda:0", "cuda:1?sms=32"))) and not all_cuda(EngineConfig(nodes=("cpu",)))
    assert capture_kind(EngineConfig(devices="cuda:0", capture="aten")) == "aten"
    with pytest.raises(ValueError, match="capture must be one of"):
        EngineConfig(capture="triton")
    # a GPU+CPU deployment (no GPU here, nothing runs): attention whole, the device picks its kernel
    served = load_served_model(EngineConfig(model="llama", size="tiny", devices="cuda:0,cpu", max_seqs=2,
                                            max_model_len=64, prefill_buckets=(16,)))
    ops = [k.name for g in served.graphs.values() for k in g.kernels]
    assert set(served.captures.values()) == {"aten"}
    assert "scaled_dot_product_attention" in ops and "_safe_softmax" not in ops and "bmm" not in ops
    assert "rms_norm" not in ops   # a GPU in the deployment: the model's default form, as before


def test_a_cpu_deployment_captures_the_fewest_ops_form():
    from tessera_actors.serving.deploy import all_cpu, load_served_model
    assert all_cpu(EngineConfig(devices="cpu,cpu?threads=1")) and not all_cpu(EngineConfig(devices="cuda:0,cpu"))
    assert all_cpu(EngineConfig(nodes=("cpu", "cpu?threads=1"))) and not all_cpu(EngineConfig(nodes=("cpu", "cuda:0")))
    served = load_served_model(EngineConfig(model="llama", size="tiny", devices="cpu", max_seqs=2,
                                            max_model_len=64, prefill_buckets=(16,)))
    layers = served.model.cfg.n_layers
    g = served.graph("decode:2@0")
    per_layer = {}
    for k in g.kernels:
        per_layer[k.layer] = per_layer.get(k.layer, 0) + 1
    names = [k.name for k in g.kernels]
    # one kernel per norm (two a layer and the final one), no rsqrt/pow/mean
    assert names.count("rms_norm") == 2 * layers + 1 and "rsqrt" not in names and "pow" not in names
    # 7 matmuls, 2 norms, 8 rotary, 2 cache writes, attention, silu, gate*up, 2 residual adds
    assert per_layer[layers - 1] == 24


def test_a_prompts_first_chunk_reads_only_its_own_length_of_the_cache():
    from tessera_actors.serving.buckets import buckets_for, window_for
    cfg = EngineConfig(max_model_len=1024, prefill_buckets=(32, 320), kv_windows=(512,))
    names = {b.name for b in buckets_for(cfg)}
    assert {"prefill:320~320", "prefill:32~32", "prefill:320~512", "prefill:320"} <= names
    assert window_for(cfg, 289, 320) == 320      # positions 0..289 of a 320-token chunk
    assert window_for(cfg, 400, 320) == 512      # a later chunk sees the cache before it
    assert window_for(cfg, 700, 320) == 0        # the whole cache
    assert window_for(cfg, 289) == 512           # decode steps: the configured windows only
    plain = EngineConfig(max_model_len=512, prefill_buckets=(32, 320))   # no window below the cache
    assert window_for(plain, 100, 320) == 0 and "prefill:320~320" not in {b.name for b in buckets_for(plain)}


def test_the_kv_cache_budget_is_validated_and_lowers_the_rows_to_what_fits():
    from tessera_actors.serving.memory import fit_kv_cache, kv_budget_bytes
    from tessera_actors.serving.params import EngineError
    for bad in ("lots", -1, 0, 1.5, True, [1]):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            EngineConfig(kv_cache_memory=bad)
    cfg = EngineConfig(max_seqs=16, max_model_len=2048, kv_cache_memory="100MiB")
    fitted = fit_kv_cache(cfg, 30 << 20)                     # 30 MiB a row: 3 rows fit
    assert fitted.max_seqs == 3 and fitted.decode_buckets[-1] == 3 and cfg.max_seqs == 16
    assert fit_kv_cache(cfg, 6 << 20) is cfg                 # 16 rows of 6 MiB fit
    with pytest.raises(EngineError, match="holds no sequence"):
        fit_kv_cache(cfg, 200 << 20)
    assert kv_budget_bytes(EngineConfig(kv_cache_memory="auto", devices="cpu,cpu")) == 512 << 20
    assert kv_budget_bytes(EngineConfig(kv_cache_memory="auto", devices="cuda:0")) is None
    assert kv_budget_bytes(EngineConfig(kv_cache_memory=None)) is None
    half = kv_budget_bytes(EngineConfig(kv_cache_memory=0.5, devices="cpu?mem=2GiB,cpu?mem=2GiB"))
    assert half == 2 << 30                                   # half of the two budgets


def test_a_prefill_step_takes_the_prompts_whose_chunks_fit_the_first_ones_within_the_token_budget():
    p = SamplingParams().validate()

    def seq(rid, n):
        return Sequence(rid, list(range(n)), p, 0, slot=0, context=list(range(n)))
    waiting = [seq("a", 40), seq("long", 300), *(seq(f"s{i}", 20 + i) for i in range(12))]
    seqs, chunks, size, rows = prefill_batch(waiting, [32, 64, 128], [1, 4, 8], budget=512)
    assert size == 64 and rows == 8 and len(seqs) == 8 and "long" not in [s.rid for s in seqs]
    assert chunks == [40] + [20 + i for i in range(7)]
    seqs, chunks, size, rows = prefill_batch(waiting[:3], [32, 64, 128], [1, 4, 8], budget=512)
    assert [s.rid for s in seqs] == ["a", "s0"] and rows == 4       # padded up to a row count there is
    _, _, size, rows = prefill_batch(waiting[1:], [32, 64, 128], [1, 4, 8], budget=256)
    assert size == 128 and rows == 1                                 # 4 x 128 is over the budget: alone


def test_a_freed_row_keeps_its_tokens_for_a_prompt_that_starts_with_them():
    slots = SlotAllocator([(0, 4)], min_reuse=4)
    p = SamplingParams().validate()
    s = Sequence("a", list(range(10)), p, 0, context=list(range(10)), prefilled=10, generated=[50, 51, 52])
    assert s.kv_tokens(64) == list(range(10)) + [50, 51]     # the latest token was never fed
    assert Sequence("b", [1] * 9, p, 0, context=[1] * 9, prefilled=5).kv_tokens(64) == [1] * 5
    row = slots.take()
    slots.release(row, s.kv_tokens(64))
    assert slots.take() != row                               # a plain take leaves the kept row alone
    assert slots.take_for(list(range(6)) + [99]) == (row, 6)
    slots.release(row, [1, 2, 3])                             # under min_reuse: not kept
    assert row not in slots.kept
    slots.release(slots.take_for([0])[0], list(range(8)))
    slots.forget()
    assert slots.kept == {}

"""Mamba-2 (an SSM: one recurrent state per row) and the VLM's Llama decoder
served by ``AsyncEngine``: the engine's greedy tokens are each model's own
eager greedy loop's, for concurrent prompts of different lengths (one longer
than two prefill chunks) whose rows join and leave mid-batch; a padding row
or another sequence's step leaves a state row as it was; and ``tessera bench
roofline`` serves both through the engine (DiT: not served, and says why)."""
import asyncio

import pytest
import torch

from tessera_actors import AsyncEngine, SamplingParams, models
from tessera_actors.serving import InvalidRequest
from tessera_actors.testing import greedy_decode

# six prompts for four rows: the last two join as the first ones end; one prompt is 40 tokens (16 + 16 + 8)
PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((3, 40, 9, 21, 5, 17))]
MAX_TOKENS = [6, 10, 4, 12, 8, 5]
ENGINE = dict(size="tiny", max_seqs=4, max_model_len=128, prefill_buckets=(4, 16), decode_buckets=(1, 2, 4))


async def _eager(name: str) -> list[tuple[list[int], list[float]]]:
    """Each prompt alone through the model's own greedy loop (prompt at once,
    then a decode step per token on its state): tokens and their logprobs."""
    m = models.get(name, "tiny", seed=0, max_batch=ENGINE["max_seqs"], max_seq=ENGINE["max_model_len"])
    out = []
    with torch.no_grad():
        for prompt, n in zip(PROMPTS, MAX_TOKENS):
            m.reset_state()
            toks, seen = await greedy_decode(lambda x: m(**x), prompt, n, prefill=True)
            out.append((toks, [torch.log_softmax(s.float(), -1)[t].item() for s, t in zip(seen, toks)]))
    return out


async def _generate(eng, prompt, n) -> tuple[list[int], list[float]]:
    toks, lps = [], []
    async for o in eng.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
        toks += o.token_ids
        lps += o.logprobs
    return toks, lps


@pytest.mark.parametrize("name", ["mamba2", "vlm"])
async def test_served_greedy_tokens_are_the_models_own_greedy_loops_for_rows_joining_and_leaving(name):
    want = await _eager(name)
    async with AsyncEngine(model=name, devices="cpu,cpu", kv_windows=(32,), **ENGINE) as eng:
        await eng.wait_placed()   # every bucket, the batched prompt chunks (R x C) too
        got = await asyncio.gather(*(_generate(eng, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)))
        cfg, stats, ran = eng.cfg, eng.stats(), set(eng.step_time)
        with pytest.raises(InvalidRequest, match=r"\[0, 256\)"):   # the model's vocabulary bounds a prompt's ids
            await _generate(eng, [5, 256], 2)
    for (want_toks, want_lps), (toks, lps) in zip(want, got):
        assert toks == want_toks
        assert lps == pytest.approx(want_lps, abs=1e-4)   # a disturbed state row is off by 1e-2 or more
    assert stats["generated_tokens"] == sum(MAX_TOKENS) and stats["slots_in_use"] == 0
    assert any(b.startswith("prefill:4x") for b in ran), ran   # several prompts' chunks in one step
    # an SSM's row is its latest state: no kept prefix, no attention window; the VLM's KV rows keep both
    assert (cfg.prefix_caching, cfg.kv_windows) == ((False, (128,)) if name == "mamba2" else (True, (32, 128)))


async def test_a_repeated_mamba2_prompt_is_prefilled_again_not_taken_from_a_kept_row():
    prompt = PROMPTS[1]
    async with AsyncEngine(model="mamba2", devices="cpu", **ENGINE) as eng:
        first = await _generate(eng, prompt, 4)
        before = eng.stats()["prefill_steps"]
        again = await _generate(eng, prompt, 4)
        stats = eng.stats()
    assert again[0] == first[0] and stats["prefix_hits"] == 0
    assert stats["prefill_steps"] - before >= 3   # 40 tokens in chunks of at most 16


def test_mamba2_padding_rows_and_tokens_leave_the_sequences_states_as_they_were():
    """The engine's padding: a row at position ``max_seq - 1`` (a decode
    step's padding row, or a prompt step's extra row naming a real row) and
    the tokens after ``last`` of a prompt chunk change no sequence's state."""
    m = models.get("mamba2", seed=1, max_batch=4, max_seq=64)
    ids = m.example_inputs("prefill", batch=4, seq=8)["input_ids"]
    m(input_ids=ids[:, :6], positions=torch.arange(6).repeat(4, 1))
    names = m.state_names()

    def states():
        return {n: t.clone() for n, t in m.named_buffers() if n in names}
    before = states()
    # a decode step of rows 2 (at position 6) and 0 (padding: the last position)
    m(input_ids=ids[[2, 0], 6:7], positions=torch.tensor([6, 63]), rows=torch.tensor([2, 0]))
    after = states()
    for n in names:
        assert torch.equal(after[n][[0, 1, 3]], before[n][[0, 1, 3]]), n
        assert not torch.equal(after[n][2], before[n][2]), n
    # a prompt chunk of row 1: 2 real tokens of 5 (then padding), and a padding row naming row 1 too
    chunk = torch.tensor([ids[1, 6:8].tolist() + [0, 0, 0], [0] * 5])
    positions = torch.stack([torch.arange(6, 11), torch.full((5,), 63)])
    m(input_ids=chunk, positions=positions, rows=torch.tensor([1, 1]), last=torch.tensor([1, 0]))
    chunked = states()
    m2 = models.get("mamba2", seed=1, max_batch=4, max_seq=64)
    m2(input_ids=ids[1:2, :8], positions=torch.arange(8)[None])   # row 1's 8 tokens alone, in row 0
    alone = {n: t for n, t in m2.named_buffers() if n in names}
    for n in names:
        torch.testing.assert_close(chunked[n][1], alone[n][0], rtol=1e-5, atol=1e-6, msg=n)
        assert torch.equal(chunked[n][[0, 2, 3]], after[n][[0, 2, 3]]), n


def test_the_roofline_serves_every_language_model_and_says_why_dit_is_not():
    from tessera_actors.bench.roofline import MODELS, NOT_SERVED, RooflineConfig, build, run_case
    cfg = RooflineConfig(layers=1, batch=4, cache=64, prompt=16, device="meta")
    assert [m for m in MODELS if m not in NOT_SERVED] == ["llama", "moe", "mamba2", "vlm"]
    row = run_case("dit", "decode", cfg, 1.0, 1.0)
    assert row["case"] == "denoise b4" and "no tokens" in row["error"]
    make, label = build("vlm", "prefill", cfg, torch.device("meta"))
    _, inputs = make()   # the compiled baseline's inputs: the served chunk's text tokens, no image
    assert label == "prefill 1x16 (text)" and sorted(inputs) == ["input_ids", "positions"]
    assert inputs["positions"].shape == (1, 16)


@pytest.mark.parametrize("name", ["mamba2", "vlm"])
async def test_the_roofline_served_path_runs_mamba2_and_vlm_through_the_engine(name):
    """``bench.served`` (the roofline's tessera column) on CPU at tiny size."""
    from tessera_actors.bench.served import ServedCase, served_decode, served_prefill
    case = ServedCase(name, "tiny", 1, "float32", "cpu", batch=2, cache=64, prompt=16, decode_tokens=4, reps=1,
                      overrides={"vis_layers": 1} if name == "vlm" else {})
    decode, prefill = await served_decode(case), await served_prefill(case)
    assert decode["bucket"] == "decode:2@0" and decode["served_step_s"] > 0 and decode["window_steps"] > 0
    assert prefill["bucket"] == "prefill:16" and prefill["served_step_s"] > 0
    assert decode["capture"] == prefill["capture"] == "aten"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mamba2", "vlm"])
async def test_on_a_gpu_inductor_captures_of_mamba2_and_vlm_give_the_aten_captures_tokens(name):
    async def run(capture: str):
        async with AsyncEngine(model=name, devices="cuda:0", capture=capture, embeddings=False, **ENGINE) as eng:
            got = await asyncio.gather(*(_generate(eng, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)))
            return [t for t, _ in got], eng.stats()["bucket_stats"]
    want, _ = await run("aten")
    got, stats = await run("auto")   # inductor on a GPU
    assert got == want
    ran = {b: s for b, s in stats.items() if s.get("replays", 0) + s.get("eager_runs", 0)}
    assert ran and all(s["capture"] == "inductor" and s["capture_failures"] == 0 for s in stats.values()), stats

"""Third-party models as a user writes them: transformers' own classes in
their default configuration (default attention implementation, random init
from a tiny config, ``model(**inputs)``), captured and split bitwise; and
SmolLM2's real weights loaded by transformers from the GGUF."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import tessera_actors  # noqa: E402
from tessera_actors.cli import main as cli_main  # noqa: E402
from tessera_actors.capture.pytree import flatten_outputs  # noqa: E402
from tessera_actors.models import hf  # noqa: E402

ARCHS = ["llama", "qwen2", "mixtral", "gpt2", "mamba2", "vit"]


def user_inputs(loaded):
    """What a user passes: ids and mask (or pixels), nothing else."""
    inputs = loaded.example_inputs(batch=2, seq=8, seed=1)
    inputs.pop("use_cache", None)
    return inputs


@pytest.mark.parametrize("arch", ARCHS)
def test_default_transformers_model_captures_and_splits_bitwise(arch):
    loaded = hf.load(f"hf:tiny-{arch}", seed=0)
    report = tessera_actors.check(loaded.model, user_inputs(loaded), devices=["cpu", "cpu"], orders=50,
                                  splits=3, planner="contiguous", verbose=False)
    assert report.ok, report.table()
    rows = {(r["case"], r["reference"]): r for r in report.rows}
    assert rows["random orders (50)", "single-device"]["mismatches"] == 0
    assert rows["random splits (3)", "single-device"]["bitwise"] and rows["contiguous split", "single-device"]["bitwise"]
    if loaded.kind == "causal-lm":
        assert report.info["output_names"][0] == "logits" and len(report.info["output_names"]) > 1  # + the cache
    else:
        assert report.info["output_names"] == ["last_hidden_state", "pooler_output"]


@pytest.fixture(scope="module")
def smollm2():
    return hf.load("hf:smollm2", layers=2)


def test_smollm2_real_weights_in_transformers_llama_split_over_two_devices(smollm2):
    from tessera_actors import models
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    inputs = smollm2.example_inputs(batch=1, seq=6, seed=2)
    report = tessera_actors.check(smollm2.model, inputs, orders=3, splits=2, planner="contiguous", verbose=False)
    assert report.ok, report.table()
    ours = models.get("smollm2", "tiny", dtype=torch.float32)  # the same GGUF through our own reader and model
    ids = inputs["input_ids"]
    with torch.no_grad():
        theirs = smollm2.model(**inputs).logits
        mine = ours(input_ids=ids, positions=torch.arange(ids.shape[1])[None])
    assert torch.equal(theirs.argmax(-1), mine.argmax(-1))
    assert (theirs - mine).abs().max() < 1e-3


@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt2"])
def test_serving_contract_prefill_then_decode_equals_the_transformers_forward(arch):
    """hf.load_serving: the engine's contract (positions, rows, last, a static
    KV cache as state) around transformers' own model."""
    from tessera_actors.models.hf_serving import ServingLM
    model = hf.load(f"hf:tiny-{arch}").model
    lm = ServingLM(model, max_batch=3, max_seq=16)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        got = [lm(ids[:, :5], torch.arange(5)[None].expand(2, 5))[:, -1]]
        got += [lm(ids[:, t:t + 1], torch.full((2,), t))[:, -1] for t in range(5, 9)]
        lm.reset_state()
        chunk = lm(ids[1:], torch.arange(9)[None], rows=torch.tensor([2]), last=torch.tensor([8]))
    torch.testing.assert_close(torch.stack(got, 1), want[:, 4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunk[0, 0], want[1, 8], rtol=1e-5, atol=1e-5)
    assert lm.state_names()[0] == "cache.k0" and lm.cache.k0.shape[0] == 3 and lm.cache.k0.shape[2] == 16


def test_served_smollm2_buckets_capture_on_meta_without_guards_and_check_on_cpu(smollm2):
    from tessera_actors.capture import capture_module
    from tessera_actors.models.hf_serving import ServingLM
    meta = hf.load_serving("hf:smollm2", max_batch=2, max_seq=32, layers=2, device="meta")
    ids = torch.zeros(1, 8, dtype=torch.int64, device="meta")
    cap = capture_module(meta, {"input_ids": ids, "positions": torch.arange(8, device="meta")[None],
                                "rows": torch.zeros(1, dtype=torch.int64, device="meta"),
                                "last": torch.zeros(1, dtype=torch.int64, device="meta")})
    assert cap.graph.meta["guards"] == [] and any(b.role == "state" for b in cap.graph.buffers.values())
    real = ServingLM(smollm2.model, max_batch=2, max_seq=32)
    assert {n for n, _ in real.named_buffers()} == {n for n, _ in meta.named_buffers()}
    report = tessera_actors.check(real, real.example_inputs("decode", batch=2, pos=4), orders=5, splits=2,
                                  planner="contiguous", verbose=False)
    assert report.ok and report.rows[0]["tokens"], report.table()


def test_cli_capture_of_a_config_file(tmp_path, capsys):
    hf.load("hf:tiny-qwen2").config.to_json_file(str(tmp_path / "config.json"))
    out = tmp_path / "g.tgraph"
    assert cli_main(["capture", "--model", f"hf:{tmp_path / 'config.json'}", "--bucket", "prefill:1:4",
                     "--out", str(out)]) == 0
    assert out.exists() and "kernels" in capsys.readouterr().out


def test_cli_capture_with_profile_of_a_model_taking_a_constant(tmp_path, capsys):
    """hf models take use_cache=False (a constant of the bucket): --profile times every kernel anyway."""
    import json
    out = tmp_path / "g.tgraph"
    assert cli_main(["capture", "--model", "hf:tiny-llama", "--bucket", "decode:2", "--out", str(out),
                     "--profile", "cpu,cpu?threads=1"]) == 0
    assert "use_cache" in capsys.readouterr().out
    costs = json.loads((tmp_path / "g.costs.json").read_text())
    assert costs["devices"] == ["cpu", "cpu?threads=1"]
    from tessera_actors.graph import KernelGraph
    times = costs["times"]   # one row per kernel, a time per device
    assert len(times) == len(KernelGraph.load(str(out)).kernels)
    assert all(len(row) == 2 and all(t > 0 for t in row) for row in times)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_default_transformers_model_captured_by_inductor_with_default_regions(arch):
    """On a GPU: the inductor capture with the default regions (transformers'
    mask code reads the host between the layers: compiled as one graph)."""
    from tessera_actors.capture.inductor import capture_inductor
    from tessera_actors.check.inductor import soundness
    loaded = hf.load(f"hf:tiny-{arch}", dtype=torch.bfloat16, device="cuda", seed=0)
    inputs = user_inputs(loaded)
    res = capture_inductor(loaded.model, inputs)
    assert any(k.kind == "ptx" for k in res.graph.kernels)
    s = soundness(res, inputs, orders=20, device="cuda")
    assert s["program_order"]["equal"] and s["mismatches"] == 0, s
    with torch.no_grad():
        eager = [t for _, t in flatten_outputs(loaded.model(**inputs))]
    assert len(eager) == len(res.outputs)
    cos = torch.nn.functional.cosine_similarity(res.outputs[0].float().flatten(), eager[0].float().flatten(), dim=0)
    assert cos > 0.99


def test_hf_folders_load_their_weights_or_a_seeded_random_init(tmp_path):
    saved = hf.load("hf:tiny-qwen2", seed=3)
    saved.model.save_pretrained(str(tmp_path))
    again = hf.load(f"hf:{tmp_path}")                     # config.json + safetensors: from_pretrained
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert same(saved.model, again.model)
    (tmp_path / "model.safetensors").unlink()
    assert same(saved.model, hf.load(f"hf:{tmp_path}", seed=3).model)          # config only: random init, seeded
    assert not same(saved.model, hf.load(f"hf:{tmp_path}", seed=4).model)
    with pytest.raises(FileNotFoundError, match="hub is not used"):
        hf.load("hf:no/such/model")

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
    rows = {r["case"]: r for r in report.rows}
    assert rows["random orders (50)"]["mismatches"] == 0
    assert rows["random splits (3)"]["bitwise"] and rows["contiguous split"]["bitwise"]
    if loaded.kind == "causal-lm":
        assert report.info["output_names"][0] == "logits" and len(report.info["output_names"]) > 1  # + the cache
    else:
        assert report.info["output_names"] == ["last_hidden_state", "pooler_output"]


def test_smollm2_real_weights_in_transformers_llama_split_over_two_devices():
    from tessera_actors import models
    loaded = hf.load("hf:smollm2", layers=2)
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    inputs = loaded.example_inputs(batch=1, seq=6, seed=2)
    report = tessera_actors.check(loaded.model, inputs, orders=3, splits=2, planner="contiguous", verbose=False)
    assert report.ok, report.table()
    ours = models.get("smollm2", "tiny", dtype=torch.float32)  # the same GGUF through our own reader and model
    ids = inputs["input_ids"]
    with torch.no_grad():
        theirs = loaded.model(**inputs).logits
        mine = ours(input_ids=ids, positions=torch.arange(ids.shape[1])[None])
    assert torch.equal(theirs.argmax(-1), mine.argmax(-1))
    assert (theirs - mine).abs().max() < 1e-3


def test_cli_capture_of_a_config_file(tmp_path, capsys):
    hf.load("hf:tiny-qwen2").config.to_json_file(str(tmp_path / "config.json"))
    out = tmp_path / "g.tgraph"
    assert cli_main(["capture", "--model", f"hf:{tmp_path / 'config.json'}", "--bucket", "prefill:1:4",
                     "--out", str(out)]) == 0
    assert out.exists() and "kernels" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_default_transformers_model_captured_by_inductor_with_default_regions(arch):
    """On a GPU: the inductor capture with the default regions (transformers'
    mask code reads the host between the layers: compiled as one graph)."""
    from tessera_actors.capture.inductor import capture_inductor
    from tessera_actors.capture.inductor_check import soundness
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

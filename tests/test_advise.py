"""``tessera advise`` on small graphs: the --json format, the policies that
apply, and the budget recommendation."""
import gzip
import json

import msgpack
import pytest

from tessera_actors import advise, cli


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
    assert list(doc) == ["model", "gpus", "policies"]
    assert doc["model"] == "llama" and doc["gpus"] == ["A100", "L40S"]
    assert set(doc["policies"]) == set(advise.POLICIES)
    for v in doc["policies"].values():
        assert list(v) == ["tokens_per_s", "tokens_per_dollar"]
        assert all(isinstance(x, float) and x > 0 for x in v.values())
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

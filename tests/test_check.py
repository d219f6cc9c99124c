import pytest
"""tessera_actors.check: the public soundness check a user runs on a model."""
import json

import torch

import tessera_actors
from tessera_actors import models
from tessera_actors.cli import main as cli_main


@pytest.mark.parametrize("variants", ["1", "0"])
def test_check_passes_a_reference_model_and_reports_every_case(variants, monkeypatch):
    """Every replay bitwise equal to the single-device one; to the eager
    model bitwise with torch's plain kernels, and with the CPU's own
    variants (execution/variants.py) the same tokens at cosine >= 0.9999."""
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", variants)
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0)
    report = tessera_actors.check(m, m.example_inputs("decode", batch=2, pos=3), devices=["cpu", "cpu"],
                                  orders=20, splits=3, planner="contiguous", verbose=False)
    assert report.ok
    cases = [r["case"] for r in report.rows]
    assert cases[:3] == ["single-device", "random orders (20)", "random splits (3)"]
    assert "contiguous split" in cases
    for r in report.rows:
        assert {"case", "bitwise", "max_abs", "cosine", "tokens"} <= set(r)
        if r["reference"] != "eager" or variants == "0":
            assert r["bitwise"] and r["max_abs"] == 0
        else:
            assert r["tokens"] and r["cosine"] >= 0.9999
    split = next(r for r in report.rows if r["case"] == "contiguous split")
    assert min(split["kernels_per_device"]) > 0 and split["bytes_moved"] > 0
    assert "verdict: OK" in report.table()


class Counter(torch.nn.Module):
    """Not a function of its inputs: each call scales by how often it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.w * self.calls


def test_check_fails_a_model_whose_replay_differs_from_eager():
    report = tessera_actors.check(Counter(), {"x": torch.randn(2, 4)}, orders=2, splits=1,
                                  planner="contiguous", verbose=False)
    assert not report.ok
    bad = [r for r in report.rows if not r["ok"]]
    assert bad and all(r["reference"] == "eager" for r in bad) and bad[0]["max_abs"] > 0
    assert "verdict: FAILED" in report.table()


def test_cli_check_exits_zero_and_writes_the_rows(tmp_path, capsys):
    out = tmp_path / "check.json"
    rc = cli_main(["check", "--model", "mamba2", "--bucket", "decode:2", "--orders", "5", "--splits", "2",
                   "--planner", "contiguous", "--json", str(out)])
    assert rc == 0
    assert "verdict: OK" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["ok"] and len(data["rows"]) >= 4

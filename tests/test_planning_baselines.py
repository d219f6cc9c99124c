"""Baseline policies as plans, and the `tessera plan` command."""
import pytest

from tessera_actors.planning.baselines import (af_assignment, is_attention, layer_split_assignment,
                                               request_distribution, single_graph_baselines)
from tessera_actors.planning.cli import plan_command
from tessera_actors.planning.costs import CostTable
from tessera_actors.planning.planner import MilpPlanner
from tessera_actors.planning.synthetic import random_costs, transformer_graph
from tessera_actors.graph import Kernel

DEVS = ["cuda:0", "cuda:1?sms=32"]


def test_request_distribution_sums_replicas():
    g = transformer_graph(4, hidden=256, tokens=8)
    c = random_costs(g, DEVS, seed=1)
    rd = request_distribution(g, DEVS, c)
    speeds = [1 / c.device_total(d) for d in range(2)]
    assert rd.throughput == pytest.approx(sum(speeds))
    assert [p.meta["share"] for p in rd.plans] == pytest.approx([s / sum(speeds) for s in speeds])


def test_request_distribution_needs_a_whole_replica():
    g = transformer_graph(4, hidden=256, tokens=8)
    total = sum(b.nbytes for b in g.buffers.values())
    devs = [f"cuda:0?mem={total - 1}", "cuda:1?sms=32"]
    rd = request_distribution(g, devs, random_costs(g, devs))
    assert len(rd.plans) == 1 and rd.plans[0].name == "homo[cuda:1?sms=32]"
    assert "1 device(s) cannot hold a replica" in rd.note


def test_af_puts_attention_on_one_device():
    g = transformer_graph(3, hidden=256, tokens=8)
    a = af_assignment(g, 1, 0)
    for k in g.kernels:
        assert a[k.id] == (1 if ".self_attn." in k.scope else 0)
    assert is_attention(Kernel(0, "triton_per_fused__softmax_3"))
    assert not is_attention(Kernel(0, "triton_poi_fused_silu_mul_0"))


def test_layer_split_cuts_at_layer_boundaries_in_proportion():
    g = transformer_graph(8, hidden=256, tokens=8)
    c = random_costs(g, DEVS, seed=0)
    c = CostTable(DEVS, [[t, 3 * t] for t, _ in c.times], c.latency, c.bandwidth, c.mem)   # B 3x slower
    a = layer_split_assignment(g, c)
    cut = a.index(1)
    assert a == [0] * cut + [1] * (len(a) - cut)
    assert g.kernels[cut].layer != g.kernels[cut - 1].layer
    assert g.kernels[cut].layer == 6                # 6 of 8 layers on the 3x faster device


def test_baselines_are_legal_plans_with_predictions():
    g = transformer_graph(4, hidden=256, tokens=8)
    c = random_costs(g, DEVS, seed=2)
    names = []
    for b in single_graph_baselines(g, DEVS, c):
        names.append(b.name)
        assert b.throughput > 0 and b.step_s > 0
        for p in b.plans:
            assert p.predicted_step_s > 0
    assert names == ["homo[cuda:0]", "homo[cuda:1?sms=32]", "request-distribution", "af", "layer-split"]


def test_plan_command_prints_summary(tmp_path, capsys):
    g = transformer_graph(4, hidden=256, tokens=8)
    g.save(tmp_path / "m.tgraph")
    random_costs(g, DEVS, seed=5).save(tmp_path / "m.costs.json")
    rc = plan_command(str(tmp_path / "m.tgraph"), DEVS, "throughput", str(tmp_path / "t.png"), None)
    out, err = capsys.readouterr()
    assert rc == 0
    assert "costs: synthetic" in out and "request-distribution" in out and "cut RAW edges" in out
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "t.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib is not installed" in err


def test_plan_command_errors(tmp_path, capsys):
    g = transformer_graph(2, hidden=256, tokens=8)
    g.save(tmp_path / "m.tgraph")
    assert plan_command(str(tmp_path / "missing.tgraph"), DEVS, "latency", None, None) == 2
    assert plan_command(str(tmp_path / "m.tgraph"), ["cuda:0?mem=1KiB", "cpu?mem=1KiB"], "latency", None, None) == 1
    assert "short by" in capsys.readouterr().err


def test_planner_falls_back_to_a_better_baseline():
    """With communication made very expensive, no split pays: the throughput
    plan is a single device or a cheap layer split, never worse than them."""
    g = transformer_graph(4, hidden=256, tokens=8)
    c = random_costs(g, DEVS, seed=6)
    c.latency[0][1] = c.latency[1][0] = 1.0
    p = MilpPlanner(c).plan(g, DEVS, "throughput")
    best_homo = max(1 / c.device_total(d) for d in range(2))
    assert p.meta["predicted"]["throughput"] >= best_homo * (1 - 1e-9)

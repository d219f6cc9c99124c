"""Cost tables: estimates, profiles, save/load, device presets."""
import pytest

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.costs import PRESETS, CostTable, costs_path_for, device_model


def graph():
    bufs = {0: Buffer(0, 4096, "input"), 1: Buffer(1, 4096, "output")}
    return KernelGraph([Kernel(0, "gemm", accesses=(Access(0, 0, 4096, "r"), Access(1, 0, 4096, "w")),
                               flops=1e12, bytes=1e6),
                        Kernel(1, "copy", accesses=(Access(1, 0, 4096, "rw"),))], bufs)


def test_estimate_is_roofline_per_device():
    c = CostTable.estimate(graph(), ["cuda:0", "cuda:1?sms=32&mem=24GiB"])
    assert c.times[0][0] == pytest.approx(2.3e-6 + 1e12 / 789e12)
    assert c.times[0][1] == pytest.approx(2.3e-6 + 1e12 / 220e12)
    assert c.times[1][1] == pytest.approx(2.3e-6 + 8192 / 2.25e12)   # bytes from the accesses
    assert c.mem == [None, 24 * 2**30]
    assert c.comm_s(0, 1, 385e9) == pytest.approx(24e-6 + 1.0)
    assert c.comm_s(1, 1, 1e9) == 0.0


def test_partition_model_interpolates_and_is_never_faster():
    full = device_model("cuda:0")
    for sms in (8, 20, 32, 50, 66, 100):
        m = device_model(f"cuda:0?sms={sms}")
        assert m.flops_per_s <= full.flops_per_s and m.bytes_per_s <= full.bytes_per_s
    assert device_model("cuda:0?sms=32") == PRESETS["h200-sms32"]
    assert device_model("cpu").name == "cpu"


def test_profiles_and_round_trip(tmp_path):
    g = graph()
    c = CostTable.from_profiles(g, ["cpu", "cuda:0"], [[1e-3, 2e-3], [1e-4, 3e-4]],
                                links={(0, 1): (1e-5, 1e10)})
    assert c.times == [[1e-3, 1e-4], [2e-3, 3e-4]] and c.source == "profile"
    assert c.comm_s(0, 1, 1e10) == pytest.approx(1.00001)
    path = costs_path_for(tmp_path / "m.tgraph")
    assert path.name == "m.costs.json"
    c.save(path)
    d = CostTable.load(path)
    assert d == c


def test_bad_tables_are_errors(tmp_path):
    g = graph()
    with pytest.raises(PlanError, match="profile of cpu has 1 kernels"):
        CostTable.from_profiles(g, ["cpu"], [[1.0]])
    with pytest.raises(PlanError, match="unknown device model"):
        CostTable.estimate(g, ["cpu"], models=["tpu"])
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(PlanError, match="not a cost table|version"):
        CostTable.load(tmp_path / "x.json")

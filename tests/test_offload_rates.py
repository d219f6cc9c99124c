"""The offload step model's CPU rates on literal graphs: a CPU matmul costs
the rate measured at its rows (a decode batch of 8 is not a GEMV), past
the measured rows its flops, and the planner moves the CPU's share to
streaming where the CPU's many-row matmuls are slow."""
import pytest

from tessera_actors.graph import Access, Buffer, Kernel, KernelGraph
from tessera_actors.plan import PlanError
from tessera_actors.planning.offload import OffloadPlanner, estimate_rates, host_model
from tessera_actors.planning.offload.rates import rows_rates

OUT, IN = 2048, 4096          # each weight [OUT, IN] bf16 (16 MiB: launches do not matter)
WB = OUT * IN * 2             # its bytes
DEVS = [f"cuda:0?mem={4 * WB}", "cpu?threads=12"]
GEMV = 4e10                   # the CPU's one-row rate (bytes/s)


def matmuls(n: int, rows: int) -> KernelGraph:
    """x[rows, IN] -> mm(w0) -> ... : ``n`` matmuls of ``rows`` rows, weights ``w{i}``."""
    act = rows * IN * 2
    bufs = {0: Buffer(0, act, "input", dtype="bfloat16")}
    ks = []
    for i in range(n):
        bufs[1 + i] = Buffer(1 + i, act, "output" if i == n - 1 else "temp", dtype="bfloat16")
        bufs[100 + i] = Buffer(100 + i, WB, "weight", name=f"layers.{i}.w", dtype="bfloat16", shape=(OUT, IN))
        ks.append(Kernel(i, "mm", "library", (Access(i, 0, act, "r"), Access(100 + i, 0, WB, "r"),
                                                Access(1 + i, 0, act, "w")),
                         flops=2.0 * rows * OUT * IN, layer=i))
    return KernelGraph(ks, bufs, inputs={"x": 0}, outputs=[n])


def cpu_time(rows: int, **rates) -> float:
    return estimate_rates(matmuls(1, rows), DEVS, cpu_bps=GEMV, **rates).times[0][1]


def test_a_cpu_matmul_costs_the_rate_measured_at_its_rows():
    measured = {1: GEMV, 8: GEMV / 2}
    launch = host_model(12).launch_s
    assert cpu_time(1, cpu_rows_bps=measured) == pytest.approx(launch + WB / GEMV)
    # 8 rows took twice one row's time where they were measured; the roofline said (nearly) the same
    assert cpu_time(8, cpu_rows_bps=measured) == pytest.approx(launch + 2 * WB / GEMV)
    assert cpu_time(8) < 1.1 * cpu_time(1)
    # between measured rows: interpolated in log2(rows), 4 rows two thirds of the way from 1 to 8
    assert cpu_time(4, cpu_rows_bps=measured) == pytest.approx(launch + WB / GEMV * (1 / 3 + 2 / 3 * 2))


def test_past_the_rows_measured_a_cpu_matmul_costs_its_flops():
    measured = {1: GEMV, 8: GEMV}
    flops = 2.0 * 4096 * OUT * IN
    # 4096 rows at 1 TFLOP/s take longer than the weight at the 8-row rate: the flops decide
    assert cpu_time(4096, cpu_rows_bps=measured, cpu_flops=1e12) == pytest.approx(
        host_model(12).launch_s + flops / 1e12)
    # a faster measured GEMM rate makes them cheaper than the host roofline's 0.75 TFLOP/s
    assert cpu_time(4096, cpu_rows_bps=measured, cpu_flops=2e13) < cpu_time(4096) / 10


def test_a_slow_eight_row_cpu_matmul_moves_the_cpu_share_to_streaming():
    """The same batch-8 graph and budget: with the CPU's 8-row matmul
    measured at a quarter of its GEMV rate the plan computes less on the
    CPU and streams more, and predicts a longer step than the GEMV rate
    said."""
    g = matmuls(8, 8)
    pcie = GEMV   # PCIe as fast as the CPU's GEMV: at the GEMV rate they split the non-resident weights
    gemv = OffloadPlanner(pcie_bps=pcie, cpu_bps=GEMV, switch_s=1e-6).plan(g, DEVS)
    slow = OffloadPlanner(pcie_bps=pcie, cpu_bps=GEMV, cpu_rows_bps={1: GEMV, 8: GEMV / 4}, switch_s=1e-6).plan(g, DEVS)
    count = lambda plan, h: plan.meta["offload"]["choices"].count(h)   # noqa: E731
    assert count(gemv, "C") > count(slow, "C") and count(slow, "S") > count(gemv, "S")
    assert slow.predicted_step_s > gemv.predicted_step_s


def test_rows_rates_come_as_a_mapping_or_a_planner_option_string():
    assert rows_rates("1:3.6e10, 8:3e10") == {1: 3.6e10, 8: 3e10}
    assert rows_rates({8: 3e10, 1: 3.6e10}) == {1: 3.6e10, 8: 3e10}
    assert rows_rates(None) == {}
    for bad in ("1=3e10", "0:3e10", "8:-1"):
        with pytest.raises(PlanError, match="cpu_rows_bps"):
            rows_rates(bad)
    # --planner-option cpu_rows_bps=1:4e10,8:1e10 reaches the planner as that string
    g = matmuls(8, 8)
    a = OffloadPlanner(pcie_bps=GEMV, cpu_bps=GEMV, cpu_rows_bps="1:4e10,8:1e10").plan(g, DEVS)
    b = OffloadPlanner(pcie_bps=GEMV, cpu_bps=GEMV, cpu_rows_bps={1: 4e10, 8: 1e10}).plan(g, DEVS)
    assert a.predicted_step_s == b.predicted_step_s

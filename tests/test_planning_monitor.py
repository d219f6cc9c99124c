"""Monitor switching, with a fake clock."""
import pytest

from tessera_actors.planning.monitor import Monitor, MonitorError


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_initial_mode_is_latency_and_window_slides():
    clock = Clock()
    m = Monitor(window_s=0.3, beta=1.5, clock=clock)
    assert m.mode() == "latency" and m.ratio() is None
    m.record(latency_s=0.010, exec_s=0.010)            # ratio 1.0
    assert m.mode() == "latency"
    clock.t = 0.1
    m.record(latency_s=0.050, exec_s=0.010)            # (10+50)/(10+10) = 3.0
    assert m.ratio() == pytest.approx(3.0)
    assert m.mode() == "throughput"
    clock.t = 0.35                                     # first sample left the window
    assert m.ratio() == pytest.approx(5.0)
    clock.t = 0.45                                     # window empty: keep the mode
    assert m.ratio() is None and m.mode() == "throughput"
    m.record(latency_s=0.014, exec_s=0.010)            # 1.4 < 1.5
    assert m.mode() == "latency"


def test_ratio_at_beta_switches_to_throughput():
    clock = Clock()
    m = Monitor(beta=1.5, clock=clock)
    m.record(0.015, 0.010)
    assert m.mode() == "throughput"


def test_bad_parameters_are_errors():
    with pytest.raises(MonitorError):
        Monitor(window_s=0)
    with pytest.raises(MonitorError):
        Monitor(beta=-1)
    m = Monitor(clock=Clock())
    with pytest.raises(MonitorError):
        m.record(-1.0, 1.0)

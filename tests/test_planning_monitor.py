"""Monitor switching and the plan switcher's step contract, with a fake clock."""
import pytest

from tessera_actors.planning.monitor import Monitor, MonitorError, PlanSwitcher


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


def test_switch_waits_for_in_flight_steps():
    clock = Clock()
    mon = Monitor(clock=clock)
    sw = PlanSwitcher({"latency": "L", "throughput": "T"}, mon)
    a = sw.begin_step()
    b = sw.begin_step()
    assert (a.plan, b.plan, a.step, b.step) == ("L", "L", 0, 1)
    mon.record(0.1, 0.01)                              # overload -> throughput wanted
    assert sw.begin_step() is None                     # draining: two L steps in flight
    sw.end_step(a)
    assert sw.begin_step() is None
    sw.end_step(b)
    c = sw.begin_step()
    assert (c.plan, c.mode, c.step, sw.switches) == ("T", "throughput", 2, 1)
    sw.end_step(c)
    with pytest.raises(MonitorError, match="not in flight"):
        sw.end_step(c)


def test_every_request_is_served_once_across_switches():
    """An engine loop: requests queue, each step takes up to 4, the switcher
    flips plans under load; every request is completed exactly once."""
    clock = Clock()
    mon = Monitor(window_s=0.3, beta=1.5, clock=clock)
    sw = PlanSwitcher({"latency": "L", "throughput": "T"}, mon)
    queue = list(range(40))
    done: list[int] = []
    inflight = []
    modes = set()
    while queue or inflight:
        clock.t += 0.01
        ticket = sw.begin_step() if queue else None
        if ticket is not None:
            batch, queue[:] = queue[:4], queue[4:]
            inflight.append((ticket, batch))
            modes.add(ticket.mode)
        if inflight and (ticket is None or len(inflight) > 2):
            t, batch = inflight.pop(0)
            done.extend(batch)
            for _ in batch:
                mon.record(latency_s=0.05 if len(queue) > 12 else 0.01, exec_s=0.01)
            sw.end_step(t)
    assert sorted(done) == list(range(40)) and len(done) == 40
    assert modes == {"latency", "throughput"}

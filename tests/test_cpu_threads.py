"""``tessera serve``'s default CPU deployment (issue #33): the intra-op
thread count chosen from measured probe times, the line it prints, what
``engine.stats()`` reports, and explicit device flags left as they are.
The choice is tested on given times (no timing asserted); the probe itself
runs once, for its shape only."""
from __future__ import annotations

import argparse

import pytest

from tessera_actors.serving.cpu_threads import ThreadTimes, candidates, choose_threads, measure_threads
from tessera_actors.serving.flags import (add_serve_arguments, chosen_deployment, default_deployment, devices_line,
                                          engine_kwargs)


def _flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_candidates_are_every_core_all_but_one_half_and_one():
    assert candidates(1) == (1,)
    assert candidates(2) == (2, 1)
    assert candidates(16) == (16, 15, 8, 1)


def test_the_fewest_threads_within_the_margin_of_the_fastest_are_chosen():
    # the 2-core box at low load: one thread is faster at batch 1, two barely faster at 16 rows
    two_core = [ThreadTimes(2, 25.5, 81.2), ThreadTimes(1, 15.5, 88.2)]
    assert choose_threads(two_core).threads == 1
    # two threads faster at both batches by more than the margin: two
    assert choose_threads([ThreadTimes(2, 10.0, 40.0), ThreadTimes(1, 15.0, 80.0)]).threads == 2
    # a 16-core machine: all but one core within 25% of every core, leaving one to the serving loop
    many = [ThreadTimes(16, 10.0, 20.0), ThreadTimes(15, 10.4, 21.0), ThreadTimes(8, 12.0, 35.0),
            ThreadTimes(1, 20.0, 200.0)]
    assert choose_threads(many).threads == 15
    assert choose_threads(many, margin=0.0).threads == 16
    choice = choose_threads(two_core)
    assert "2: 25.5/81.2, 1: 15.5/88.2" in choice.why and choice.times == tuple(two_core)
    with pytest.raises(ValueError, match="no measured"):
        choose_threads([])


def test_the_default_deployment_is_one_cpu_device_at_the_chosen_count_and_says_why():
    asked = []

    def measure(counts):
        asked.append(counts)
        return [ThreadTimes(2, 25.5, 81.2), ThreadTimes(1, 15.5, 88.2)]
    chosen = default_deployment(cores=2, gpus=0, measure=measure)
    assert asked == [(2, 1)]
    assert chosen.devices == "cpu?threads=1"
    line = devices_line(chosen)
    assert line.startswith("tessera serve: devices cpu?threads=1 (2 CPU cores, no GPU: one device, 1 intra-op thread;")
    assert "2: 25.5/81.2, 1: 15.5/88.2" in line and "--devices cpu,cpu" in line and "\n" not in line
    # one core: nothing to measure
    assert default_deployment(cores=1, gpus=0, measure=measure).devices == "cpu?threads=1" and len(asked) == 1


def test_explicit_devices_and_nodes_are_never_overridden():
    for argv, key, value in ((["--devices", "cpu"], "devices", "cpu"),
                             (["--devices", "cpu,cpu?threads=2"], "devices", "cpu,cpu?threads=2"),
                             (["--nodes", "cpu;cpu?threads=1"], "nodes", ["cpu", "cpu?threads=1"])):
        a = _flags(*argv)
        assert chosen_deployment(a) is None
        kw = engine_kwargs(a)
        assert kw[key] == value and "devices_chosen" not in kw


async def test_the_chosen_deployment_reaches_the_engine_and_its_stats():
    from tessera_actors import AsyncEngine
    chosen = default_deployment(cores=2, gpus=0, measure=lambda counts: [ThreadTimes(n, 10.0, 40.0) for n in counts])
    kw = engine_kwargs(_flags("--size", "tiny"), None, chosen)
    assert kw["devices"] == "cpu?threads=1" and kw["devices_chosen"] == chosen.why
    eng = AsyncEngine(**kw)   # not started: stats() reports the configuration
    assert eng.stats()["devices_chosen"] == chosen.why


def test_the_probe_times_every_count_it_is_given():
    times = measure_threads((2, 1), budget_s=0.0, reps=1)   # one round
    assert [t.threads for t in times] == [2, 1]
    assert all(t.batch1_ms > 0 and t.batch16_ms > 0 for t in times)

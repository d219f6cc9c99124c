"""Node daemons launched by Ray: a two-node Ray cluster on loopback, started
and stopped here, serves SmolLM2 with ``ray=``; a daemon killed with SIGKILL
is restarted by Ray and re-admitted, and no stream loses a token."""
import asyncio
import os
import signal

import pytest

# before Ray is imported: every Ray address stays on loopback (Ray would otherwise
# advertise this host's external address, and nothing may reach the network here)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tessera_actors import AsyncEngine, SamplingParams  # noqa: E402
from tessera_actors.launch.ray import RayNodes  # noqa: E402
from tessera_actors.runtime.messages import GetStats  # noqa: E402
from tessera_actors.serving import EngineConfig  # noqa: E402

SMALL = dict(model="smollm2", size="tiny", max_model_len=512, decode_buckets=(1, 2, 4, 8), prefill_buckets=(16, 64))
PROMPTS = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(8)]
STORE = 100 * 2 ** 20   # object store bytes per Ray node: the CI machine has 2 cores and 24 GiB


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE,
                                                             "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=STORE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


async def _tokens(eng, prompt, params, seen=None):
    toks = []
    async for out in eng.generate(prompt, params):
        toks += out.token_ids
        if seen is not None:
            seen(len(toks))
    return toks


async def test_ray_daemons_serve_the_single_device_tokens_and_a_killed_one_is_restarted_and_readmitted(ray_cluster):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(devices="cpu", max_seqs=8, **SMALL) as single:
        reference = await asyncio.gather(*(_tokens(single, p, greedy) for p in PROMPTS))
    async with AsyncEngine(ray=ray_cluster.address, max_seqs=8, **SMALL) as eng:
        launcher = eng.deployment.launcher
        assert launcher.specs == ["cpu", "cpu"] and ray.is_initialized()
        # one daemon per Ray node (a strictly spread placement group): two hosts, two processes
        infos = [await a.info.remote() for a in launcher.actors]
        assert sorted(i.name for i in infos) == ["ray-cpu0", "ray-cpu1"]
        assert len(eng.deployment.node_endpoints()) == 2
        assert eng.stats()["placement"]["devices"] == ["cpu", "cpu"]

        started, counts = asyncio.Event(), [0] * len(PROMPTS)

        def seen(i):
            def note(n):
                counts[i] = n
                if min(counts) >= 4:
                    started.set()
            return note
        tasks = [asyncio.ensure_future(_tokens(eng, p, greedy, seen(i))) for i, p in enumerate(PROMPTS)]
        await asyncio.wait_for(started.wait(), 120)
        os.kill(infos[1].pid, signal.SIGKILL)
        during = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        assert during == reference, "a stream lost, repeated or changed a token across the SIGKILL"

        async with eng.placement_changed:   # Ray restarts the daemon; the engine places on it again
            await asyncio.wait_for(eng.placement_changed.wait_for(lambda: infos[1].endpoint not in (
                eps := eng.deployment.node_endpoints()) and len(eps) == 2), 180)
        back = await launcher.actors[1].info.remote()
        assert back.name == infos[1].name and back.pid != infos[1].pid
        assert back.endpoint in eng.deployment.node_endpoints()
        after = await asyncio.gather(*(_tokens(eng, p, greedy) for p in PROMPTS))
        stats = eng.stats()
    assert after == reference
    assert stats["recoveries"] == 1 and stats["placement"]["devices"] == ["cpu", "cpu"]
    assert not ray.is_initialized(), "the engine connected to Ray, so it disconnects when it stops"


def test_ray_settings_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="gpus"):
        RayNodes(gpus=-1)
    with pytest.raises(ValueError):
        RayNodes(cpu="tpu:0")
    with pytest.raises(ValueError, match="one"):
        EngineConfig(ray="auto", nodes=("cpu",))
    assert EngineConfig(ray="127.0.0.1:6379").ray == RayNodes(address="127.0.0.1:6379")


async def test_a_ray_cluster_without_what_was_asked_is_a_clear_error(ray_cluster):
    with pytest.raises(ValueError, match="GPU"):
        async with AsyncEngine(ray=RayNodes(address=ray_cluster.address, gpus=1), max_seqs=2, **SMALL):
            pass
    assert not ray.is_initialized()


async def test_ray_daemons_links_meet_in_the_rendezvous_the_engine_holds(ray_cluster):
    """``--data-plane dist`` under Ray: the cut edges' bytes go over gloo links between the two
    daemons, which rendezvous in the store the launcher holds, not in stores of their own."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(devices="cpu", max_seqs=2, **SMALL) as single:
        reference = await asyncio.gather(*(_tokens(single, p, greedy) for p in PROMPTS[:2]))
    async with AsyncEngine(ray=ray_cluster.address, max_seqs=2, node_args=("--data-plane", "dist"), **SMALL) as eng:
        got = await asyncio.gather(*(_tokens(eng, p, greedy) for p in PROMPTS[:2]))
        sent = 0
        for ep in eng.deployment.node_endpoints():
            ref = await eng.deployment.system.remote_ref(ep, "transfer")
            sent += (await ref.ask(GetStats(), timeout=10)).values["link_bytes_sent"]
        keys = eng.deployment.launcher.store.num_keys()
    assert got == reference
    assert sent > 0 and keys > 0

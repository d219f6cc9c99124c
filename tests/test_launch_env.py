"""Nodes started by Slurm or torchrun: ``tessera node --from-env slurm`` and
``--from-env torchrun`` with the variables a 2-task job sets, on loopback,
form the same cluster; the data plane's links meet in the launcher's
rendezvous store."""
import asyncio
import datetime
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from actors.links import LinkHub
from actors.scheduler import SchedulerActor
from tessera_actors.launch.env import LaunchEnvError, first_host, job_place
from tessera_actors.planning.registry import get_planner
from tessera_actors.runtime.messages import GetStats
from transport.system import ActorSystem
from transport import auth

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(launcher: str, rank: int, master_port: int, sched_port: int) -> dict:
    """What ``srun`` (two tasks on host ``localhost``) or torchrun (2 nodes x 1 process) set for ``rank``."""
    if launcher == "slurm":
        env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank),
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURMD_NODENAME": "localhost"}
    else:
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TESSERA_NODE_HOST": "127.0.0.1"}
    return {**env, "MASTER_PORT": str(master_port), "TESSERA_SCHEDULER_PORT": str(sched_port)}


async def _line(stream, needle: str, timeout: float = 120) -> str:
    async def read():
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise AssertionError(f"the node ended before printing {needle!r}")
            if needle in line:
                return line.strip()
    return await asyncio.wait_for(read(), timeout)


async def form_cluster(launcher: str) -> dict:
    """Two ``tessera node --from-env`` processes and a scheduler at the job's address:
    what the scheduler sees once both registered."""
    master_port, sched_port = free_port(), free_port()
    place = job_place(launcher, job_env(launcher, 0, master_port, sched_port))
    agent = None
    if place.agent_store:   # torchrun's agent holds the store at MASTER_ADDR:MASTER_PORT; here the test does
        agent = dist.TCPStore("127.0.0.1", master_port, is_master=True, wait_for_workers=False)
    keys = auth.process_keys()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    base.update(keys.env)
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH", "")]))
    procs = []
    async with ActorSystem("scheduler-host") as system:
        await system.spawn(SchedulerActor(get_planner("contiguous")), "scheduler")
        assert await system.listen(place.scheduler) == place.scheduler
        try:
            for rank in range(2):
                env = {**base, **job_env(launcher, rank, master_port, sched_port), "OMP_NUM_THREADS": "1"}
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "tessera_actors.cli", "node", "--from-env", launcher, "--devices", "cpu",
                    "--data-plane", "dist", "--log-level", "INFO", env=env,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
            ready = [await _line(p.stdout, "ready") for p in procs]
            for p in procs:
                await _line(p.stderr, "registered with scheduler")
            stats = (await system.ref("scheduler").ask(GetStats())).values
            # the data plane's rendezvous is at the launcher's MASTER_ADDR:MASTER_PORT (rank 0's or the agent's)
            probe = dist.TCPStore("127.0.0.1", master_port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=10))
            probe.set("probe", "1")
        finally:
            for p in procs:
                if p.returncode is None:
                    p.terminate()
            codes = [await asyncio.wait_for(p.wait(), 30) for p in procs]
    del agent
    return {"nodes": sorted(stats["nodes"]), "devices": stats["devices"], "ready": ready, "codes": codes,
            "hosts": sorted({ep.rpartition(":")[0] for ep in stats["endpoints"].values()}), "place": place}


async def test_slurm_and_torchrun_environments_form_the_same_two_node_cluster():
    slurm, torchrun = await form_cluster("slurm"), await form_cluster("torchrun")
    for c in (slurm, torchrun):
        assert c["nodes"] == ["node0", "node1"] and c["devices"] == ["cpu", "cpu"]
        assert c["hosts"] == ["tcp://127.0.0.1"] and c["codes"] == [0, 0]
        assert [line.split()[1] for line in c["ready"]] == ["node0", "node1"]
    assert slurm["place"].hosts_rendezvous and not torchrun["place"].hosts_rendezvous


def test_job_places_from_either_launcher_and_clear_errors():
    s = job_place("slurm", job_env("slurm", 1, 29500, 29501))
    t = job_place("torchrun", job_env("torchrun", 1, 29500, 29501))
    assert (s.node_name, s.scheduler, s.rendezvous) == (t.node_name, t.scheduler, t.rendezvous) == \
        ("node1", "tcp://127.0.0.1:29501", "127.0.0.1:29500")
    assert first_host("gpu[07-09,12],cpu1") == "gpu07" and first_host("a1,b2") == "a1"
    with pytest.raises(LaunchEnvError, match="SLURM_PROCID"):
        job_place("slurm", {"SLURM_NTASKS": "2"})
    with pytest.raises(LaunchEnvError, match="outside"):
        job_place("torchrun", {**job_env("torchrun", 0, 29500, 29501), "RANK": "2"})
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR"):
        job_place("torchrun", {"RANK": "0", "WORLD_SIZE": "1"})
    with pytest.raises(LaunchEnvError, match="different"):
        job_place("slurm", job_env("slurm", 0, 29500, 29500))


def test_links_of_two_nodes_meet_in_the_launchers_store_and_move_the_bytes():
    """Rank 0 hosts the store at the launcher's address; the sender's header names it, not a store of its own."""
    port = free_port()
    rendezvous = f"127.0.0.1:{port}"
    host, sender = LinkHub("127.0.0.1", 30, rendezvous, host_rendezvous=True), LinkHub("127.0.0.1", 30, rendezvous)
    receiver = LinkHub("127.0.0.1", 30)
    try:
        assert host.store_address == rendezvous   # rank 0 up first, as the transfer actor makes it at start
        got, sent = asyncio.Queue(), []
        loop = asyncio.new_event_loop()
        data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
        link, seq = sender.send("peer", "gloo", data, False, lambda t, err: sent.append(err))
        receiver.receive(link, seq, data.numel(), sender.store_address, "gloo", torch.device("cpu"),
                         lambda t, err: loop.call_soon_threadsafe(got.put_nowait, (t, err)))
        tensor, err = loop.run_until_complete(asyncio.wait_for(got.get(), 60))
        loop.close()
        assert err == "" and torch.equal(tensor, data) and sender.store_address == rendezvous
    finally:
        for hub in (sender, receiver, host):
            hub.close()

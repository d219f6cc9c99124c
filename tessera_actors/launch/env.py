"""Where a node daemon or the engine stands in a job that a launcher started:
``--from-env slurm`` (``srun``) or ``--from-env torchrun`` (torchrun, and the
Kubernetes operators that set the same variables).

The one place the launchers' environment variables are read.  Both give the
same :class:`JobPlace`, so the two launchers form the same cluster:

* rank ``r`` of ``world`` tasks is the node daemon named ``node<r>``;
* the scheduler (the engine: ``tessera serve --from-env ...``) listens at
  ``tcp://<master>:<scheduler port>`` on the first host;
* the data plane's links meet in one TCPStore at ``<master>:<master port>``
  (``--data-plane dist``): torchrun's own store when its agent hosts it
  (``TORCHELASTIC_USE_AGENT_STORE=True``), otherwise rank 0's node daemon
  hosts it.

Variables: Slurm ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``
(the first host, when ``MASTER_ADDR`` is unset), ``SLURMD_NODENAME`` (this
host); torchrun ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE``.  Either: ``MASTER_PORT`` (default 29500),
``TESSERA_SCHEDULER_PORT`` (default ``MASTER_PORT + 1``) and
``TESSERA_NODE_HOST`` (the address other hosts reach this one at; default:
this host's name, resolved).
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

LAUNCHERS = ("slurm", "torchrun")
DEFAULT_MASTER_PORT = 29500


class LaunchEnvError(ValueError):
    """The environment does not describe a job of the named launcher."""


@dataclass(frozen=True)
class JobPlace:
    """This process's place in a launched job (see the module docstring)."""
    launcher: str
    rank: int
    world: int
    master: str              # the first host's address
    master_port: int         # the data plane's rendezvous store
    scheduler_port: int
    host: str                # the address other hosts reach this one at
    agent_store: bool        # the launcher's agent hosts the store at master:master_port

    @property
    def node_name(self) -> str:
        return f"node{self.rank}"

    @property
    def scheduler(self) -> str:
        return f"tcp://{self.master}:{self.scheduler_port}"

    @property
    def rendezvous(self) -> str:
        return f"{self.master}:{self.master_port}"

    @property
    def hosts_rendezvous(self) -> bool:
        """Whether this process creates the rendezvous store (rank 0 when no agent holds it)."""
        return self.rank == 0 and not self.agent_store


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list (``gpu[01-04,07],cpu3`` -> ``gpu01``)."""
    m = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]*)\])?", nodelist or "")
    if not m:
        raise LaunchEnvError(f"SLURM_JOB_NODELIST {nodelist!r}: no host in it")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first:
        raise LaunchEnvError(f"SLURM_JOB_NODELIST {nodelist!r}: an empty range")
    return prefix + first


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    value = env.get(name, "")
    if not value.strip().isdigit():
        raise LaunchEnvError(f"--from-env {launcher}: {name} must be a non-negative integer, got {value!r} "
                             f"(is this process started by {'srun' if launcher == 'slurm' else 'torchrun'}?)")
    return int(value)


def _address(name: str) -> str:
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        raise LaunchEnvError(f"cannot resolve host {name!r}: {e}") from None


def job_place(launcher: str, env: Mapping[str, str] | None = None, engine: bool = False) -> JobPlace:
    """Read this process's :class:`JobPlace` from ``env`` (default: ``os.environ``);
    :class:`LaunchEnvError` names the variable that is missing or wrong.
    ``engine``: the place of ``tessera serve`` (no task of the job: rank 0 unless set)."""
    env = os.environ if env is None else env
    if engine:
        env = {"SLURM_PROCID": "0", "RANK": "0", **env}
    if launcher == "slurm":
        rank, world = _int(env, "SLURM_PROCID", launcher), _int(env, "SLURM_NTASKS", launcher)
        master = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", ""))
        here = env.get("SLURMD_NODENAME") or socket.gethostname()
        agent_store = False
    elif launcher == "torchrun":
        rank, world = _int(env, "RANK", launcher), _int(env, "WORLD_SIZE", launcher)
        master = env.get("MASTER_ADDR", "")
        if not master:
            raise LaunchEnvError("--from-env torchrun: MASTER_ADDR is not set")
        here = socket.gethostname()
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    else:
        raise LaunchEnvError(f"--from-env {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    if not 0 <= rank < world:
        raise LaunchEnvError(f"--from-env {launcher}: rank {rank} is outside a world of {world}")
    port = _int(env, "MASTER_PORT", launcher) if env.get("MASTER_PORT") else DEFAULT_MASTER_PORT
    sched = _int(env, "TESSERA_SCHEDULER_PORT", launcher) if env.get("TESSERA_SCHEDULER_PORT") else port + 1
    if not (0 < port < 65536 and 0 < sched < 65536) or port == sched:
        raise LaunchEnvError(f"--from-env {launcher}: ports {port} (MASTER_PORT) and {sched} "
                             f"(TESSERA_SCHEDULER_PORT) must be two different ports")
    host = env.get("TESSERA_NODE_HOST") or _address(here)
    return JobPlace(launcher, rank, world, _address(master), port, sched, host, agent_store)

"""How a node moves bytes to other processes: its data-plane configuration.

Torch-free (unlike :mod:`actors.transfer`), so a node's flags parse, and its
``--help`` prints, without importing torch."""
from __future__ import annotations

from dataclasses import dataclass

from tessera_actors.execution.spans import DEFAULT_SPAN_BYTES

DATA_PLANES = ("zmq", "dist")


@dataclass
class TransferConfig:
    """How a node moves bytes to other processes (node flags ``--data-plane``,
    ``--span-bytes``, ``--dist-host``, ``--link-timeout``, ``--dist-rendezvous``).
    ``rendezvous``: ``host:port`` of one TCPStore that every node's links meet
    in (a launcher's: torchrun's, or the one its rank 0 or the Ray driver
    hosts); empty: each sending node hosts its own on ``dist_host``.
    ``host_rendezvous``: this node creates that store when it starts."""
    data_plane: str = "zmq"
    span_bytes: int = DEFAULT_SPAN_BYTES     # 0: never split
    dist_host: str = "127.0.0.1"             # address peers reach this node's links at
    link_timeout_s: float = 60.0             # connecting a link, and each operation on it
    rendezvous: str = ""
    host_rendezvous: bool = False

    def __post_init__(self) -> None:
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"--data-plane {self.data_plane!r}: expected one of {', '.join(DATA_PLANES)}")
        if self.span_bytes < 0:
            raise ValueError("--span-bytes must be 0 (never split) or positive")
        if self.link_timeout_s <= 0:
            raise ValueError("--link-timeout must be positive")
        if not self.dist_host:
            raise ValueError("--dist-host must name this node's address")
        host, _, port = self.rendezvous.rpartition(":")
        if self.rendezvous and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"--dist-rendezvous {self.rendezvous!r}: expected HOST:PORT")
        if self.host_rendezvous and not self.rendezvous:
            raise ValueError("hosting the rendezvous needs its address (--dist-rendezvous HOST:PORT)")

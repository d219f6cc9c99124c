"""The graph actor: holds one captured KernelGraph and hands it out.

It owns the graph (nobody else keeps a mutable copy); ``GetGraph`` answers
with its msgpack bytes (encoded once) and a summary."""
from __future__ import annotations

import msgpack

from tessera_actors.actor import Actor, handler
from tessera_actors.graph import KernelGraph
from tessera_actors.messages import GetGraph, GraphBlob


class GraphActor(Actor):
    def __init__(self, graph: KernelGraph) -> None:
        self.graph = graph
        self._blob: bytes | None = None

    @handler(GetGraph)
    def get(self, msg: GetGraph) -> GraphBlob:
        if self._blob is None:
            self._blob = msgpack.packb(self.graph.to_dict(), use_bin_type=True)
        return GraphBlob(self._blob, self.graph.summary())

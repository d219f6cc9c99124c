"""The graph actor: holds the captured KernelGraphs of a deployment and hands
them out.

It owns the graphs (nobody else keeps a mutable copy), keyed by name (a
served model has one graph per shape bucket, e.g. ``decode:8@0``,
``prefill:128``); ``GetGraph(name)`` answers with that graph's msgpack bytes
(encoded once) and a summary; an unknown name is an error reply."""
from __future__ import annotations

from typing import Mapping

import msgpack

from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.graph import KernelGraph
from tessera_actors.runtime.messages import GetGraph, GraphBlob


class GraphActor(Actor):
    def __init__(self, graphs: KernelGraph | Mapping[str, KernelGraph]) -> None:
        """One graph (named "") or several by name; the first is the default."""
        self.graphs = dict(graphs) if isinstance(graphs, Mapping) else {"": graphs}
        if not self.graphs:
            raise ValueError("the graph actor needs at least one graph")
        self._blobs: dict[str, bytes] = {}

    @handler(GetGraph)
    def get(self, msg: GetGraph) -> GraphBlob:
        name = msg.name or next(iter(self.graphs))
        graph = self.graphs.get(name)
        if graph is None:
            raise KeyError(f"no graph {name!r}; known: {sorted(self.graphs)}")
        if name not in self._blobs:
            self._blobs[name] = msgpack.packb(graph.to_dict(), use_bin_type=True)
        return GraphBlob(self._blobs[name], graph.summary())

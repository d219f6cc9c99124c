"""The graph actor: holds the captured KernelGraphs of a deployment and hands
them out.

It owns the graphs (nobody else keeps a mutable copy), keyed by name (a
served model has one graph per shape bucket, e.g. ``decode:8@0``,
``prefill:128``); ``GetGraph(name)`` answers with that graph's msgpack bytes
(encoded once) and a summary, or to an asker of this process
(``objects``) with the graph itself; an unknown name is an error reply.  With a
``source`` (a served model's buckets, captured on first use) a name it does
not hold yet is asked of the source, in a thread, and kept."""
from __future__ import annotations

import asyncio
from typing import Callable, Mapping

import msgpack

from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.graph import KernelGraph
from tessera_actors.runtime.messages import GetGraph, GraphBlob


class GraphActor(Actor):
    def __init__(self, graphs: KernelGraph | Mapping[str, KernelGraph],
                 source: Callable[[str], KernelGraph] | None = None) -> None:
        """One graph (named "") or several by name; the first is the default.
        ``source(name)``: the graph of a name not held yet (blocking; raises
        ``KeyError`` for a name it does not know)."""
        self.graphs = dict(graphs) if isinstance(graphs, Mapping) else {"": graphs}
        if not self.graphs:
            raise ValueError("the graph actor needs at least one graph")
        self.source = source
        self._blobs: dict[str, bytes] = {}

    @handler(GetGraph)
    async def get(self, msg: GetGraph) -> GraphBlob:
        name = msg.name or next(iter(self.graphs))
        graph = self.graphs.get(name)
        if graph is None and self.source is not None:
            graph = self.graphs[name] = await asyncio.to_thread(self.source, name)
        if graph is None:
            raise KeyError(f"no graph {name!r}; known: {sorted(self.graphs)}")
        if msg.objects:   # an asker in this process: the graph itself, nothing encoded
            return GraphBlob(b"", graph.summary(), graph)
        if name not in self._blobs:
            self._blobs[name] = msgpack.packb(graph.to_dict(), use_bin_type=True)
        return GraphBlob(self._blobs[name], graph.summary())

"""tessera-actors: kernel-granularity disaggregated inference as an asyncio actor system.

``from tessera_actors import AsyncEngine, SamplingParams`` is the embedding API
(see ``tessera_actors.serving``)."""


def __getattr__(name):
    if name in ("AsyncEngine", "SamplingParams", "EngineConfig", "RequestOutput"):
        from . import serving
        return getattr(serving, name)
    raise AttributeError(name)


__all__ = ["AsyncEngine", "EngineConfig", "RequestOutput", "SamplingParams"]

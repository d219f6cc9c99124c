"""tessera-actors: kernel-granularity disaggregated inference as an asyncio actor system.

``from tessera_actors import AsyncEngine, SamplingParams`` is the embedding API
(see ``tessera_actors.serving``); ``tessera_actors.check(model, inputs,
devices=[...])`` checks a model's captured program (see
:mod:`tessera_actors.check`).  Importing the package is torch-free."""


def __getattr__(name):
    if name in ("AsyncEngine", "SamplingParams", "EngineConfig", "RequestOutput"):
        from tessera_actors import serving
        return getattr(serving, name)
    if name == "check":  # the module is callable: tessera_actors.check(model, inputs, ...)
        import importlib
        return importlib.import_module(".check", __name__)
    raise AttributeError(name)


__all__ = ["AsyncEngine", "EngineConfig", "RequestOutput", "SamplingParams", "check"]

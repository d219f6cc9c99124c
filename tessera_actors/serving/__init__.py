"""Serving: the continuous-batching engine and what it needs (sampling,
tokenizer and chat template, bucket deployment)."""
from tessera_actors.serving.config import EngineConfig
from tessera_actors.serving.params import (EngineBusy, EngineDead, EngineError, InvalidRequest, RequestOutput, SamplingParams, Usage)


def __getattr__(name):   # the engine pulls in torch and the actors: load it on first use
    if name == "AsyncEngine":
        from tessera_actors.serving.engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)


__all__ = ["AsyncEngine", "EngineBusy", "EngineConfig", "EngineDead", "EngineError", "InvalidRequest",
           "RequestOutput", "SamplingParams", "Usage"]

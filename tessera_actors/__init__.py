"""tessera-actors: kernel-granularity disaggregated inference (see README.md).

Importing the package is torch-free; ``tessera_actors.check(model, inputs,
devices=[...])`` (see :mod:`tessera_actors.check`) loads torch when called."""


def __getattr__(name: str):
    if name == "check":
        import importlib
        return importlib.import_module(".check", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

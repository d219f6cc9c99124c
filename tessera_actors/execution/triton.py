"""Run kernels recorded by the inductor capture (CUDA) on one torch device.

:class:`TritonProgram` is an :class:`~tessera_actors.execution.program.AtenProgram` (same
arena: one flat uint8 tensor per buffer) that also binds ``ptx`` kernels: it
obtains the kernel's inductor ``CachingAutotuner`` - the live one when the
capture ran in this process, else one re-created from the generated module
file (or from the source stored in the graph when the file is gone), pinned
to the captured config - and launches it on the device's current stream with
views into the arena. ``library`` kernels go through the aten path.
Blocking: launches are asynchronous on the stream; nothing here syncs.
"""
from __future__ import annotations

from typing import Callable

import torch

from tessera_actors.capture import inductor_hooks as hooks
from tessera_actors.capture.inductor_match import triton_source

from tessera_actors.execution.allow import check_triton_record
from tessera_actors.execution.program import AtenProgram, BackendError


class TritonProgram(AtenProgram):
    def _bind(self, kid: int) -> Callable[[], None]:
        k = self.graph.kernels[kid]
        if k.kind != "ptx":
            return super()._bind(kid)
        p = k.payload
        if not isinstance(p, dict) or "triton" not in p:
            raise BackendError(f"kernel {kid} ({k.name}): payload is not a Triton launch record")
        source = triton_source(self.graph, p.get("key", ""))
        file = check_triton_record(p, bool(source))
        if self.device.type != "cuda":
            raise BackendError(f"kernel {kid} ({k.name}) is a Triton kernel: it needs a CUDA device, "
                               f"not {self.device}")
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        args = [self._arg(a) for a in p["args"]]
        kwargs = {n: self._arg(v) for n, v in (p.get("kwargs") or {}).items()}
        loaded: list = []

        def tuner():
            # chosen at the first launch: a partition's kernels are loaded into its green context
            from tessera_actors.execution.backends.cuda import current_green
            green = current_green()
            try:
                loaded.append(hooks.load_autotuner(file, p["triton"], source, p.get("config") or {},
                                                   device=index, context=green))
            except Exception as e:
                raise BackendError(f"kernel {kid} ({k.name}): cannot load the Triton kernel: {e}") from e
            return loaded[0]

        def launch() -> None:
            t = loaded[0] if loaded else tuner()
            try:
                t.run(*args, stream=torch.cuda.current_stream(index).cuda_stream, **kwargs)
            except RuntimeError as e:
                if "invalid resource handle" in str(e):
                    raise BackendError(f"kernel {kid} ({k.name}) was loaded for another CUDA context than the "
                                       f"stream it is launched on (first run a partition's kernels inside its "
                                       f"backend's scope()): {e}") from e
                raise
        return launch

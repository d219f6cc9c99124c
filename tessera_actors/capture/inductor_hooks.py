"""Every coupling to torch inductor / Triton internals lives here.

Checked against torch 2.11 (GPU machines) and 2.13 (CPU machines); all
attribute access is tolerant (``getattr`` with defaults) and every entry
point reports what it found, so a version drift shows up as a clear message
(or a pinned kernel), never as a silently wrong graph.

* :func:`run_hook` patches ``CachingAutotuner.run`` (the launcher entry the
  generated wrapper calls for every Triton kernel) for the duration of a
  ``with`` block.
* :func:`kernel_info` / :func:`launch_info` read a tuner's static metadata and
  the launcher chosen after autotuning (config, PTX text).
* :func:`load_autotuner` re-creates a tuner from its generated source for
  replay in another process, pinned to the captured config.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import re
import sys
from typing import Any, Callable, Iterator

log = logging.getLogger("tessera.capture.inductor")


class HookError(RuntimeError):
    """Inductor's runtime does not look like the versions this module knows."""


def autotuner_class():
    try:
        from torch._inductor.runtime import triton_heuristics as th
    except Exception as e:  # no triton, or a moved module
        raise HookError(f"cannot import torch._inductor.runtime.triton_heuristics: {e}") from e
    cls = getattr(th, "CachingAutotuner", None)
    if cls is None or not callable(getattr(cls, "run", None)):
        raise HookError("torch._inductor.runtime.triton_heuristics.CachingAutotuner.run not found")
    return cls


@contextlib.contextmanager
def run_hook(on_launch: Callable[[Any, tuple, dict, Callable[[], Any]], Any]) -> Iterator[None]:
    """While active, every outermost ``CachingAutotuner.run(*args, **kw)`` goes
    to ``on_launch(tuner, args, kwargs, call)`` where ``call()`` launches the
    kernel and returns its result. Nested calls (subclasses calling
    ``super().run``) launch without being reported twice."""
    cls = autotuner_class()
    orig = cls.__dict__["run"]
    depth = [0]

    def run(self, *args, **kwargs):
        if depth[0]:
            return orig(self, *args, **kwargs)
        depth[0] += 1
        try:
            return on_launch(self, args, kwargs, lambda: orig(self, *args, **kwargs))
        finally:
            depth[0] -= 1

    cls.run = run
    log.info("hooked %s.%s.run", cls.__module__, cls.__qualname__)
    try:
        yield
    finally:
        cls.run = orig


def kernel_name(tuner: Any) -> str:
    fn = getattr(tuner, "fn", None)
    for cand in (getattr(fn, "__name__", None), getattr(getattr(fn, "fn", None), "__name__", None),
                 (getattr(tuner, "inductor_meta", None) or {}).get("kernel_name")):
        if cand:
            return str(cand)
    return "triton_unknown"


def arg_names(tuner: Any) -> list[str]:
    sig = (getattr(tuner, "triton_meta", None) or {}).get("signature")
    if isinstance(sig, dict) and sig:
        return [str(k) for k in sig]
    names = getattr(getattr(tuner, "fn", None), "arg_names", None)
    return [str(n) for n in names] if names else []


def kernel_info(tuner: Any) -> dict[str, Any]:
    """Static facts: name, generated source file, parameter names/types,
    mutated arguments, heuristic kind."""
    tmeta = getattr(tuner, "triton_meta", None) or {}
    imeta = getattr(tuner, "inductor_meta", None) or {}
    sig = tmeta.get("signature") if isinstance(tmeta.get("signature"), dict) else {}
    mutated = set(getattr(tuner, "mutated_arg_names", None) or imeta.get("mutated_arg_names") or [])
    filename = getattr(tuner, "filename", None)
    if not filename:
        fn = getattr(getattr(tuner, "fn", None), "fn", None)
        filename = getattr(getattr(fn, "__code__", None), "co_filename", None)
    return {"name": kernel_name(tuner), "file": filename or "", "arg_names": arg_names(tuner),
            "types": {str(k): str(v) for k, v in sig.items()}, "mutated": sorted(mutated),
            "heuristic": str(getattr(tuner, "heuristic_type", "")),
            "deterministic": bool(imeta.get("are_deterministic_algorithms_enabled", False))}


def config_dict(cfg: Any) -> dict[str, Any]:
    out = {"kwargs": {str(k): v for k, v in (getattr(cfg, "kwargs", None) or {}).items()
                      if isinstance(v, (int, float, bool, str))}}
    for k in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
        v = getattr(cfg, k, None)
        if isinstance(v, (int, float)):
            out[k] = v
    return out


def chosen_launcher(tuner: Any) -> Any:
    launchers = getattr(tuner, "launchers", None) or []
    return launchers[0] if len(launchers) == 1 else None


def launch_info(tuner: Any) -> dict[str, Any]:
    """After a run: the winning config and the kernel's PTX (+ where it came from)."""
    launcher = chosen_launcher(tuner)
    info: dict[str, Any] = {"config": {}, "ptx": None, "ptx_source": "", "shared": None}
    if launcher is None:
        info["ptx_source"] = f"tuner has {len(getattr(tuner, 'launchers', []) or [])} launchers, expected 1"
        return info
    cfg = getattr(launcher, "config", None)
    info["config"] = config_dict(cfg)
    info["shared"] = getattr(launcher, "shared", None)
    text, src = find_ptx(tuner, launcher, cfg)
    info["ptx"], info["ptx_source"] = text, src
    return info


def _same_config(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return a is not None and b is not None and config_dict(a) == config_dict(b)


def find_ptx(tuner: Any, launcher: Any, cfg: Any) -> tuple[str | None, str]:
    """PTX text of the launcher's binary, trying (1) the compiled kernel's
    ``asm['ptx']``, (2) the ``.ptx`` next to a static launcher's cubin, (3) the
    Triton cache directory named by the launcher's cache hash."""
    name = kernel_name(tuner)
    kernels = []
    for res in getattr(tuner, "compile_results", None) or []:
        if _same_config(getattr(res, "config", None), cfg):
            kernels.append(getattr(res, "kernel", None))
    kernels.append(getattr(launcher, "bin", None))
    for k in kernels:
        try:
            text = getattr(k, "asm", {})["ptx"]
        except Exception:
            text = None
        if text:
            return (text.decode() if isinstance(text, bytes) else str(text)), "compiled kernel asm"
    for k in kernels:
        for attr in ("cubin_path", "_cubin_path"):
            path = getattr(k, attr, None)
            if path:
                ptx = os.path.splitext(str(path))[0] + ".ptx"
                if os.path.exists(ptx):
                    return _read(ptx), f"file next to cubin {ptx}"
    key = getattr(launcher, "cache_hash", None)
    if key:
        for d in triton_cache_dirs():
            hits = glob.glob(os.path.join(d, "**", str(key), "*.ptx"), recursive=True)
            hits = [h for h in hits if os.path.basename(h).startswith(name)] or hits
            if hits:
                return _read(hits[0]), f"triton cache {hits[0]}"
    return None, f"no PTX found (compile results {len(kernels) - 1}, cache key {key})"


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def triton_cache_dirs() -> list[str]:
    dirs = [os.environ.get("TRITON_CACHE_DIR")]
    try:
        import triton
        dirs.append(getattr(getattr(getattr(triton, "knobs", None), "cache", None), "dir", None))
    except Exception:
        pass
    try:
        from torch._inductor.runtime.runtime_utils import triton_cache_dir
        dirs.append(triton_cache_dir(0))
    except Exception:
        pass
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        dirs.append(os.path.join(cache_dir(), "triton"))
    except Exception:
        pass
    dirs.append(os.path.join(os.path.expanduser("~"), ".triton", "cache"))
    seen, out = set(), []
    for d in dirs:
        if d and d not in seen and os.path.isdir(d):
            seen.add(d)
            out.append(d)
    return out


# -- replay ---------------------------------------------------------------
_LIVE: dict[tuple[str, str], Any] = {}   # (file, name) -> tuner seen in this process
_LOADED: dict[tuple[str, str, str], Any] = {}


def remember(tuner: Any) -> None:
    info = kernel_info(tuner)
    _LIVE[(info["file"], info["name"])] = tuner


def tuner_device(tuner: Any) -> int | None:
    """The CUDA device index a tuner's kernels are compiled and loaded for."""
    props = getattr(tuner, "device_props", None)          # inductor's CachingAutotuner
    if getattr(props, "index", None) is not None:
        return int(props.index)
    dev = (getattr(tuner, "triton_meta", None) or {}).get("device")   # an index, or DeviceProperties
    dev = getattr(dev, "index", dev)
    return int(dev) if isinstance(dev, int) else None


_DEVICE_PROPS = re.compile(r"(DeviceProperties\(type='cuda', index=)(\d+)")


def retarget_source(source: str, index: int) -> str:
    """The generated module's source with its kernels bound to CUDA device
    ``index``: a Triton kernel module is loaded into one device's context, so
    replaying a kernel captured on ``cuda:0`` on ``cuda:1`` needs its own
    module (launching device 0's function handle there is an invalid handle)."""
    new, n = _DEVICE_PROPS.subn(lambda m: f"{m.group(1)}{index}", source)
    if not n:
        raise HookError("the generated kernel module names no CUDA device (DeviceProperties) to retarget")
    return new


def load_autotuner(file: str, name: str, source: str | None, config: dict[str, Any],
                   device: int | None = None, context: Any = None) -> Any:
    """A tuner that launches kernel ``name`` with the captured ``config`` on
    CUDA device ``device`` (default: the capture's): the live one of this
    process if the capture ran here on that device, else one re-created from
    the generated source (``file``, or ``source`` when the file is gone).
    ``context``: a green context current while this is called - the tuner
    is then a private copy, compiled now with Triton's own launcher, which
    loads the kernel into the current (green) context; inductor's static
    launcher would load it into the device's primary context, whose kernels
    a green context's streams cannot launch."""
    live = _LIVE.get((file, name))
    if live is not None and context is None and device in (None, tuner_device(live)):
        return live
    key = (file, name, repr(sorted(config.get("kwargs", {}).items())) + str(config.get("num_warps")), device,
           None if context is None else id(context))
    if key in _LOADED:
        return _LOADED[key][0]
    mod = _import_source(file, source)
    tuner = getattr(mod, name, None)
    if tuner is None or not callable(getattr(tuner, "run", None)):
        raise HookError(f"{file}: no Triton kernel {name!r} in the generated module")
    if context is not None or (device is not None and tuner_device(tuner) != device):
        text = _read_text(file) if file and os.path.exists(file) else source
        if not text:
            raise HookError(f"kernel {name!r} was captured on cuda:{tuner_device(tuner)}; no source to "
                            f"rebuild it for cuda:{device}")
        from torch._inductor.codecache import PyCodeCache
        if device is not None:
            text = retarget_source(text, device)
        if context is not None:   # a distinct module: PyCodeCache keeps one per source text
            text += f"\n# tessera: private copy for context {id(context):#x}\n"
        tuner = getattr(PyCodeCache.load(text), name)
    _pin_config(tuner, config)
    if context is not None:
        with _no_static_launcher():
            tuner.precompile()
    _LOADED[key] = (tuner, context)   # the context is kept alive with its kernels
    return tuner


@contextlib.contextmanager
def _no_static_launcher() -> Iterator[None]:
    import torch._inductor.config as icfg
    names = [n for n in ("use_static_triton_launcher", "use_static_cuda_launcher") if hasattr(icfg, n)]
    old = {n: getattr(icfg, n) for n in names}
    try:
        for n in names:
            setattr(icfg, n, False)
        yield
    finally:
        for n, v in old.items():
            setattr(icfg, n, v)


def _read_text(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _import_source(file: str, source: str | None):
    if file and os.path.exists(file):
        modname = "tessera_triton_" + os.path.splitext(os.path.basename(file))[0]
        if modname in sys.modules:
            return sys.modules[modname]
        spec = importlib.util.spec_from_file_location(modname, file)
        if spec is None or spec.loader is None:
            raise HookError(f"cannot import generated kernel module {file}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
        return mod
    if not source:
        raise HookError(f"generated kernel module {file!r} is gone and the graph carries no source")
    from torch._inductor.codecache import PyCodeCache
    return PyCodeCache.load(source)


def _pin_config(tuner: Any, config: dict[str, Any]) -> None:
    configs = list(getattr(tuner, "configs", None) or [])
    match = [c for c in configs if config_dict(c).get("kwargs") == config.get("kwargs")
             and config_dict(c).get("num_warps") == config.get("num_warps")
             and config_dict(c).get("num_stages") == config.get("num_stages")]
    if match:
        tuner.configs = match[:1]
    elif configs and config.get("kwargs"):
        try:  # the winner came from coordinate descent: build it
            from torch._inductor.runtime.triton_compat import Config
            tuner.configs = [Config(dict(config["kwargs"]), num_warps=config.get("num_warps", 4),
                                    num_stages=config.get("num_stages", 1))]
        except Exception as e:
            log.warning("%s: cannot pin config %s (%s); autotuning may pick another one",
                        kernel_name(tuner), config, e)

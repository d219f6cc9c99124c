"""Device specifications: ``cpu``, ``cpu?threads=1``,
``cpu?threads=1&prefill_threads=2``, ``cuda:0``,
``cuda:1?sms=32&mem=24GiB&price=1.2&label=H200-32``.

Pure Python. A spec names a device and its limits; the device backends
(`tessera_actors/execution/backends`) turn it into streams and memory."""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_KEYS = {"sms", "threads", "mem", "price", "label", "slow", "prefill_threads"}


class DeviceSpecError(ValueError):
    """A device string that cannot be parsed."""


def parse_bytes(text: str) -> int:
    """``24GiB`` -> 25769803776; plain integers are bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise DeviceSpecError(f"cannot read a byte size from {text!r} (e.g. 24GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class DeviceSpec:
    kind: str                  # "cpu" | "cuda"
    index: int = 0
    sms: int | None = None     # SM limit through a green context (cuda only)
    threads: int | None = None # intra-op threads (cpu only)
    mem: int | None = None     # memory budget in bytes enforced by the allocator; None = physical
    price: float = 1.0         # $/hour, for cost efficiency
    label: str = ""
    slow: float = 1.0          # throttle: every run takes this many times as long (load-aware planning tests)
    prefill_threads: int | None = None   # intra-op threads of steps of PREFILL_TOKENS+ tokens (cpu only)

    @classmethod
    def parse(cls, text: str) -> "DeviceSpec":
        base, _, query = text.strip().partition("?")
        m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", base)
        if not m:
            raise DeviceSpecError(f"unknown device {text!r}: expected cpu, cpu?threads=N, cuda:I or cuda:I?sms=N&mem=24GiB")
        kind, index = m.group(1), int(m.group(2) or 0)
        opts = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False)) if query else {}
        unknown = set(opts) - _KEYS
        if unknown:
            raise DeviceSpecError(f"device {text!r}: unknown option(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
        try:
            sms = int(opts["sms"]) if "sms" in opts else None
            threads = int(opts["threads"]) if "threads" in opts else None
            prefill_threads = int(opts["prefill_threads"]) if "prefill_threads" in opts else None
            price = float(opts.get("price", 1.0))
            slow = float(opts.get("slow", 1.0))
        except ValueError as e:
            raise DeviceSpecError(f"device {text!r}: {e}") from e
        if sms is not None and (kind != "cuda" or sms <= 0):
            raise DeviceSpecError(f"device {text!r}: sms= needs a cuda device and a positive count")
        if threads is not None and (kind != "cpu" or threads <= 0):
            raise DeviceSpecError(f"device {text!r}: threads= needs a cpu device and a positive count")
        if prefill_threads is not None and (kind != "cpu" or prefill_threads <= 0):
            raise DeviceSpecError(f"device {text!r}: prefill_threads= needs a cpu device and a positive count")
        if slow < 1.0:
            raise DeviceSpecError(f"device {text!r}: slow= must be >= 1")
        mem = parse_bytes(opts["mem"]) if "mem" in opts else None
        return cls(kind, index, sms, threads, mem, price, opts.get("label", ""), slow, prefill_threads)

    @property
    def name(self) -> str:
        """Canonical string; ``DeviceSpec.parse(spec.name) == spec``."""
        base = "cpu" if self.kind == "cpu" and self.index == 0 else f"{self.kind}:{self.index}"
        opts = []
        if self.sms is not None:
            opts.append(f"sms={self.sms}")
        if self.threads is not None:
            opts.append(f"threads={self.threads}")
        if self.prefill_threads is not None:
            opts.append(f"prefill_threads={self.prefill_threads}")
        if self.mem is not None:
            opts.append(f"mem={self.mem}")
        if self.price != 1.0:
            opts.append(f"price={self.price:g}")
        if self.label:
            opts.append(f"label={self.label}")
        if self.slow != 1.0:
            opts.append(f"slow={self.slow:g}")
        return base + ("?" + "&".join(opts) if opts else "")

    def __str__(self) -> str:
        return self.name


# op names only one device type has a kernel for: a capture on a CPU records the CPU's fused
# kernels (a GPU capture its own) where it does not record the composite whole (capture/fused.py),
# and quantized CPU weights run torch's CPU int4/int8 kernels (``_weight_int4pack_mm_for_cpu``)
_ONLY_ON = {"cpu": ("_for_cpu", "mkldnn", "onednn", "_cpu_"),
            "cuda": ("cudnn", "_flash_attention", "_efficient_attention", "_cutlass", "_cufft")}


def other_device_op(name: str, device_type: str) -> str | None:
    """The device type whose kernel ``name`` (``aten.x.overload`` or ``x``)
    is, when that is not ``device_type``; else None."""
    op = name.split(".")[1] if name.count(".") >= 1 else name
    kind = next((kind for kind, marks in _ONLY_ON.items() if any(m in op for m in marks)), None)   # cpu first
    return kind if kind not in (None, device_type) else None


def parse_devices(text: str | list[str]) -> list[DeviceSpec]:
    """``"cpu,cpu?threads=1"`` -> two specs. Commas inside a query are not allowed."""
    items = text.split(",") if isinstance(text, str) else list(text)
    specs = [DeviceSpec.parse(t) for t in items if t.strip()]
    if not specs:
        raise DeviceSpecError("no devices given")
    return specs

"""One JSON-ready report per module: access classification + cost features.

This is the stable shape that ``python -m ptx analyze --json`` prints and
that the graph builder consumes::

    {kernel: {"params": [{"index", "name", "pointer", "access"[, "fields"]}],
              "indirect": bool, "reasons": [str], "features": {...}}}
"""
from __future__ import annotations

from ptx.analysis import analyze_module
from ptx.features import kernel_features
from ptx.model import Module
from ptx.parser import no_gc, parse


def report(text: str) -> dict[str, dict]:
    """Parse ``text`` and report every kernel (raises ``PtxParseError``)."""
    with no_gc():
        return report_module(parse(text))


def report_module(module: Module, features: bool = True) -> dict[str, dict]:
    """Report every kernel of an already parsed module, in file order.

    ``features=False`` leaves out the cost features (access analysis only).
    """
    out = {}
    with no_gc():
        results = analyze_module(module)
    for name, res in results.items():
        out[name] = {
            "params": [p.to_json() for p in res.params],
            "indirect": res.indirect,
            "reasons": res.reasons,
        }
        if features:
            out[name]["features"] = kernel_features(module.functions[name], module)
    return out


def format_table(rep: dict[str, dict]) -> str:
    """Human-readable per-kernel table of the report."""
    lines = []
    for kernel, r in rep.items():
        flag = "  [INDIRECT]" if r["indirect"] else ""
        f = r["features"]
        lines.append(f"{kernel}{flag}")
        width = max([len(p["name"]) for p in r["params"]] + [5])
        lines.append(f"  {'#':>3} {'param':<{width}} {'ptr':<4} access")
        for p in r["params"]:
            extra = ""
            if p.get("fields"):
                extra = "  fields: " + ", ".join(f"+{k}:{v}" for k, v in p["fields"].items())
            lines.append(f"  {p['index']:>3} {p['name']:<{width}} {'yes' if p['pointer'] else 'no':<4} {p['access']}{extra}")
        for reason in r["reasons"]:
            lines.append(f"  why indirect: {reason}")
        mix = ", ".join(f"{k}={v}" for k, v in f["arith"].items() if v)
        lines.append(f"  instrs={f['instructions']} mma={f['mma']} wgmma={f['wgmma']} "
                     f"ld_bytes={f['global_load_total']} st_bytes={f['global_store_total']} "
                     f"smem={f['shared_static_bytes']}{'+dyn' if f['shared_dynamic'] else ''} "
                     f"barriers={f['barriers']} arith[{mix}]")
    return "\n".join(lines)

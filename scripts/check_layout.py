"""Check the shape of the code: layers, cycles, sizes, dead definitions, result provenance.

    python scripts/check_layout.py          # exit 0 when everything holds, else 1 with one line per finding

Fails on:
* a cycle of imports between product modules, or between packages (``LAYERS`` units);
* an import that points up the layer order (``LAYERS``, bottom first);
* a product module over ``MAX_MODULE`` lines or a function over ``MAX_FUNCTION`` lines;
* a top-level function or class, or a method, whose name appears nowhere else in the tree
  (product, tests, benchmarks, scripts, examples: as a name, an attribute or inside a string);
* a committed result JSON under ``benchmarks/results/`` without ``git_commit`` and ``command``
  (at its top level or in its ``meta``).

Imports under ``if TYPE_CHECKING:`` and the lazy re-exports of a package's ``__getattr__`` do not
count as edges (they load nothing at import time and are part of no cycle).  Run by CI (a test
calls it) and by hand; it imports nothing of the project.
"""
from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("tessera_actors", "actors", "ptx", "transport")
ELSEWHERE = ("tests", "benchmarks", "scripts", "examples")
MAX_MODULE = 500
MAX_FUNCTION = 80

# bottom first; a unit may import its own layer or any below.  The data model and the pure planning
# logic (torch-free) are at the bottom; transport sits on the actor runtime (its codec encodes the
# runtime's messages, its endpoints are actor refs; the runtime never imports it: transport's ActorSystem
# subclasses the runtime's LocalSystem); the executor core sits under the actors that drive it.
LAYERS = (
    ("model", ("ptx", "tessera_actors.graph", "tessera_actors.plan", "tessera_actors.devices",
               "tessera_actors.provenance")),
    ("planning", ("tessera_actors.planning",)),
    ("runtime", ("tessera_actors.runtime",)),
    ("transport", ("transport",)),
    ("models and capture", ("tessera_actors.models", "tessera_actors.capture")),
    ("execution", ("tessera_actors.execution",)),
    ("actors", ("actors", "tessera_actors.cluster", "tessera_actors.node", "tessera_actors.launch.env")),
    ("serving", ("tessera_actors.serving", "tessera_actors.launch")),
    ("commands", ("tessera_actors.cli", "tessera_actors.capture.cli", "tessera_actors.demo", "tessera_actors.bench",
                  "tessera_actors.check", "tessera_actors.testing", "tessera_actors")),
)

# names that other code calls without naming them (protocols of torch, asyncio, argparse, pytest)
CALLED_BY_NAME = {"ignore_compile_internals", "__torch_dispatch__", "__torch_function__", "on_start", "on_stop",
                  "setUp", "tearDown", "pytest_configure",
                  "get_seq_length",   # transformers' Cache protocol
                  "_get_help_string"}   # argparse's HelpFormatter protocol


def modules(root: Path, tops) -> dict[str, Path]:
    out = {}
    for top in tops:
        for f in sorted((root / top).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _lazy(node: ast.AST, parents: dict) -> bool:
    """Under ``if TYPE_CHECKING:`` or inside a package ``__getattr__``."""
    p = parents.get(node)
    while p is not None:
        if isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test):
            return True
        if isinstance(p, ast.FunctionDef) and p.name == "__getattr__":
            return True
        p = parents.get(p)
    return False


def imports(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The product modules ``mod`` imports (function-level imports included)."""
    tree = ast.parse(path.read_text())
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _lazy(node, parents):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            pkg = node.module or ""
            if node.level:
                up = base[: len(base) - node.level + 1]
                pkg = ".".join(up + ([node.module] if node.module else []))
            names = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in known else pkg for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod:
                out.add(n)
    return out


def unit_of(mod: str) -> str:
    best = ""
    for _, units in LAYERS:
        for u in units:
            if (mod == u or mod.startswith(u + ".")) and len(u) > len(best):
                best = u
    return best or mod


def layer_of(unit: str) -> int:
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    return -1


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def check_imports(known: dict[str, Path]) -> list[str]:
    found = []
    graph = {m: imports(m, p, known) for m, p in known.items()}
    for comp in cycles(graph):
        found.append(f"file cycle: {' -> '.join(comp)}")
    units: dict[str, set[str]] = defaultdict(set)
    for m, deps in graph.items():
        for d in deps:
            a, b = unit_of(m), unit_of(d)
            if a != b and a != "tessera_actors" and b != "tessera_actors":
                units[a].add(b)
                la, lb = layer_of(a), layer_of(b)
                if la < 0 or lb < 0:
                    found.append(f"no layer for {a if la < 0 else b} (add it to LAYERS)")
                elif lb > la:
                    found.append(f"import up a layer: {m} ({LAYERS[la][0]}) imports {d} ({LAYERS[lb][0]})")
    for comp in cycles(units):
        found.append(f"package cycle: {' -> '.join(comp)}")
    return sorted(set(found))


def check_sizes(known: dict[str, Path]) -> list[str]:
    found = []
    for m, p in known.items():
        text = p.read_text()
        n = text.count("\n")
        if n > MAX_MODULE:
            found.append(f"module over {MAX_MODULE} lines: {p.relative_to(ROOT)} ({n})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION:
                    found.append(f"function over {MAX_FUNCTION} lines: {p.relative_to(ROOT)}:{node.lineno} "
                                 f"{node.name} ({size})")
    return found


def _words(path: Path) -> list[str]:
    """Every name token and every identifier-like word inside strings."""
    out = []
    try:
        toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for t in toks:
            if t.type == tokenize.NAME:
                out.append(t.string)
            elif t.type == tokenize.STRING or getattr(tokenize, "FSTRING_MIDDLE", -1) == t.type:
                out.extend(w for w in _split(t.string))
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        pass
    return out


def _split(s: str) -> list[str]:
    word, out = [], []
    for ch in s + " ":
        if ch.isalnum() or ch == "_":
            word.append(ch)
        elif word:
            out.append("".join(word))
            word = []
    return out


def check_dead(known: dict[str, Path]) -> list[str]:
    counts: dict[str, int] = defaultdict(int)
    files = list(known.values()) + [f for top in ELSEWHERE if (ROOT / top).exists()
                                    for f in (ROOT / top).rglob("*.py")]
    for f in files:
        for w in _words(f):
            counts[w] += 1
    found = []
    for m, p in known.items():
        tree = ast.parse(p.read_text())
        # a decorated top-level definition is registered somewhere (atexit, a handler table)
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and not (n.decorator_list and not isinstance(n, ast.ClassDef))]
        for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
            defs += [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and not any("handler" in ast.unparse(d) for d in n.decorator_list)]
        for d in defs:
            name = d.name
            if name.startswith("__") or name in CALLED_BY_NAME:
                continue
            if counts[name] <= 1:   # the definition's own name token
                found.append(f"referenced nowhere: {p.relative_to(ROOT)}:{d.lineno} {name}")
    return found


def check_results() -> list[str]:
    found = []
    for f in sorted((ROOT / "benchmarks" / "results").rglob("*.json")):
        try:
            data = json.loads(f.read_text())
        except ValueError:
            found.append(f"result JSON does not parse: {f.relative_to(ROOT)}")
            continue
        where = [data] + [data.get(k) for k in ("meta", "provenance") if isinstance(data, dict)]
        where = [w for w in where if isinstance(w, dict)]
        if not any(w.get("git_commit") for w in where) or not any(w.get("command") for w in where):
            found.append(f"result JSON without git_commit and command: {f.relative_to(ROOT)}")
    return found


def main() -> int:
    known = modules(ROOT, PRODUCT)
    found = check_imports(known) + check_sizes(known) + check_dead(known) + check_results()
    for line in found:
        print(line)
    print(f"check_layout: {len(known)} product modules, {len(found)} findings")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

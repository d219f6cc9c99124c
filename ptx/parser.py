"""Parse PTX text (as emitted by nvcc 13 and Triton 3.x) into :mod:`ptx.model`.

Contract: :func:`parse` accepts any PTX module text and returns a
:class:`~ptx.model.Module`. Instructions it does not know are kept verbatim
(mnemonic + operands), never rejected. Input that is not PTX (no ``.version``
directive first) or that is structurally broken (unbalanced braces, a
parameter list that does not close, a statement outside any function that is
not a declaration) raises :class:`~ptx.errors.PtxParseError` carrying the
1-based line number. The parser is a linear scan built for speed: tens of MB
per second, so the benchmark's 10 MB parse in well under a second.
"""
from __future__ import annotations

import gc
import re
from contextlib import contextmanager

from ptx.errors import PtxParseError
from ptx.model import Directive, Function, Instruction, Label, Module, Param, Symbol, type_bytes

_LINE_DIRECTIVE = re.compile(r"^[ \t]*\.(version|target|address_size|loc|file)\b[^\n]*", re.M)
_SECTION = re.compile(r"^[ \t]*\.section\b[^\n{]*\s*\{[^}]*\}", re.M)
_LINE_COMMENT = re.compile(r"//[^\n]*")
_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_LABEL = re.compile(r"([A-Za-z_$%][\w$]*)[ \t]*:(?!:)")
_HEADER = re.compile(r"(?:\.(?:visible|weak|extern|common)\s+)*\.(?:entry|func)\b")
_FUNC = re.compile(
    r"(?P<link>(?:\.(?:visible|weak|extern|common)\s+)*)\.(?P<kind>entry|func)\s*"
    r"(?:\((?P<rets>[^)]*)\))?\s*(?P<name>[A-Za-z_$][\w$]*)\s*(?:\((?P<params>[^)]*)\))?",
    re.S,
)
_GUARD = re.compile(r"@(!?%?[\w$]+)\s+")
_SPLIT = re.compile(r"\s*,\s*(?![^\[\]{}()]*[\]})])")
_SIMPLE_SPLIT = re.compile(r"\s*,\s*")
_WS = re.compile(r"\s+")
_SYMBOL = re.compile(
    r"\.(?P<space>global|shared|local|const)\s+(?:\.align\s+\d+\s+)?(?:\.v\d\s+)?"
    r"\.(?P<type>\w+)\s+(?P<name>[A-Za-z_$][\w$]*)(?P<dims>(?:\s*\[\d*\])*)"
)
_REG = re.compile(r"\.reg\s+(?:\.v\d\s+)?\.(\w+)\s+(.*)", re.S)
_PTYPE = re.compile(r"\.(?:[bsuf]\d+|pred|bf16|f16x2|bf16x2|tf32|texref|samplerref|surfref)$")
_SPACES = (".global", ".shared", ".const", ".local")
_LINKAGE = (".visible", ".weak", ".extern", ".common")


def parse(text: str) -> Module:
    """Parse a PTX module; see the module docstring for the contract."""
    with no_gc():
        return _Parser(text).run()


@contextmanager
def no_gc():
    """Pause the cyclic GC: building ~10^5 acyclic objects otherwise triggers
    repeated full collections that dominate the run time on large inputs."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _blank(match: re.Match) -> str:
    """Replace a match by its newlines so line numbers stay exact."""
    return "\n" * match.group(0).count("\n")


class _Parser:
    def __init__(self, text: str) -> None:
        self.raw = text
        self.functions: dict[str, Function] = {}
        self.symbols: dict[str, Symbol] = {}
        self.current: Function | None = None
        self.depth = 0

    # -- preprocessing -------------------------------------------------
    def _preprocess(self) -> tuple[str, dict[str, tuple[str, int]]]:
        heads: dict[str, tuple[str, int]] = {}
        text = self.raw
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if "/*" in text:
            text = _BLOCK_COMMENT.sub(_blank, text)
        text = _LINE_COMMENT.sub("", text)
        for m in _LINE_DIRECTIVE.finditer(text):
            kind = m.group(1)
            if kind in ("version", "target", "address_size") and kind not in heads:
                line = text.count("\n", 0, m.start()) + 1
                heads[kind] = (m.group(0).split(None, 1)[1].strip() if len(m.group(0).split()) > 1 else "", line)
        text = _LINE_DIRECTIVE.sub("", text)
        if ".section" in text:
            text = _SECTION.sub(_blank, text)
        return text, heads

    def _check_is_ptx(self, text: str, heads: dict[str, tuple[str, int]]) -> None:
        first = re.search(r"\S", text)
        if "version" not in heads:
            line = text.count("\n", 0, first.start()) + 1 if first else 1
            raise PtxParseError("not PTX: expected a '.version' directive before any other statement", line)
        vline = heads["version"][1]
        for kind, (_, kline) in heads.items():
            if kline < vline:
                raise PtxParseError(f"not PTX: '.{kind}' before the '.version' directive", kline)
        if first is not None:
            fline = text.count("\n", 0, first.start()) + 1
            if fline < vline:
                raise PtxParseError("not PTX: statement before the '.version' directive", fline)

    # -- main loop -----------------------------------------------------
    def run(self) -> Module:
        text, heads = self._preprocess()
        self._check_is_ptx(text, heads)
        line = 1
        simple, split = _SIMPLE_SPLIT.split, _SPLIT.split
        for piece in text.split(";"):
            stripped = piece.lstrip()
            # fast path: a plain instruction inside a body (no label, brace or directive)
            if self.depth > 0 and stripped and stripped[0] not in "{}." and ":" not in stripped:
                lead = len(piece) - len(stripped)
                guard = None
                if stripped[0] == "@":
                    m = _GUARD.match(stripped)
                    if m is None:
                        raise PtxParseError("malformed predicate guard", line + piece.count("\n", 0, lead))
                    guard = m.group(1)
                    stripped = stripped[m.end():]
                parts = stripped.split(None, 1)
                if len(parts) == 1:
                    operands: tuple[str, ...] = ()
                else:
                    ops = parts[1].rstrip()
                    if "\n" in ops or "\t" in ops:
                        ops = _WS.sub(" ", ops)
                    operands = tuple(split(ops) if "[" in ops or "{" in ops or "(" in ops else simple(ops))
                op = parts[0]
                self.current.body.append(Instruction(line + piece.count("\n", 0, lead), op, operands, guard,
                                                     op.partition(".")[0]))
            elif stripped:
                self._piece(piece, line)
            line += piece.count("\n")
        if self.depth != 0:
            raise PtxParseError("unexpected end of file: missing '}'", line)
        if self.current is not None and self.current.body_start is not None:
            raise PtxParseError(f"function {self.current.name!r} has no closing '}}'", line)
        version = heads["version"][0]
        target = heads.get("target", ("", 0))[0]
        addr = heads.get("address_size", ("64", 0))[0]
        try:
            address_size = int(addr)
        except ValueError:
            raise PtxParseError(f"bad .address_size {addr!r}", heads["address_size"][1]) from None
        return Module(version, target, address_size, self.functions, self.symbols, line)

    def _piece(self, rest: str, line: int) -> None:
        while True:
            stripped = rest.lstrip()
            if not stripped:
                return
            line += rest.count("\n", 0, len(rest) - len(stripped))
            rest = stripped
            c = rest[0]
            if c == "{":
                self._open(line)
                rest = rest[1:]
                continue
            if c == "}":
                self._close(line)
                rest = rest[1:]
                continue
            m = _LABEL.match(rest)
            if m is not None:
                self._label(m.group(1), line)
                rest = rest[m.end():]
                continue
            if self.depth == 0 and c == "." and _HEADER.match(rest):
                cut = rest.find("{")
                header = rest if cut < 0 else rest[:cut]
                self._header(header, line, has_body=cut >= 0)
                if cut < 0:
                    return
                line += header.count("\n")
                rest = rest[cut:]
                continue
            self._statement(rest, line)
            return

    # -- structure -----------------------------------------------------
    def _open(self, line: int) -> None:
        if self.depth == 0:
            fn = self.current
            if fn is None or fn.body_start is not None or fn.body_end is not None:
                raise PtxParseError("'{' outside a function definition", line)
            fn.body_start = line
        self.depth += 1

    def _close(self, line: int) -> None:
        if self.depth == 0:
            raise PtxParseError("unbalanced '}'", line)
        self.depth -= 1
        if self.depth == 0 and self.current is not None:
            self.current.body_end = line
            self.current = None

    def _label(self, name: str, line: int) -> None:
        if self.depth == 0:
            raise PtxParseError(f"label {name!r} outside a function body", line)
        self.current.body.append(Label(name, line))

    def _header(self, header: str, line: int, has_body: bool) -> None:
        m = _FUNC.match(header)
        if m is None:
            raise PtxParseError("malformed .entry/.func header", line)
        tail = header[m.end():]
        if m.group("params") is None and "(" in tail:
            raise PtxParseError("parameter list of function does not close", line)
        name = m.group("name")
        params = self._params(m.group("params") or "", line)
        rets = self._params(m.group("rets") or "", line)
        fn = Function(
            name=name, is_entry=m.group("kind") == "entry" and has_body, params=params,
            returns=rets, line=line, linkage=_WS.sub(" ", m.group("link")).strip(),
            header_text=header.strip(),
        )
        if not has_body:
            self.functions.setdefault(name, fn)
            return
        self.functions[name] = fn
        self.current = fn

    def _params(self, text: str, line: int) -> list[Param]:
        out: list[Param] = []
        text = text.strip()
        if not text:
            return out
        for decl in text.split(","):
            words = decl.split()
            if not words:
                raise PtxParseError("empty parameter in list", line)
            name_tok = words[-1]
            dims = re.findall(r"\[(\d*)\]", name_tok)
            name = name_tok.split("[", 1)[0]
            ptype, align, is_ptr, space = None, None, False, None
            i = 0
            while i < len(words) - 1:
                w = words[i]
                if w == ".align" and i + 1 < len(words) - 1:
                    align = int(words[i + 1])
                    i += 2
                    continue
                if w == ".ptr":
                    is_ptr = True
                elif is_ptr and w in _SPACES:
                    space = w[1:]
                elif _PTYPE.match(w):
                    ptype = w
                i += 1
            if ptype is None:
                raise PtxParseError(f"parameter {name!r} has no type", line)
            elem = type_bytes(ptype) if ptype[1:] not in ("texref", "samplerref", "surfref") else 8
            array_len = None
            size = elem
            if dims:
                array_len = 1
                for d in dims:
                    array_len *= int(d) if d else 0
                size = elem * array_len
            out.append(Param(len(out), name, ptype, size, line, align, array_len, is_ptr, space))
        return out

    # -- statements ----------------------------------------------------
    def _statement(self, text: str, line: int) -> None:
        if text[0] == ".":
            self._directive(text, line)
            return
        if self.depth == 0:
            word = text.split(None, 1)[0]
            raise PtxParseError(f"unexpected {word!r} outside a function body", line)
        guard = None
        if text[0] == "@":
            m = _GUARD.match(text)
            if m is None:
                raise PtxParseError("malformed predicate guard", line)
            guard = m.group(1)
            text = text[m.end():]
        parts = text.split(None, 1)
        opcode = parts[0]
        if len(parts) == 1:
            operands: tuple[str, ...] = ()
        else:
            ops = parts[1]
            if "\n" in ops or "\t" in ops:
                ops = _WS.sub(" ", ops)
            operands = tuple(_SPLIT.split(ops.strip()))
        self.current.body.append(Instruction.make(line, opcode, operands, guard))

    def _directive(self, text: str, line: int) -> None:
        kind = text.split(None, 1)[0]
        fn = self.current if self.depth > 0 else None
        if kind == ".reg" and fn is not None:
            m = _REG.match(text)
            if m is None:
                raise PtxParseError("malformed .reg declaration", line)
            for name in m.group(2).split(","):
                fn.registers[name.strip().split("<", 1)[0]] = m.group(1)
            fn.body.append(Directive(kind, text, line))
            return
        m = _SYMBOL.search(text) if kind in _SPACES or kind in _LINKAGE else None
        if m is not None:
            size = type_bytes("." + m.group("type")) if _PTYPE.match("." + m.group("type")) else 1
            dims = re.findall(r"\[(\d*)\]", m.group("dims"))
            for d in dims:
                size *= int(d) if d else 0
            sym = Symbol(m.group("name"), m.group("space"), size, line, extern=".extern" in text.split("." + m.group("space"))[0])
            if fn is not None:
                fn.symbols[sym.name] = sym
            else:
                self.symbols[sym.name] = sym
        elif self.depth == 0 and kind not in (".pragma", ".alias", ".callprototype"):
            raise PtxParseError(f"unexpected directive {kind!r} at module level", line)
        if fn is not None:
            fn.body.append(Directive(kind, text, line))

"""Byte-level BPE tokenizer (GPT-2 family) built from a GGUF vocabulary.

``BPETokenizer(tokens, merges, special)`` with ``tokens`` the id -> token
string table (byte-level alphabet: every byte maps to one printable char),
``merges`` the ranked "a b" merge rules and ``special`` the control tokens
(matched verbatim before pre-tokenization, e.g. ``<|im_start|>``).
Pre-tokenization follows llama.cpp's "smollm" rule: digits one by one, then
the GPT-2 pattern. ``encode(text) -> list[int]``, ``decode(ids) -> str``.
Pure Python; uses the ``regex`` module for Unicode classes when installed and
an ASCII-correct ``re`` fallback otherwise.
"""
from __future__ import annotations

from functools import lru_cache

try:
    import regex as _re
    _GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    _DIGIT_PATTERN = r"\p{N}"
except ImportError:  # pragma: no cover - the fallback is exact for ASCII text
    import re as _re
    _GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"
    _DIGIT_PATTERN = r"\d"

_DIGITS = _re.compile(_DIGIT_PATTERN)
_GPT2 = _re.compile(_GPT2_PATTERN)


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class BPETokenizer:
    """Greedy-by-rank byte-level BPE; see the module docstring."""

    def __init__(self, tokens: list[str], merges: list[str], special: list[str]):
        self.tokens = list(tokens)
        self.ids = {tok: i for i, tok in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.special = sorted(special, key=len, reverse=True)
        self._special_re = _re.compile("|".join(_re.escape(s) for s in self.special)) if special else None
        self._bytes = byte_alphabet()
        self._unbytes = {c: b for b, c in self._bytes.items()}
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, word: str) -> list[int]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(((r, i) for r, i in pairs if r is not None), default=(None, -1))
            if rank is None:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        # every single byte-char is in the vocabulary, so unmerged parts resolve
        ids = [self.ids[c] for p in parts for c in ([p] if p in self.ids else p)]
        self._cache[word] = ids
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        out: list[int] = []
        for chunk in _split_keep(_DIGITS, text):
            for piece in _GPT2.findall(chunk):
                word = "".join(self._bytes[b] for b in piece.encode("utf-8"))
                out.extend(self._bpe(word))
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written verbatim are kept whole."""
        if self._special_re is None:
            return self._encode_plain(text)
        out, start = [], 0
        for match in self._special_re.finditer(text):
            out.extend(self._encode_plain(text[start:match.start()]))
            out.append(self.ids[match.group()])
            start = match.end()
        out.extend(self._encode_plain(text[start:]))
        return out

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 from partial sequences -> U+FFFD)."""
        data = bytearray()
        for i in ids:
            tok = self.tokens[i]
            if tok in self.special:
                if not skip_special:
                    data.extend(tok.encode("utf-8"))
                continue
            data.extend(self._unbytes[c] for c in tok)
        return data.decode("utf-8", errors="replace")


def _split_keep(pattern, text: str) -> list[str]:
    """Split ``text`` into matches of ``pattern`` and the runs between them."""
    out, start = [], 0
    for m in pattern.finditer(text):
        if m.start() > start:
            out.append(text[start:m.start()])
        out.append(m.group())
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out

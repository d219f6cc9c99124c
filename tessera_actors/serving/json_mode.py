"""JSON mode (``response_format: {"type": "json_object"}``) by constrained
sampling: before each token the engine computes which ids keep the reply
a prefix of one JSON object (RFC 8259), and the device draws only among
them (the ``allow`` mask of :mod:`.sampling_extras`); once the object is
complete only the end-of-text id is allowed, so the reply parses.

:class:`JsonGrammar` is a character-level pushdown automaton over JSON
text; its state after the reply so far decides the mask, computed once
per distinct state over the vocabulary's token texts and cached (inside a
string, the common case, the state repeats).  Token texts come from the
byte-level BPE vocabulary: a token whose bytes are not whole UTF-8
characters counts as string content only.  A run of more than
``MAX_SPACES`` whitespace characters is cut off (a model can otherwise
pad a JSON reply with newlines until ``max_tokens``).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np

MAX_SPACES = 4
_WS = " \t\n\r"
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_HEX = set("0123456789abcdefABCDEF")
_NUM_END = {"zero", "int", "frac", "exp"}   # number states where the number may end

# a state: (mode, stack of open containers, aux); None: not a prefix of any JSON object text
State = tuple


def start() -> State:
    return ("start", (), None)


def _value(ch: str, stack: tuple) -> State | None:
    """A value begins with ``ch``."""
    if ch == "{":
        return ("obj_first", stack + ("{",), None)
    if ch == "[":
        return ("arr_first", stack + ("[",), None)
    if ch == '"':
        return ("str", stack, False)
    if ch in _LITERALS:
        return ("lit", stack, _LITERALS[ch])
    if ch == "-":
        return ("num", stack, "minus")
    if ch == "0":
        return ("num", stack, "zero")
    if ch.isdigit() and ch.isascii():
        return ("num", stack, "int")
    return None


def _after_value(stack: tuple) -> State:
    return ("after", stack, None) if stack else ("done", (), None)


def _number(sub: str, ch: str) -> str | None:
    digit = ch.isascii() and ch.isdigit()
    table = {"minus": {"0": "zero"} if ch == "0" else ({"d": "int"} if digit else {}),
             "zero": {".": "dot", "e": "e", "E": "e"}, "int": {".": "dot", "e": "e", "E": "e"},
             "dot": {}, "frac": {"e": "e", "E": "e"}, "e": {"+": "esign", "-": "esign"}, "esign": {}, "exp": {}}
    if digit and sub in ("int", "dot", "frac", "e", "esign", "exp"):
        return {"int": "int", "dot": "frac", "frac": "frac", "e": "exp", "esign": "exp", "exp": "exp"}[sub]
    nxt = table.get(sub, {})
    return nxt.get(ch) or (nxt.get("d") if digit else None)


def step(state: State, ch: str) -> State | None:
    """The state after one more character (None: no JSON object text goes on so)."""
    mode, stack, aux = state
    if mode == "str":
        if ch == '"':
            return ("colon", stack, None) if aux else _after_value(stack)
        if ch == "\\":
            return ("esc", stack, aux)
        return None if ord(ch) < 0x20 else state
    if mode == "esc":
        if ch == "u":
            return ("uni", stack, (aux, 4))
        return ("str", stack, aux) if ch in '"\\/bfnrt' else None
    if mode == "uni":
        key, left = aux
        if ch not in _HEX:
            return None
        return ("str", stack, key) if left == 1 else ("uni", stack, (key, left - 1))
    if mode == "lit":
        if ch != aux[0]:
            return None
        return _after_value(stack) if len(aux) == 1 else ("lit", stack, aux[1:])
    if mode == "num":
        sub = _number(aux, ch)
        if sub is not None:
            return ("num", stack, sub)
        return step(_after_value(stack), ch) if aux in _NUM_END else None
    if ch in _WS:
        return state
    if mode == "start":
        return ("obj_first", ("{",), None) if ch == "{" else None
    if mode in ("obj_first", "obj_key"):
        if ch == '"':
            return ("str", stack, True)
        return _after_value(stack[:-1]) if ch == "}" and mode == "obj_first" else None
    if mode == "colon":
        return ("value", stack, None) if ch == ":" else None
    if mode == "value":
        return _value(ch, stack)
    if mode == "arr_first":
        return _after_value(stack[:-1]) if ch == "]" else _value(ch, stack)
    if mode == "after":
        if ch == ",":
            return ("obj_key", stack, None) if stack[-1] == "{" else ("value", stack, None)
        if ch == ("}" if stack[-1] == "{" else "]"):
            return _after_value(stack[:-1])
    return None


def run(state: State | None, text: str) -> State | None:
    for ch in text:
        if state is None:
            return None
        state = step(state, ch)
    return state


def token_texts(tokenizer) -> list[str | None]:
    """Each id's text (None for special tokens); bytes that are not whole
    UTF-8 characters become U+FFFD (string content only)."""
    hf = tokenizer.hf
    special = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    inverse = _byte_decoder()
    out: list[str | None] = []
    for i in range(hf.get_vocab_size()):
        piece = hf.id_to_token(i)
        if piece is None or piece in special:
            out.append(None)
            continue
        raw = bytes(inverse[c] for c in piece if c in inverse)
        out.append(raw.decode("utf-8", errors="replace"))
    return out


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: its character for each byte, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class JsonGrammar:
    """The masks of JSON mode for one vocabulary (shared by its requests)."""

    def __init__(self, texts: Sequence[str | None], eos_id: int | None) -> None:
        self.texts, self.eos_id = list(texts), eos_id
        self.vocab = len(self.texts)
        self._masks: dict[tuple, bytes] = {}
        # the vocabulary by first character (a state refuses most of them at once), and the ids whose
        # text is plain string content (no quote, backslash or control character: valid in any string)
        self._by_first: dict[str, list[int]] = {}
        plain = np.zeros(self.vocab, dtype=bool)
        for i, text in enumerate(self.texts):
            if text:
                self._by_first.setdefault(text[0], []).append(i)
                plain[i] = not any(c in '"\\' or ord(c) < 0x20 for c in text)
        self._plain = plain
        self._spaces = np.array([bool(t) and not t.strip(_WS) for t in self.texts], dtype=bool)

    def mask(self, reply: str) -> bytes:
        """The packed bitmask (:mod:`.sampling_extras` ``allow``) of the ids
        that may follow ``reply``: those keeping it a JSON object prefix,
        and the end-of-text id once the object is complete."""
        state = run(start(), reply)
        if state is None:   # cannot happen for a reply drawn under the masks; end it
            return self._only_eos()
        spaces = len(reply) - len(reply.rstrip(_WS))
        key = (state, spaces >= MAX_SPACES)
        got = self._masks.get(key)
        if got is None:
            got = self._masks[key] = self._compute(state, spaces >= MAX_SPACES)
        return got

    def _only_eos(self) -> bytes:
        bits = np.zeros(self.vocab, dtype=bool)
        if self.eos_id is not None:
            bits[self.eos_id] = True
        return np.packbits(bits).tobytes()

    def _compute(self, state: State, no_spaces: bool) -> bytes:
        if state[0] == "done":
            return self._only_eos()
        in_string = state[0] == "str"
        bits = self._plain.copy() if in_string else np.zeros(self.vocab, dtype=bool)
        for first, ids in self._by_first.items():
            after = step(state, first)
            if after is None:
                continue
            for i in ids:
                text = self.texts[i]
                if bits[i] or ("\ufffd" in text and not in_string):
                    continue
                bits[i] = run(after, text[1:]) is not None
        if no_spaces:
            bits &= ~self._spaces
        return np.packbits(bits).tobytes()

"""Text in, text out: the tokenizer and chat template of a model, from its
GGUF metadata, through well-kept libraries.

* :func:`gguf_tokenizer` builds a Hugging Face ``tokenizers`` byte-level BPE
  from ``tokenizer.ggml.tokens`` / ``merges`` (control tokens special; the
  ``smollm`` pre-tokenizer: digits one by one, then the GPT-2 split).
* :class:`ChatTemplate` renders ``tokenizer.chat_template`` with jinja2 in a
  sandbox (multi-turn ``messages``, ``add_generation_prompt``).
* :class:`Detokenizer` turns a growing list of ids into text deltas of
  whole characters only, and holds back text that may still become a stop
  string, so a stop string never reaches the client.
"""
from __future__ import annotations

from typing import Any, Sequence

from tessera_actors.serving.params import InvalidRequest, surrogate_at


class Tokenizer:
    """``encode(text) -> ids`` (special tokens in the text are recognised);
    ``decode(ids) -> str`` (special tokens dropped); ``eos_id``."""

    def __init__(self, hf, eos_id: int | None, bos_token: str = "", eos_token: str = "") -> None:
        self.hf, self.eos_id = hf, eos_id
        self.bos_token, self.eos_token = bos_token, eos_token
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


def gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a GGUF file's metadata (``tokenizer.ggml.model`` gpt2)."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()
    special = [t for t, k in zip(tokens, types) if int(k) == 3]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(hf, None if eos is None else int(eos),
                     tokens[int(bos)] if bos is not None else "", tokens[int(eos)] if eos is not None else "")


class ChatTemplate:
    """A model's jinja2 chat template, rendered in a sandbox."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise InvalidRequest(f"chat template: {message}", "messages")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[dict]) -> str:
        check_messages(messages)
        return self.template.render(messages=list(messages), add_generation_prompt=True,
                                    bos_token=self.bos_token, eos_token=self.eos_token)


def check_messages(messages: Any) -> None:
    """Raise :class:`InvalidRequest` unless ``messages`` is a non-empty list
    of ``{"role": str, "content": str}`` with known roles."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with string 'role' and 'content'", "messages")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequest(f"messages[{i}].role {m['role']!r} is not one of system, user, assistant, tool",
                                 "messages")
        at = surrogate_at(m["content"])
        if at is not None:
            raise InvalidRequest(f"messages[{i}].content holds a lone surrogate at character {at} "
                                 f"({m['content'][at]!r}): not text", "messages")


class Detokenizer:
    """Text deltas of a growing id list: whole characters only, stop strings
    cut (see the module docstring).  Each push decodes only a short window
    of ids (from the last emitted boundary on), so a token costs O(1)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = 0        # ids[prefix:read] decode to the last emitted piece's context
        self.read = 0
        self.text = ""         # all decoded text so far (whole characters)
        self.sent = 0          # characters of ``text`` already emitted
        self.stopped = False

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        """Add ids; return the new text that is safe to emit.  After a stop
        string is seen, ``stopped`` is True and nothing more is emitted."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if not after.endswith("\ufffd") or final:
            new = after[len(before):] if after.startswith(before) else after
            self.text += new.rstrip("\ufffd") if not final else new
            self.prefix, self.read = self.read, len(self.ids)
        text = self.text
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                self.stopped = True
                text = text[:at]
        end = len(text) if (final or self.stopped) else max(self.sent, len(text) - self.hold)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta


def encode_prompt(prompt, template, tokenizer, vocab_size: int, model_name: str) -> list[int]:
    """Token ids of ``prompt``: a string as it is, a list of chat messages
    through ``template``; without a tokenizer, the text's bytes as ids
    (modulo ``vocab_size``).  ``InvalidRequest`` for an empty prompt or
    messages to a model without a chat template."""
    if isinstance(prompt, str):
        text = prompt
        at = surrogate_at(text)
        if at is not None:
            raise InvalidRequest(f"the prompt holds a lone surrogate at character {at} ({text[at]!r}): not text",
                                 "prompt")
    else:
        check_messages(prompt)
        if template is None:
            raise InvalidRequest(f"model {model_name!r} has no chat template", "messages")
        text = template.render(prompt)
    if tokenizer is None:   # a model without a tokenizer: bytes as ids
        ids = [b % max(vocab_size, 1) for b in text.encode()]
    else:
        ids = tokenizer.encode(text)
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    return ids

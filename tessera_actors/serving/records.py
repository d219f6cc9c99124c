"""The host side of a request's sampling record (:mod:`.sampling_extras`):
what goes with each of its tokens to the device that samples.

:class:`RowRecord` is built once per request whose ``SamplingParams`` shape
the logits (``shapes_logits``) and called for each of its sample entries
(``Sequence.sample_row``): its ``fixed`` part once per row a plan's steps
carry, the part that changes every step (``changing``) with each.  Penalties and JSON mode depend on the tokens
so far (``needs_tokens``): the engine then waits for each step's tokens
before the next (no decode step sent ahead for those rows), so the record
always sees every token before the one it is drawn for.
"""
from __future__ import annotations

from typing import Callable, Sequence

from tessera_actors.serving.json_mode import JsonGrammar, token_texts
from tessera_actors.serving.params import InvalidRequest, SamplingParams


class RowRecord:
    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab: int,
                 grammar: JsonGrammar | None = None, decode: Callable[[list[int]], str] | None = None) -> None:
        """``grammar`` and ``decode`` (token ids to text): JSON mode's."""
        if params.json and (grammar is None or decode is None):
            raise InvalidRequest("this model has no tokenizer: JSON mode needs one", "response_format")
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise InvalidRequest(f"logit_bias: token id {bad[0]} is outside the vocabulary of {vocab}", "logit_bias")
        self.params, self.grammar, self.decode = params, grammar, decode
        self.fixed: dict = {}
        if params.presence_penalty:
            self.fixed["pp"] = float(params.presence_penalty)
        if params.frequency_penalty:
            self.fixed["fp"] = float(params.frequency_penalty)
        if params.repetition_penalty != 1.0:
            self.fixed["rp"] = float(params.repetition_penalty)
            self.fixed["ctx"] = sorted(set(int(t) for t in prompt))
        if params.logit_bias:
            self.fixed["bias"] = [[int(t), float(b)] for t, b in sorted(params.logit_bias.items())]
        if params.top_logprobs:
            self.fixed["top"] = int(params.top_logprobs)
        self.needs_tokens = bool(params.presence_penalty or params.frequency_penalty
                                 or params.repetition_penalty != 1.0 or params.json)

    def __call__(self, seq) -> dict:
        """The record of ``seq``'s next token (``seq.generated``: its tokens so far)."""
        return {**self.fixed, **self.changing(seq)}

    def changing(self, seq) -> dict:
        """The part of the record that changes with every token: the tokens
        so far (penalties), the mask of ids that keep the reply JSON."""
        rec = {}
        if "pp" in self.fixed or "fp" in self.fixed or "rp" in self.fixed:
            rec["out"] = [int(t) for t in seq.generated]
        if self.params.json:
            rec["allow"] = self.grammar.mask(self.decode(list(seq.generated)))
        return rec


class Records:
    """Makes the records of one engine's requests (JSON mode's grammar over
    its vocabulary built once, on first use)."""

    def __init__(self, tokenizer, vocab: int) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab
        self._grammar: JsonGrammar | None = None

    def make(self, params: SamplingParams, prompt: Sequence[int]) -> RowRecord:
        grammar = decode = None
        if params.json and self.tokenizer is not None:
            if self._grammar is None:   # every token's text, once
                self._grammar = JsonGrammar(token_texts(self.tokenizer), self.tokenizer.eos_id)
            grammar, decode = self._grammar, self.tokenizer.decode
        return RowRecord(params, prompt, self.vocab, grammar, decode)

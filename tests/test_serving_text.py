"""Tokenizer, chat template and incremental detokenization of SmolLM2 (real GGUF)."""
import pytest

from tessera_actors.models.smollm2 import _reader, load_tokenizer
from tessera_actors.serving import InvalidRequest
from tessera_actors.serving.text import ChatTemplate, Detokenizer, gguf_tokenizer

CORPUS = ["Hello world! 12345 numbers", "Ça va? Très bien, merci.", "日本語のテキスト、漢字とかな。",
          "Привет, как дела?", "emoji 🙂👍🏽 done", "  spaces   and\ttabs\n\nnewlines", "مرحبا بالعالم",
          "x=3.14159; y=2**10", "Ελληνικά κείμενα", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(scope="module")
def tok():
    return gguf_tokenizer(_reader().metadata)


def test_library_tokenizer_matches_the_gguf_bpe_on_a_multilingual_corpus(tok):
    own = load_tokenizer()
    for text in CORPUS:
        assert tok.encode(text) == own.encode(text), text
        plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
        assert tok.decode(tok.encode(text)) == plain
    assert tok.eos_id == tok.encode("<|im_end|>")[0]


def test_chat_template_renders_multi_turn_from_the_gguf():
    meta = _reader().metadata
    t = ChatTemplate(meta["tokenizer.chat_template"])
    text = t.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                     {"role": "user", "content": "more"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>assistant\nhello<|im_end|>" in text
    for bad in ([], [{"role": "user"}], [{"role": "wizard", "content": "x"}], "hi"):
        with pytest.raises(InvalidRequest):
            t.render(bad)


def test_detokenizer_emits_whole_characters_only(tok):
    text = "Ça va 🙂 très bien"
    d = Detokenizer(tok)
    pieces = [d.push([i]) for i in tok.encode(text)]
    pieces.append(d.push([], final=True))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_cuts_stop_strings_even_across_tokens(tok):
    d = Detokenizer(tok, stop=["STOP here"])
    out = "".join(d.push([i]) for i in tok.encode("one two STOP here three"))
    assert d.stopped and out == "one two "

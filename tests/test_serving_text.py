"""Tokenizer, chat template and incremental detokenization of SmolLM2 (real GGUF)."""
import pytest

from tessera_actors.models.smollm2 import _reader
from tessera_actors.serving import InvalidRequest
from tessera_actors.serving.text import ChatTemplate, Detokenizer, gguf_tokenizer

# the ids of the GGUF's byte-level BPE, as an independent implementation of its merges computed them
CORPUS = {
    "Hello world! 12345 numbers": [19556, 905, 17, 216, 33, 34, 35, 36, 37, 2966],
    "Ça va? Très bien, merci.": [142, 225, 81, 46316, 47, 4372, 42623, 1632, 264, 28, 5083, 605, 30],
    "日本語のテキスト、漢字とかな。": [23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100,
                         226, 29917, 177, 137, 112, 36518, 7365, 118, 7365, 229, 7365, 120, 19076],
    "Привет, как дела?": [155, 249, 46879, 16464, 32547, 28, 31338, 6511, 13760, 33427, 42292, 6511, 47],
    "emoji 🙂👍🏽 done": [391, 33777, 47526, 10813, 235, 231, 10813, 233, 138, 2294],
    "  spaces   and\ttabs\n\nnewlines": [216, 5600, 256, 284, 197, 100, 7366, 198, 198, 2241, 5110],
    "مرحبا بالعالم": [21706, 20602, 44626, 31462, 10805, 45726, 22208, 34966, 22208, 21706],
    "x=3.14159; y=2**10": [104, 45, 35, 30, 33, 36, 33, 37, 41, 43, 329, 45, 34, 828, 33, 32],
    "Ελληνικά κείμενα": [153, 239, 17162, 17162, 25723, 11517, 12001, 21118, 26112, 31953, 14240, 22442, 16674, 14240,
                         11517, 8998],
    "<|im_start|>user\nhi<|im_end|>\n": [1, 4093, 198, 6004, 2, 198],
}


@pytest.fixture(scope="module")
def tok():
    return gguf_tokenizer(_reader().metadata)


def test_the_gguf_tokenizer_encodes_a_multilingual_corpus_as_the_gguf_bpe_does(tok):
    for text, ids in CORPUS.items():
        assert tok.encode(text) == ids, text
        plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
        assert tok.decode(ids) == plain
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

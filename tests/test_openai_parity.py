"""OpenAI parity of ``tessera serve``, through the official ``openai`` client
against a live server (SmolLM2-135M-Instruct with its real weights on one
CPU device): several choices, log probabilities computed where the logits
are, penalties and logit bias applied before the draw, JSON mode by
constrained sampling, a batch of prompts, embeddings, and unknown fields
accepted with a warning."""
from __future__ import annotations

import json
import math
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from tessera_actors.serving.testing import ServerProcess  # noqa: E402

MODEL = "smollm2"
ASK = [{"role": "user", "content": "List three colors."}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--model", MODEL, "--devices", "cpu", "--max-seqs", "4", "--max-model-len", "256") as srv:
        yield srv


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_n_gives_n_choices_each_its_own_draw(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, n=2, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content   # seeds 7 and 8
    again = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, n=2, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    assert 2 <= r.usage.completion_tokens <= 24 and r.usage.prompt_tokens == again.usage.prompt_tokens


def test_top_logprobs_are_the_models_distribution(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 5
        assert sum(math.exp(t.logprob) for t in tok.top_logprobs) <= 1.0 + 1e-6
        assert tok.logprob == max(t.logprob for t in tok.top_logprobs)     # greedy: the most likely one
        assert tok.token == tok.top_logprobs[0].token
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_completion_logprobs_stream_per_token(client):
    pieces = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                            logprobs=2, stream=True))
    lps = [lp for p in pieces for c in p.choices if c.logprobs for lp in c.logprobs.token_logprobs]
    tops = [t for p in pieces for c in p.choices if c.logprobs for t in c.logprobs.top_logprobs]
    assert len(lps) == 5 and all(lp <= 0 for lp in lps)
    assert all(len(t) == 2 and sum(math.exp(v) for v in t.values()) <= 1.0 + 1e-6 for t in tops)


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"extra_body": {"repetition_penalty": 2.0}}], ids=["frequency", "presence",
                                                                                        "repetition"])
def test_a_penalty_changes_a_repeated_token(client, penalty):
    prompt = "Repeat after me: the cat, the cat, the cat, the cat, the cat,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
    toks = plain.choices[0].logprobs.tokens
    assert len(set(toks)) < len(toks)                                    # greedy repeats itself here
    penalized = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0,
                                          **penalty)
    other = penalized.choices[0].logprobs.tokens
    changed = next(i for i, (a, b) in enumerate(zip(toks, other)) if a != b)
    assert toks[changed] in toks[:changed] or toks[changed] in prompt   # where they part, greedy repeated itself
    assert max(other.count(t) for t in set(other)) < max(toks.count(t) for t in set(toks))


def test_logit_bias_bans_or_forces_a_token(client):
    prompt = "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    first = base.choices[0].logprobs.tokens[0]
    (first_id,) = _ids(first)
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(_ids(" banana")[0]): 100})
    assert forced.choices[0].logprobs.tokens == [" banana"]


def _ids(text: str) -> list[int]:
    """Token ids of ``text`` by the server's own tokenizer (built from the GGUF)."""
    from tessera_actors.models.smollm2 import _reader
    from tessera_actors.serving.text import gguf_tokenizer
    return gguf_tokenizer(_reader().metadata).encode(text)


def test_json_mode_output_parses(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=80, temperature=0, response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": "Give the capital of France as JSON "
                                                  "with the key city."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    hot = client.chat.completions.create(model=MODEL, max_tokens=80, temperature=1.0, seed=3, messages=ASK,
                                         response_format={"type": "json_object"})
    if hot.choices[0].finish_reason == "stop":                           # (a long draw may hit max_tokens)
        assert isinstance(json.loads(hot.choices[0].message.content), dict)


def test_a_list_of_prompts_gives_a_choice_each(client):
    r = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text   # greedy
    alone = client.completions.create(model=MODEL, prompt="Red, green,", max_tokens=4, temperature=0)
    assert r.choices[2].text == alone.choices[0].text


def test_embeddings_are_mean_pooled_hidden_states(client):
    r = client.embeddings.create(model=MODEL, input=["The capital of France is Paris.", "Paris is in France.",
                                                     "Bananas are yellow."])
    vecs = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and len(set(map(len, vecs))) == 1 and len(vecs[0]) == 576

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2])
    again = client.embeddings.create(model=MODEL, input="The capital of France is Paris.")
    assert again.data[0].embedding == vecs[0]
    assert r.usage.prompt_tokens == sum(len(_ids(t)) for t in ["The capital of France is Paris.",
                                                                      "Paris is in France.", "Bananas are yellow."])


def test_unknown_fields_are_accepted_with_a_warning_and_counted(client, server):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=ASK, max_tokens=2,
                                                          extra_body={"frobnicate": True, "guided_choice": ["a"]})
    assert raw.http_response.status_code == 200
    warning = raw.headers.get("warning")
    assert "frobnicate" in warning and "guided_choice" in warning
    body = urllib.request.urlopen(server.url + "/metrics").read().decode()
    assert 'tessera_ignored_request_fields_total{field="frobnicate"} 1.0' in body

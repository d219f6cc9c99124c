"""``tessera serve`` as a client sees it: the official ``openai`` package, raw
HTTP for malformed requests, a client that hangs up, /metrics, /health, and a
trace of served steps.  One real server (``tessera serve`` in a child process
over the real AsyncEngine: SmolLM2's 2-layer "tiny" size on two CPU devices)
serves the whole module."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tessera_actors.serving.testing import ServerProcess  # noqa: E402

KEY = "test-key-123"
MAX_BODY = 65536
MODEL = "smollm2"
SERVE_ARGS = ["--model", MODEL, "--size", "tiny", "--devices", "cpu,cpu", "--max-seqs", "2", "--max-queue", "4",
              "--max-model-len", "512", "--api-key", KEY, "--max-body", str(MAX_BODY)]
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trace")


@pytest.fixture(scope="module")
def server(trace_dir):
    with ServerProcess(*SERVE_ARGS, "--trace", str(trace_dir)) as srv:
        yield srv


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def request(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            auth: bool = True) -> tuple[int, dict, bytes]:
    """One raw HTTP request: (status, headers, body)."""
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    h = {"Content-Type": "application/json", **(headers or {})}
    if auth:
        h.setdefault("Authorization", f"Bearer {KEY}")
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def post(server, path: str, obj, **kw):
    return request(server, "POST", path, json.dumps(obj).encode(), **kw)


def metrics(server) -> dict[str, list]:
    status, _, body = request(server, "GET", "/metrics", auth=False)
    assert status == 200
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def total(m: dict, name: str, **labels) -> float:
    return sum(s.value for s in m.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def context_len(client) -> int:
    return client.models.list().data[0].model_extra["max_model_len"]


# ---------------------------------------------------------------- the openai client, unchanged

def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_chat_completion_and_stream_agree(client, server):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 12
    _, _, body = post(server, "/tokenize", {"model": MODEL, "messages": HELLO})
    assert r.usage.prompt_tokens == json.loads(body)["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content          # greedy: streamed and whole replies are the same text
    assert finishes == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completion_of_token_ids(client):
    r = client.completions.create(model=MODEL, prompt=[100, 200, 300, 400, 500], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 5 and 1 <= r.usage.completion_tokens <= 4


def test_completion_streamed(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert whole.usage.completion_tokens <= 8 and whole.choices[0].finish_reason in ("stop", "length")
    parts = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text


def test_bad_request_is_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=-0.5)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=context_len(client) + 1, stream=True)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)


def test_api_key_is_required(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert request(server, "GET", "/health", auth=False)[0] == 200      # health and metrics stay open


# ---------------------------------------------------------------- malformed requests

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
OK_CHAT = {"model": MODEL, "messages": HELLO, "max_tokens": 4}


def _with(**kw):
    return json.dumps({**OK_CHAT, **kw}).encode()


BAD = [  # (name, method, path, raw body, expected status, expected param or None)
    ("JSON array", "POST", CHAT, b"[1, 2]", 400, None),
    ("JSON string", "POST", CHAT, b'"hello"', 400, None),
    ("invalid UTF-8", "POST", CHAT, b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
     400, None),
    ("not JSON", "POST", CHAT, b"{model: smollm2", 400, None),
    ("empty body", "POST", CHAT, b"", 400, None),
    ("NaN", "POST", CHAT, b'{"model": "smollm2", "messages": [], "temperature": NaN}', 400, None),
    ("no messages", "POST", CHAT, json.dumps({"model": MODEL}).encode(), 400, "messages"),
    ("messages a string", "POST", CHAT, _with(messages="hi"), 400, "messages"),
    ("bad role", "POST", CHAT, _with(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    ("content a number", "POST", CHAT, _with(messages=[{"role": "user", "content": 7}]), 400, "messages"),
    ("unknown model", "POST", CHAT, _with(model="gpt-4o"), 404, "model"),
    ("model missing", "POST", CHAT, json.dumps({"messages": HELLO}).encode(), 400, "model"),
    ("max_tokens beyond context", "POST", CHAT, _with(max_tokens=10**6, stream=True), 400, "max_tokens"),
    ("max_tokens zero", "POST", CHAT, _with(max_tokens=0), 400, "max_tokens"),
    ("max_tokens a string", "POST", CHAT, _with(max_tokens="10"), 400, "max_tokens"),
    ("negative temperature", "POST", CHAT, _with(temperature=-1, stream=True), 400, "temperature"),
    ("top_p zero", "POST", CHAT, _with(top_p=0), 400, "top_p"),
    ("stop of numbers", "POST", CHAT, _with(stop=[1, 2]), 400, "stop"),
    ("stream not a bool", "POST", CHAT, _with(stream="yes"), 400, "stream"),
    ("seed a float", "POST", CHAT, _with(seed=1.5), 400, "seed"),
    ("seed beyond int64", "POST", CHAT, _with(seed=2 ** 64), 400, "seed"),
    ("top_k beyond int64", "POST", CHAT, _with(top_k=2 ** 64, stream=True), 400, "top_k"),
    ("logit_bias id beyond int64", "POST", CHAT, _with(logit_bias={str(2 ** 64): 1}), 400, "logit_bias"),
    ("logit_bias id of digits that are not ASCII", "POST", CHAT, _with(logit_bias={"\u00b2": 1}), 400, "logit_bias"),
    ("lone surrogate in content", "POST", CHAT, _with(messages=[{"role": "user", "content": "a\ud800b"}]), 400,
     "messages"),
    ("lone surrogate in a prompt", "POST", COMP, json.dumps({"model": MODEL, "prompt": "\udfff"}).encode(), 400,
     "prompt"),
    ("lone surrogate in stop", "POST", CHAT, _with(stop=["x\ud800"]), 400, "stop"),
    ("n beyond 16", "POST", CHAT, _with(n=17), 400, "n"),
    ("best_of above n", "POST", COMP, json.dumps({"model": MODEL, "prompt": "a", "best_of": 3}).encode(), 400,
     "best_of"),
    ("a JSON schema", "POST", CHAT, _with(response_format={"type": "json_schema", "json_schema": {}}), 400,
     "response_format"),
    ("top_logprobs without logprobs", "POST", CHAT, _with(top_logprobs=2), 400, "top_logprobs"),
    ("frequency_penalty beyond 2", "POST", CHAT, _with(frequency_penalty=3), 400, "frequency_penalty"),
    ("logit_bias of a word", "POST", CHAT, _with(logit_bias={"hello": 1}), 400, "logit_bias"),
    ("tools", "POST", CHAT, _with(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("prompt too long", "POST", COMP, json.dumps({"model": MODEL, "prompt": "hello " * 4000}).encode(), 400,
     "prompt"),
    ("prompt of mixed types", "POST", COMP, json.dumps({"model": MODEL, "prompt": [1, "a"]}).encode(), 400, "prompt"),
    ("token id beyond the vocabulary", "POST", COMP, json.dumps({"model": MODEL, "prompt": [1, 10**9],
                                                                 "stream": True}).encode(), 400, "prompt"),
    ("no prompt", "POST", COMP, json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    ("oversized body", "POST", CHAT, b'{"model": "smollm2", "pad": "' + b"x" * (2 * MAX_BODY) + b'"}', 413, None),
    ("GET on a POST route", "GET", CHAT, None, 405, None),
    ("no such route", "POST", "/v1/nothing", b"{}", 404, None),
]


@pytest.mark.parametrize("name,method,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_malformed_request_is_a_json_4xx(server, name, method, path, body, status, param):
    got, headers, data = request(server, method, path, body)
    assert got == status, data
    assert headers["content-type"].startswith("application/json")      # nothing was streamed
    err = json.loads(data)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "param" in err and "code" in err
    if param is not None:
        assert err["param"] == param, err


def test_lone_surrogates_are_named_and_a_top_p_that_rounds_to_zero_is_greedy(server):
    for body in (_with(messages=[{"role": "user", "content": "a\ud800b"}]), _with(stop=["x\ud800"])):
        status, _, data = request(server, "POST", CHAT, body)
        assert status == 400 and "lone surrogate at character 1" in json.loads(data)["error"]["message"], data
    greedy = post(server, CHAT, {**OK_CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    tiny = post(server, CHAT, {**OK_CHAT, "max_tokens": 6, "temperature": 1, "top_p": 1e-300, "ignore_eos": True})
    assert greedy[0] == tiny[0] == 200, tiny[2]
    text = [json.loads(r[2])["choices"][0]["message"]["content"] for r in (greedy, tiny)]
    assert text[0] == text[1]


def test_still_serving_after_malformed_requests(server, client):
    for _, method, path, body, _, _ in BAD:
        request(server, method, path, body)
    assert request(server, "GET", "/health", auth=False)[0] == 200
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_unauthenticated_is_401_json(server):
    status, _, data = post(server, CHAT, OK_CHAT, auth=False)
    assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------- load, disconnects, metrics

def _finished(server) -> float:
    return total(metrics(server), "tessera_requests_finished_total")


def _wait_for(pred, timeout: float = 60.0, what: str = "condition"):
    """Poll ``pred`` (a cheap HTTP read) until true; fail after ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_client_disconnect_aborts_request(server, client):
    aborted0 = total(metrics(server), "tessera_requests_finished_total", finish_reason="abort")
    u = urlsplit(server.url)
    body = json.dumps({**OK_CHAT, "max_tokens": 400, "stream": True, "stop": [], "ignore_eos": True}).encode()
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while b"data: " not in got:                   # the first streamed event has arrived
            got += s.recv(4096)
        assert got.startswith(b"HTTP/1.1 200")
    _wait_for(lambda: total(metrics(server), "tessera_requests_finished_total", finish_reason="abort") > aborted0,
              what="the abort to be counted")
    stats = json.loads(request(server, "GET", "/v1/tessera/stats")[2])
    assert stats["server"]["in_flight"] == 0
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)   # and it serves again
    assert r.usage.completion_tokens >= 1
    stats = json.loads(request(server, "GET", "/v1/tessera/stats")[2])
    assert stats["engine"]["slots_in_use"] == 0      # the KV slot was freed (once its last step landed)


def test_client_disconnect_aborts_a_whole_reply_request(server):
    aborted0 = total(metrics(server), "tessera_requests_finished_total", finish_reason="abort")
    u = urlsplit(server.url)
    body = json.dumps({**OK_CHAT, "max_tokens": 400, "ignore_eos": True}).encode()
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait_for(lambda: json.loads(request(server, "GET", "/v1/tessera/stats")[2])["server"]["in_flight"] == 1,
                  what="the request to be in flight")
    _wait_for(lambda: total(metrics(server), "tessera_requests_finished_total", finish_reason="abort") > aborted0,
              what="the abort to be counted")
    # the KV slot is freed once no step in flight still writes its row
    _wait_for(lambda: json.loads(request(server, "GET", "/v1/tessera/stats")[2])["engine"]["slots_in_use"] == 0,
              what="the KV slot to be freed")


def test_full_queue_is_429(server):
    # two KV slots, four waiting places: of ten long requests at once, some are refused with 429
    body = json.dumps({**OK_CHAT, "max_tokens": 60, "ignore_eos": True}).encode()
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda _: request(server, "POST", CHAT, body), range(10)))
    statuses = sorted(r[0] for r in results)
    assert 429 in statuses and 200 in statuses, statuses
    err = json.loads(next(r[2] for r in results if r[0] == 429))["error"]
    assert err["type"] == "rate_limit_error"


def test_metrics_and_placement(server, client):
    before = metrics(server)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    after = metrics(server)
    n = r.usage.completion_tokens
    assert total(after, "tessera_generation_tokens_total") - total(before, "tessera_generation_tokens_total") == n
    assert (total(after, "tessera_prompt_tokens_total") - total(before, "tessera_prompt_tokens_total")
            == r.usage.prompt_tokens)
    for hist in ("tessera_time_to_first_token_seconds_count", "tessera_e2e_request_latency_seconds_count"):
        assert total(after, hist) == total(before, hist) + 1
    assert total(after, "tessera_http_requests_total", endpoint="/v1/chat/completions", status="200") >= 1
    assert len(after["tessera_device_kernels"]) == 2                  # one series per device
    assert sum(s.value for s in after["tessera_device_kernels"]) > 0
    assert total(after, "tessera_kv_slots_total") == 2
    assert len(after["tessera_plan_in_use"]) == 1 and after["tessera_plan_in_use"][0].labels["plan"]
    for name in ("tessera_queue_depth", "tessera_kv_slots_in_use", "tessera_bytes_moved_per_step",
                 "tessera_plan_switches_total", "tessera_healthy"):
        assert name in after, name
    # where the memory goes: the process, and what the devices allocated (weights, KV cache, activations)
    assert total(after, "tessera_process_resident_bytes") > total(after, "tessera_weight_bytes") > 0
    assert (total(after, "tessera_device_bytes") >= total(after, "tessera_weight_bytes")
            + total(after, "tessera_kv_cache_bytes") + total(after, "tessera_activation_bytes"))
    assert total(after, "tessera_activation_bytes") > 0

    stats = json.loads(request(server, "GET", "/v1/tessera/stats")[2])
    place = stats["engine"]["placement"]
    assert len(place["devices"]) == 2 and len(place["kernels_per_device"]) == 2
    assert sum(place["kernels_per_device"]) > 0
    health = json.loads(request(server, "GET", "/health", auth=False)[2])
    assert health["status"] == "ok" and health["lost"] == []
    assert 2 <= health["buckets_placed"] <= health["buckets"] == stats["engine"]["buckets"]


def test_bench_serve_against_the_server(server, tmp_path, capsys):
    from tessera_actors.cli import main
    # 4 requests: fewer than the server's 4 waiting places, so none is refused
    rc = main(["bench", "serve", "--url", server.url, "--api-key", KEY, "--requests", "4", "--rate", "20",
               "--prompt-tokens", "20-60", "--output-tokens", "4-8", "--out", str(tmp_path), "--name", "b"])
    table = capsys.readouterr().out
    assert rc == 0, table
    doc = json.loads((tmp_path / "b.json").read_text())
    s = doc["summary"]["http"]
    assert s["finished"] == 4, s["errors"]
    assert s["output_tokens"] == sum(r["target_output_tokens"] for r in doc["records"]["http"])
    assert s["prompt_tokens_exact"] == 4            # prompts built to the server's own token counts
    assert doc["provenance"]["git_commit"] and doc["provenance"]["command"] and doc["provenance"]["machine"]["cpus"]
    assert doc["config"]["requests"] == 4 and doc["config"]["url"] == server.url
    # a conversation: each turn resends the chat so far (the real replies) through /v1/chat/completions
    rc = main(["bench", "serve", "--url", server.url, "--api-key", KEY, "--trace", "conversation", "--requests", "4",
               "--turns", "2", "--rate", "20", "--prompt-tokens", "5-10", "--output-tokens", "3-5",
               "--out", str(tmp_path), "--name", "c"])
    assert rc == 0, capsys.readouterr().out
    recs = json.loads((tmp_path / "c.json").read_text())["records"]["http"]
    assert all(r["error"] is None for r in recs)
    assert recs[1]["prompt_tokens"] > recs[0]["prompt_tokens"]     # turn 2 carries turn 1 and its reply
    assert "output tok/s" in table and "TPOT p99 ms" in table


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_health_is_503_while_a_node_is_lost():
    """Two node processes; one is killed mid-stream: /health answers 503 until the
    engine has re-placed on the survivor, then 200, and the streamed reply completes."""
    with ServerProcess("--model", MODEL, "--size", "tiny", "--nodes", "cpu;cpu", "--max-model-len", "512") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        nodes = _children(srv.proc.pid)
        assert len(nodes) == 2, nodes
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        parts = iter(stream)
        text = next(parts).choices[0].text              # streaming has begun
        os.kill(nodes[1], signal.SIGKILL)

        def unhealthy():
            status, _, body = request(srv, "GET", "/health", auth=False)
            return json.loads(body) if status == 503 else None
        assert _wait_for(unhealthy, what="/health to report the loss")["status"] == "unhealthy"
        text += "".join(p.choices[0].text for p in parts)    # the reply goes on after re-placement
        assert request(srv, "GET", "/health", auth=False)[0] == 200
        assert len(json.loads(request(srv, "GET", "/health", auth=False)[2])["lost"]) == 1
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
        assert r.usage.completion_tokens >= 1 and text


def test_device_busy_fraction(server, client):
    client.completions.create(model=MODEL, prompt="One", max_tokens=4)
    busy = metrics(server).get("tessera_device_busy_fraction", [])
    assert len(busy) == 2 and all(0.0 <= s.value <= 1.0 for s in busy)
    assert any(s.value > 0 for s in busy)             # the devices did compute


def test_trace_of_served_steps(server, client, trace_dir):
    """Runs last: stops the server (SIGTERM: exit 0) and reads the trace it wrote."""
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=10, extra_body={"ignore_eos": True})
    assert server.stop() == 0, server.output()
    files = sorted(trace_dir.rglob("*.json"))
    assert files, f"no trace file in {trace_dir}"
    events = []
    for f in files:
        doc = json.loads(f.read_text())
        events += doc["traceEvents"] if isinstance(doc, dict) else doc
    spans = [e for e in events if e.get("ph") == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in spans)
    track = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_track: dict[str, list[dict]] = {}
    for e in spans:
        by_track.setdefault(track.get((e["pid"], e["tid"]), "?"), []).append(e)
    devices = [t for t in by_track if t.startswith("device")]
    assert len(devices) == 2, sorted(by_track)                      # one track per device
    for t in devices:
        assert any(e["name"].startswith("run ") for e in by_track[t]), t   # each ran kernels
    engine_steps = by_track.get("engine", [])
    assert len(engine_steps) >= 20                                   # ~20 served steps at least
    assert {e["name"].split(":")[0] for e in engine_steps} >= {"prefill", "decode"}   # the batching decisions

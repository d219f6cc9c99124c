"""Embedding in an async server: the generation service and the HTTP chat
example, on a tiny random Llama with in-process CPU devices."""
import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch

from tessera_actors import models
from tessera_actors.service import GenerationService, ServiceBusy, ServiceConfig

CFG = ServiceConfig(model="llama", size="tiny", nodes=(), devices="cpu,cpu", max_queue=2)


def eager_greedy(prompt, n):
    m = models.get("llama", "tiny", dtype=torch.float32, seed=0)
    out, logits = [], None
    with torch.no_grad():
        for pos, tok in enumerate(prompt):
            logits = m(input_ids=torch.tensor([[tok]]), positions=torch.tensor([pos]))
        for pos in range(len(prompt), len(prompt) + n):
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            logits = m(input_ids=torch.tensor([[tok]]), positions=torch.tensor([pos]))
    return out


async def test_service_streams_the_eager_models_tokens_and_queues_requests():
    async with GenerationService(CFG) as svc:
        assert len(svc.plan.devices) == 2 and svc.plan.transfers
        want = eager_greedy([5, 6, 7], 6)
        got = [t async for t in svc.generate([5, 6, 7], 6)]
        assert got == want

        async def one():
            return [t async for t in svc.generate([5, 6, 7], 6)]
        # three concurrent requests: two wait (max_queue=2), all are served, none lost
        results = await asyncio.gather(one(), one(), one())
        assert results == [want] * 3
        # a fourth waiting request beyond the line is refused at once
        tasks = [asyncio.create_task(one()) for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(ServiceBusy):
            await one()
        assert await asyncio.gather(*tasks) == [want] * 3
        with pytest.raises(ValueError, match="exceeds the context"):
            [t async for t in svc.generate([1] * 60, 10)]


def load_example():
    path = Path(__file__).resolve().parent.parent / "examples" / "chat_service.py"
    spec = importlib.util.spec_from_file_location("chat_service", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def test_chat_http_example_answers_and_rejects_bad_input():
    pytest.importorskip("aiohttp")
    from aiohttp.test_utils import TestClient, TestServer
    chat = load_example()
    async with TestClient(TestServer(chat.make_app(CFG))) as client:
        r = await client.post("/chat", json={"message": "hi", "max_tokens": 5})
        assert r.status == 200
        body = await r.json()
        assert body["tokens"] == 5 and len(body["reply"].split()) == 5
        r = await client.post("/chat", data=b"not json")
        assert r.status == 400 and "not JSON" in await r.text()
        r = await client.post("/chat", json={"message": "hi", "max_tokens": 0})
        assert r.status == 400
        r = await client.post("/chat/stream", json={"message": "hi", "max_tokens": 4})
        assert r.status == 200 and len((await r.text()).split()) == 4
        r = await client.get("/health")
        assert "segments" in (await r.json())["plan"]


async def test_lost_node_mid_request_is_replaced_and_the_reply_continues():
    """Kill one of two node processes during a request: the service reports
    it, re-places the graph on the survivor and finishes the same reply."""
    cfg = ServiceConfig(model="llama", size="tiny", nodes=("cpu", "cpu"), step_timeout=3.0, ping_timeout=1.0)
    want = eager_greedy([5, 6, 7], 10)
    async with GenerationService(cfg) as svc:
        assert len({ep for _, ep, _ in svc.routes}) == 2
        got = []
        async for tok in svc.generate([5, 6, 7], 10):
            got.append(tok)
            if len(got) == 3:
                svc.cluster.nodes[1].proc.kill()
        assert got == want
        assert len(svc.plan.devices) == 1 and svc.generation == 1

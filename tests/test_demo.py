"""The main job: split greedy decoding over two node processes (tcp loopback)
gives the single-device tokens, bitwise."""
import pytest

from tessera_actors.demo import DemoConfig, run_demo


async def test_demo_split_over_two_node_processes_matches_single_device():
    lines = []
    status = await run_demo(DemoConfig(prompt_len=5, new_tokens=12), out=lines.append)
    text = "\n".join(lines)
    assert status == 0, text
    assert "tokens IDENTICAL, logits bitwise equal" in text
    single = [l for l in lines if l.startswith("single device")]
    split = [l for l in lines if l.startswith("split ")]
    tokens = lambda line: line[line.index("["):line.index("]") + 1]  # noqa: E731
    assert len(single) == len(split) == 4
    assert [tokens(a) for a in single] == [tokens(b) for b in split]
    assert "nodes exited with [0, 0]" in text
    # the placement really uses both processes, and bytes crossed between them
    moved = next(l for l in lines if "bytes moved between devices" in l)
    assert "plan predicts 0" not in moved


@pytest.mark.gpu
async def test_demo_on_cuda_node_processes_matches_single_gpu():
    import torch
    nodes = ("cuda:0", "cuda:1") if torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")
    lines = []
    status = await run_demo(DemoConfig(nodes=nodes, prompt_len=4, new_tokens=8), out=lines.append)
    assert status == 0, "\n".join(lines)
    assert "tokens IDENTICAL" in "\n".join(lines)

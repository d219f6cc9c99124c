"""Graph files carry a checksum: every bit flip of a real saved graph is
refused with a ``GraphError`` (or, where it cannot matter, loads the same
graph), and malformed graph data is always a ``GraphError`` with a reason -
never a ``KeyError`` or ``TypeError``."""
import random
from pathlib import Path

import msgpack
import pytest

from tessera_actors.graph import FILE_MAGIC, GraphError, KernelGraph

REAL = Path(__file__).resolve().parent.parent / "data" / "graphs" / "llama-decode-b8.tgraph"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("g") / "llama.tgraph"
    KernelGraph.load(REAL).save(path)
    return path


def test_saved_graph_starts_with_magic_and_round_trips(saved):
    data = saved.read_bytes()
    assert data.startswith(FILE_MAGIC)
    assert KernelGraph.load(saved).to_dict() == KernelGraph.load(REAL).to_dict()


def test_every_bit_flip_is_rejected_or_loads_identically(saved, tmp_path):
    data = saved.read_bytes()
    reference = KernelGraph.load(saved).to_dict()
    rng = random.Random(13)
    # every bit of the magic and checksum, then 400 random bits of the body
    positions = [(i, b) for i in range(len(FILE_MAGIC) + 32) for b in range(8)]
    positions += [(rng.randrange(len(FILE_MAGIC) + 32, len(data)), rng.randrange(8)) for _ in range(400)]
    rejected = 0
    flipped = tmp_path / "flipped.tgraph"
    for i, bit in positions:
        corrupt = bytearray(data)
        corrupt[i] ^= 1 << bit
        flipped.write_bytes(corrupt)
        try:
            g = KernelGraph.load(flipped)
        except GraphError as e:
            assert str(e).strip(), "a GraphError must give a reason"
            rejected += 1
            continue
        assert g.to_dict() == reference, f"flip of bit {bit} at byte {i} loaded a different graph"
    assert rejected == len(positions)   # with a checksum none of them should load


def test_checksum_mismatch_names_the_reason(saved, tmp_path):
    data = bytearray(saved.read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "bad.tgraph").write_bytes(data)
    with pytest.raises(GraphError, match="checksum mismatch"):
        KernelGraph.load(tmp_path / "bad.tgraph")
    with pytest.raises(GraphError, match="cannot read"):
        KernelGraph.load(tmp_path / "missing.tgraph")


def _mutations(d: dict, rng: random.Random):
    """Structurally malformed variants of a graph dict (plain msgpack, no checksum)."""
    yield []
    yield {"version": 1}
    for key in ("buffers", "kernels", "inputs", "outputs", "meta"):
        yield {k: v for k, v in d.items() if k != key}
        for junk in (None, 7, "x", [1], {"a": 1}, [[None] * 11]):
            yield {**d, key: junk}
    for _ in range(300):
        m = msgpack.unpackb(msgpack.packb(d), strict_map_key=False)
        rows = m[rng.choice(["buffers", "kernels"])]
        row = rows[rng.randrange(len(rows))]
        field = rng.randrange(len(row))
        row[field] = rng.choice([None, -1, 1 << 62, "s", 2.5, [], [[0, 0]], {"k": 1}, [[999999, 0, 4, "r"]],
                                 [[0, -5, 4, "r"]], [[0, 0, 1 << 40, "w"]], True])
        if rng.random() < 0.2:
            del row[rng.randrange(len(row))]
        yield m
    yield {**d, "outputs": [424242]}
    yield {**d, "inputs": {"x": "y"}}


def test_malformed_graph_data_is_always_a_graph_error(tmp_path):
    d = KernelGraph.load(REAL).to_dict()
    rng = random.Random(5)
    path = tmp_path / "legacy.tgraph"
    for m in _mutations(d, rng):
        path.write_bytes(msgpack.packb(m, use_bin_type=True))
        try:
            KernelGraph.load(path)
        except GraphError:
            pass   # any other exception type fails the test

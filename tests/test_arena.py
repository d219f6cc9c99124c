"""The served arena's logic on CPU devices: every policy serves the same
requests through the engine, rows named by what ran, a bound above them."""
import json

from tessera_actors.bench.arena import ArenaConfig, ideal_split, print_table, run_arena


def test_every_policy_serves_the_trace_and_the_bound_bounds_them(tmp_path):
    cfg = ArenaConfig(models=("llama",), devices=("cpu", "cpu?threads=1"), layers=0, size="tiny", dtype="float32",
                      seqs=4, context=128, prompt=20, out_tokens=6, requests=4, rate=50.0, reps=1,
                      out=str(tmp_path), log=lambda *a: None)
    results = run_arena(cfg)
    rows = {r["policy"]: r for r in results[0]["rows"]}
    for policy in ("Homo-L", "Homo-R", "Request Distribution", "layer split", "AF", "Tessera"):
        row = rows[policy]
        assert "error" not in row, row
        for trace in ("conversation", "offline"):
            t = row["traces"][trace]
            assert t["finished"] == t["requests"] == 4 and t["output_tok_s_median"] > 0
            assert 0 < t["of_bound"] < 1                      # the bound is above every served row
    assert rows["Homo-L"]["devices"] == ["cpu"] and rows["Request Distribution"]["ran"] == "contiguous + contiguous"
    assert rows["AF"]["ran"].startswith("af") and rows["Tessera"]["ran"].startswith("tessera-")
    assert rows["PD"]["error"].startswith("not run")
    saved = json.loads((tmp_path / "arena.json").read_text())
    assert saved["git_commit"] and saved["results"][0]["bound"]["output_tok_s"] > 0
    assert "| llama | Tessera |" in print_table(results, cfg)


def test_the_ideal_split_balances_kernels_by_their_times():
    # two kernels, each 1 s on its good device and 3 s on the other: one each
    assert ideal_split([[1.0, 3.0], [3.0, 1.0]]) == 1.0
    assert ideal_split([[2.0, 2.0]]) == 4.0
    assert ideal_split([[1.0], [1.0]]) == 0.5              # relaxed: a kernel may be split

"""The arena's logic on CPU devices (functional only: timings on a shared
2-core machine mean nothing): every policy runs and is reported, the mix's
prediction comes from its schedule, JSON is written."""
import json

from tessera_actors.arena import ArenaConfig, ideal_split, print_table, run_arena


def test_arena_runs_every_policy_on_cpu_devices(tmp_path):
    cfg = ArenaConfig(models=("llama",), devices=("cpu", "cpu?threads=1"), layers=2, batch=2, cache=32,
                      prompt=8, out_tokens=4, steps=2, dtype="float32", size="tiny", out=str(tmp_path),
                      max_slots=3, log=lambda *a: None)
    results = run_arena(cfg)
    rows = {r["policy"]: r for r in results[0]["decode"]}
    for policy in ("Homo-L", "Homo-R", "Request Distribution", "AF", "layer split", "Tessera latency",
                   "Tessera throughput", "Tessera mix"):
        assert rows[policy]["tokens_per_s"] > 0, policy
    mix = rows["Tessera mix"]
    assert mix["predicted_us"] > 0 and len(mix["busy"]) == 2 and all(b >= 0 for b in mix["busy"])
    assert rows["Homo-L"]["busy"][1] == 0.0                     # L alone leaves R idle
    assert "workload_tokens_per_s" not in results[0]             # served numbers only, from the engine
    assert set(results[0]["prefill_us"]) == {"Homo-L", "Homo-R", "Tessera"}
    saved = json.loads((tmp_path / "arena.json").read_text())
    assert saved["results"][0]["model"] == "llama"
    assert (tmp_path / "llama-decode-b2.tgraph").exists() and (tmp_path / "llama-decode-b2.costs.json").exists()
    assert "| llama | Tessera mix |" in print_table(results, cfg)


def test_the_ideal_split_balances_kernels_by_their_times():
    # two kernels, each 1 s on its good device and 3 s on the other: one each
    assert ideal_split([[1.0, 3.0], [3.0, 1.0]]) == 1.0
    # one device much faster everywhere: everything there
    assert ideal_split([[1.0, 1.0], [10.0, 10.0]]) == 2.0

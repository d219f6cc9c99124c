"""Merge repeated ``scripts/profile_sms.py`` runs into one profile set.

Each run directory holds ``MODEL-BUCKET.tgraph`` + ``MODEL-BUCKET.profile.json``
(see profile_sms.py).  The output takes every graph of the LAST run given
(the newest code); where an earlier run profiled the same graph (same kernel
count and the same kernel signatures in the same order) each kernel's time
at each SM count is the minimum over those runs (best of N: interference and
clock dips only ever add time; a single run shows per-run offsets of a few
microseconds on the ~2.5 us kernels).  A graph that changed between runs
keeps the last run's times alone, and the earlier run's graph is kept too,
as ``MODEL-BUCKET-RUN`` (another program of the same model: more kernels to
fit on).  Each merged ``profile.json`` records ``runs`` (how many runs were
merged) and ``merged_from``.

    python scripts/merge_profile_runs.py RUN_DIR [RUN_DIR ...] --out DIR
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera_actors.provenance import provenance  # noqa: E402


def signatures(tgraph: Path) -> list[str]:
    from tessera_actors.graph import KernelGraph
    g = KernelGraph.load(tgraph)
    return [k.signature or k.name for k in g.kernels]


def merge(runs: list[Path], out: Path) -> dict[str, int]:
    """Write the merged set to ``out``; returns graph tag -> runs merged."""
    out.mkdir(parents=True, exist_ok=True)
    last = runs[-1]
    merged: dict[str, int] = {}
    for pj in sorted(last.glob("*.profile.json")):
        tag = pj.name[: -len(".profile.json")]
        doc = json.loads(pj.read_text())
        sig = signatures(last / f"{tag}.tgraph")
        used = [last.name]
        for other in runs[:-1]:
            opj = other / pj.name
            if not opj.exists():
                continue
            if signatures(other / f"{tag}.tgraph") != sig:
                odoc = json.loads(opj.read_text())
                odoc["runs"], odoc["merged_from"] = 1, [other.name]
                odoc.update(provenance())
                (out / f"{tag}-{other.name}.profile.json").write_text(json.dumps(odoc))
                shutil.copyfile(other / f"{tag}.tgraph", out / f"{tag}-{other.name}.tgraph")
                merged[f"{tag}-{other.name}"] = 1
                continue
            odoc = json.loads(opj.read_text())
            for s, times in doc["times"].items():
                if s in odoc["times"]:
                    doc["times"][s] = [min(a, b) for a, b in zip(times, odoc["times"][s])]
            used.append(other.name)
        doc["step_s"] = {s: sum(v) for s, v in doc["times"].items()}
        doc["runs"], doc["merged_from"] = len(used), used
        doc.update(provenance())   # the merge: its command names the runs merged
        (out / pj.name).write_text(json.dumps(doc))
        shutil.copyfile(last / f"{tag}.tgraph", out / f"{tag}.tgraph")
        merged[tag] = len(used)
    return merged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="profile_sms.py output directories, oldest first")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = [Path(r) for r in args.runs]
    for r in runs:
        if not any(r.glob("*.profile.json")):
            print(f"merge_profile_runs: no profiles in {r}", file=sys.stderr)
            return 2
    for tag, n in merge(runs, Path(args.out)).items():
        print(f"{tag}: {n} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

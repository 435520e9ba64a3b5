"""Peak memory does not grow with corpus size: the same job on N and 10 N documents.

    .venv/bin/python benchmarks/memory_scaling.py [--docs 100] [--factor 10]

Each size runs in its own process (embedded Ray, MiniLM, every analysis on); a sampler records the
largest resident set of the driver and of every ShardWorker actor process while the job runs, and
each shard reports the worker's resident set after it (the steady state: it must stay flat).
The peak is the largest single batch's working set, so it depends on which shards a corpus has,
not on how many.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _job(n_docs: int, work: Path) -> dict:
    import psutil

    from actlake.config import parse_config
    from actlake.corpus.sample import write_sample
    from actlake.jobs.extract.run import run_job

    write_sample(work / "corpus", n_docs, n_files=2)
    cfg = parse_config({"name": "mem", "corpus": {"paths": [str(work / "corpus" / "*.jsonl.zst")]},
                        "tokenization": {"max_length": 128, "max_windows_per_doc": 4},
                        "sharding": {"docs_per_shard": 50}, "output": {"dir": str(work / "runs"), "report": False}})
    peak = {"driver": 0, "worker": 0}
    done = threading.Event()

    def sample():
        me = psutil.Process()
        while not done.is_set():
            peak["driver"] = max(peak["driver"], me.memory_info().rss)
            for p in psutil.process_iter(["cmdline", "memory_info"]):
                if "ShardWorker" in " ".join(p.info["cmdline"] or []) and p.info["memory_info"]:
                    peak["worker"] = max(peak["worker"], p.info["memory_info"].rss)
            time.sleep(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    after_shard = []
    res = run_job(cfg, on_shard=lambda summary: after_shard.append(summary["worker_rss_mb"]))
    done.set()
    t.join()
    return {"docs": n_docs, "tokens": res.totals["tokens"], "shards": res.shards_total, "seconds": res.wall_seconds,
            "driver_peak_mb": peak["driver"] / 2**20, "worker_peak_mb": peak["worker"] / 2**20,
            "worker_rss_after_shards_mb": [round(x) for x in after_shard]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--factor", type=int, default=10)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_job(int(args.child[0]), Path(args.child[1]))))
        return 0
    rows = []
    for n in (args.docs, args.docs * args.factor):
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run([sys.executable, __file__, "--child", str(n), tmp], capture_output=True, text=True,
                                 env=dict(os.environ, HF_HUB_OFFLINE="1"))
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{r['docs']:>6} docs, {r['tokens']:>9,} tokens, {r['shards']:>3} shards, {r['seconds']:6.1f}s: "
                  f"driver peak {r['driver_peak_mb']:,.0f} MB, worker peak {r['worker_peak_mb']:,.0f} MB", flush=True)
            after = r["worker_rss_after_shards_mb"]
            print(f"        worker RSS after each shard: first {after[0]} MB, last {after[-1]} MB, "
                  f"min {min(after)} MB, max {max(after)} MB", flush=True)
    small, large = rows
    print(f"\n{args.factor}x the corpus: driver peak x{large['driver_peak_mb'] / small['driver_peak_mb']:.2f}, "
          f"worker peak x{large['worker_peak_mb'] / small['worker_peak_mb']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

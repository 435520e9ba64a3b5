"""A whole job against the plain forward pass over exactly its windows: what a user pays, and where it goes.

    .venv/bin/python benchmarks/end_to_end.py [CONFIG] [--repeats 2] [--max-docs N] [--out DIR] [--json FILE]

CONFIG defaults to the embedded default job (the quick start: MiniLM over the 400 sample documents). Each round
runs the job (a real ``actlake run`` through :func:`~actlake.jobs.extract.run.run_job`: embedded Ray, workers,
commits, reduce; the report off) under a new run id, then the plain forward pass in this process: the model
loaded as the job loads it (same dtype and attention), ``torch.no_grad()``, with the job's worker thread count,
over the job's own windows rebuilt from its ``tokens`` table and batched as the job batches them (shard by
shard); then the job's
forward pass with its analyses over the same batches in this process (the shard's compute without Ray, reading or
writing). Rounds alternate the three, so a busy machine slows all of them.

Prints, per round and as the median: the job's wall time, the plain pass's and the in-process analyses' (model
loads excluded), their ratios; the OpenMP wait policy the workers got; the job's time breakdown (``summary.json``'s
``seconds``: the driver's phases and the workers' time per phase); "inside the shards" (read + compute + write + merge +
commit) against plain and against the in-process analyses; and what the per-token tables (``tokens``,
``residual_norms``) store per token and cost in the shards' write time. On a GPU machine without Ray or DuckDB
(the lent device) it cannot run: ``benchmarks/gpu_session.sh`` measures the forward pass and one shard there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PER_TOKEN = ("tokens", "residual_norms")


def run_once(cfg, run_id: str) -> dict:
    """One job under ``run_id``: its wall time and ``summary.json``."""
    from actlake.jobs.extract.run import run_job

    cfg = cfg.model_copy(update={"output": cfg.output.model_copy(update={"run_id": run_id, "report": False})})
    t0 = time.perf_counter()
    res = run_job(cfg, report=False)
    return {"wall": time.perf_counter() - t0, "summary": res.totals, "run_dir": res.run_dir}


def job_windows(run_dir: str, cfg) -> list:
    """The job's windows, rebuilt from its ``tokens`` table, in the job's batches (each shard's windows batched
    apart, as its worker batches them)."""
    from actlake.batching import Window, make_batches
    from actlake.storage.sql import query

    rows = query(run_dir, "SELECT shard, doc_id, window_index, source, list(token_id ORDER BY position) AS ids "
                          "FROM tokens GROUP BY ALL ORDER BY shard, doc_id, window_index").to_pylist()
    by_shard: dict = {}
    for r in rows:
        by_shard.setdefault(r["shard"], []).append(Window(r["doc_id"], r["window_index"], r["ids"], r["source"]))
    return [b for ws in by_shard.values() for b in make_batches(ws, cfg.batching, cfg.analyses.by_source)]


def plain_forward(lm, batches, pad_id: int) -> float:
    """Seconds for the model's own forward pass over ``batches`` (right-padded, as the job pads)."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            T = max(len(w.ids) for w in batch)
            ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), T), dtype=torch.long)
            for i, w in enumerate(batch):
                ids[i, : len(w.ids)] = torch.tensor(w.ids)
                mask[i, : len(w.ids)] = 1
            lm.model(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device))
    return time.perf_counter() - t0


def suite_forward(extractor, batches) -> float:
    """Seconds for the job's forward pass with its analyses over ``batches`` in this process (what a shard computes,
    without Ray, reading or writing; the first call includes the worker's first-batch self-check, as a job does)."""
    t0 = time.perf_counter()
    acc = extractor.shard_results(None, 1.0)
    for result in extractor.forward.run(batches):
        acc.add(result)
    acc.finish()
    return time.perf_counter() - t0


def worker_threads(cfg) -> int:
    """The torch threads of the job's workers (from a Ray started and stopped here: each job starts its own)."""
    import ray

    from actlake.jobs.common.ray_env import init_ray
    from actlake.jobs.extract.run import _worker_shape

    init_ray(None)
    try:
        return _worker_shape(cfg)[3]
    finally:
        ray.shutdown()


def wait_policy(env: dict) -> str:
    """What the job's workers did between OpenMP regions: libgomp's spinning, unless told otherwise."""
    if "OMP_WAIT_POLICY" in env:
        return env["OMP_WAIT_POLICY"]
    return f"GOMP_SPINCOUNT={env['GOMP_SPINCOUNT']}" if "GOMP_SPINCOUNT" in env else "spin"


def per_token_bytes(run_dir: str, tokens: int) -> dict:
    return {t: sum(p.stat().st_size for p in (Path(run_dir) / "tables" / t).rglob("*.parquet")) / max(tokens, 1)
            for t in PER_TOKEN}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="a job config (default: the embedded default job)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-docs", type=int, help="corpus.max_docs (a CI-sized run)")
    p.add_argument("--out", help="folder for the runs (default: a temporary one, removed)")
    p.add_argument("--json", help="write the rounds here")
    args = p.parse_args(argv)

    import torch

    from actlake.config import load_config
    from actlake.jobs.common import ray_env
    from actlake.jobs.extract.driver import Extractor
    from actlake.model import load_model

    with tempfile.TemporaryDirectory() as tmp:
        overrides = {"output.dir": args.out or tmp}
        if args.max_docs:
            overrides["corpus.max_docs"] = args.max_docs
        cfg = load_config(args.config, overrides=overrides)  # None: the embedded default
        threads = worker_threads(cfg)
        rounds = []
        lm = batches = None
        for i in range(args.repeats):
            job = run_once(cfg, f"end-to-end-{int(time.time())}-{i}")
            if lm is None:  # the in-process models, loaded once (their load is not timed)
                if threads > 0:
                    torch.set_num_threads(threads)
                lm = load_model(cfg.model)
                extractor = Extractor(cfg, load_model(cfg.model, lm_head=cfg.analyses.surprisal))
                batches = job_windows(job["run_dir"], cfg)
            plain = plain_forward(lm, batches, lm.tokenizer.pad_token_id or 0)
            suite = suite_forward(extractor, batches)
            s = job["summary"]
            rounds.append({"job_s": job["wall"], "plain_s": plain, "suite_s": suite, "ratio": job["wall"] / plain,
                           "omp_wait_policy": wait_policy(ray_env.workers_env),
                           "tokens": s["tokens"], "seconds": s["seconds"], "batches": len(batches),
                           "job_batches": s.get("batches"),
                           "bytes_per_token": per_token_bytes(job["run_dir"], s["tokens"])})
            print(f"round {i + 1}: job {job['wall']:.1f}s, plain forward {plain:.1f}s: {job['wall'] / plain:.2f}x; "
                  f"the job's analyses in this process {suite:.1f}s", flush=True)
    _print(rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
    return 0


def _print(rounds: list[dict]) -> None:
    med = lambda f: statistics.median(f(r) for r in rounds)
    job, plain, suite = med(lambda r: r["job_s"]), med(lambda r: r["plain_s"]), med(lambda r: r["suite_s"])
    sec = {k: med(lambda r, k=k: r["seconds"].get(k, 0.0)) for k in rounds[0]["seconds"]}
    inside = sec["read"] + sec["compute"] + sec["write"] + sec.get("merge", 0.0) + sec["commit"]
    started = sec.get("worker_start", 0.0)
    workers_other = sec["dispatch"] - sec["ray_start"] - started - sec["model_load"] - inside
    stop = sec.get("ray_stop", 0.0)
    print(f"\n{rounds[0]['tokens']:,} tokens; medians of {len(rounds)} round(s)")
    print(f"{'job wall':<34}{job:8.1f} s   {job / plain:5.2f}x plain")
    print(f"{'plain forward (same windows)':<34}{plain:8.1f} s")
    print(f"{'workers OpenMP wait policy':<34}{', '.join(sorted({r['omp_wait_policy'] for r in rounds})):>8}")
    print(f"{'analyses in process (same windows)':<34}{suite:8.1f} s   {suite / plain:5.2f}x plain")
    print(f"{'inside the shards':<34}{inside:8.1f} s   {inside / plain:5.2f}x plain, {inside / suite:5.2f}x in process")
    startup = sec["before_dispatch"] + sec["ray_start"] + started + sec["model_load"]
    print(f"{'start-up + reduce + Ray stop':<34}{startup + sec['reduce'] + stop:8.1f} s")
    rows = [("before dispatch (checks, plan)", sec["before_dispatch"]), ("Ray start", sec["ray_start"]),
            ("workers: start (process, imports)", started), ("model load (workers)", sec["model_load"]),
            ("read + tokenise", sec["read"]), ("forward + analyses", sec["compute"]), ("write tables", sec["write"]),
            ("publish + merge into the group", sec.get("merge", 0.0)), ("commits", sec["commit"]),
            ("workers: between shards, idle", workers_other), ("reduce", sec["reduce"]),
            ("Ray stop (beyond the reduce)", stop),
            ("rest of the driver", job - sec["before_dispatch"] - sec["dispatch"] - sec["reduce"] - stop)]
    print("breakdown (worker time summed over workers):")
    for name, v in rows:
        if v < 0:  # several workers, or read-ahead overlapping reading with compute: worker-seconds exceed the wall
            print(f"  {name:<34}     n/a  (worker-seconds exceed dispatch's wall: several workers or read-ahead)")
        else:
            print(f"  {name:<34}{v:8.2f} s  {100 * v / job:5.1f} %")
    write_share = sec["write"] / inside if inside else 0.0
    for t in PER_TOKEN:
        print(f"{t:<34}{med(lambda r, t=t: r['bytes_per_token'][t]):8.1f} bytes/token")
    print(f"{'writing every table':<34}{100 * write_share:7.1f} % of the shards' time")


if __name__ == "__main__":
    sys.exit(main())

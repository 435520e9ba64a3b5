"""``actlake run``: parse config, plan shards, dispatch to Ray actors, reduce, report."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass

from actlake.config import JobConfig
from actlake.errors import ActlakeError, StorageError
from actlake.jobs.dispatch import Dispatcher
from actlake.jobs.plan import make_plan, plan_hash
from actlake.jobs.progress import Progress
from actlake.storage.layout import RunLayout, write_json_atomic
from actlake.storage.shards import read_record

log = logging.getLogger("actlake.run")


@dataclass
class RunResult:
    run_dir: str
    shards_total: int
    shards_run: int
    totals: dict
    wall_seconds: float
    report: str | None


def init_ray(address: str | None, dashboard: bool = False) -> bool:
    """Connect to ``address`` / RAY_ADDRESS, or start an embedded Ray bound to 127.0.0.1. True if we started it.

    ``dashboard``: start the embedded Ray with its dashboard, whose state API Ray Train's
    controller polls (without it, Ray Train logs a warning every second)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(include_dashboard=dashboard, dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1", log_to_driver=True,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    return True


def _worker_shape(cfg: JobConfig) -> tuple[int, float, float, int]:
    """(workers, cpus each, gpus each, torch threads) from the config and the cluster."""
    import ray

    r = cfg.resources
    res = ray.cluster_resources()
    gpus = r.gpus_per_worker or (1.0 if res.get("GPU", 0) >= 1 else 0.0)
    n = r.num_workers or (max(1, int(res.get("GPU", 0) // gpus)) if gpus else 1)
    biggest_node = max((nd["Resources"].get("CPU", 0) for nd in ray.nodes() if nd["Alive"]), default=1)
    cpus = r.cpus_per_worker or (max(1.0, min(res.get("CPU", 1) // n, biggest_node)) if not gpus else 1.0)
    return n, cpus, gpus, int(cpus)


def prepare_run_dir(cfg: JobConfig, layout: RunLayout, shards, phash: str) -> None:
    layout.root.mkdir(parents=True, exist_ok=True)
    if layout.run_json.exists():
        old = json.loads(layout.run_json.read_text())
        if old.get("plan_hash") != phash:
            raise StorageError(
                f"{layout.root} holds run '{layout.root.name}' with a different config or corpus "
                f"(plan {old.get('plan_hash')} vs {phash}); pick a new output.run_id or delete the folder"
            )
        return
    write_json_atomic(layout.run_json, {"run_id": layout.root.name, "plan_hash": phash, "config": cfg.to_dict(),
                                        "shards": [asdict(s) for s in shards], "created": time.time()})


def announce_activation_store(cfg: JobConfig, n_docs: int) -> None:
    """Print the store's size per token and an upper bound for the documents about to run."""
    from transformers import AutoConfig

    from actlake.config import resolve_model_path
    from actlake.storage.activations import bytes_per_token, resolve_layers

    hf = AutoConfig.from_pretrained(resolve_model_path(cfg.model.name_or_path), revision=cfg.model.revision,
                                    trust_remote_code=cfg.model.trust_remote_code)
    a, t = cfg.activations, cfg.tokenization
    layers = resolve_layers(a.layers, hf.num_hidden_layers)
    per_token = bytes_per_token(len(layers), hf.hidden_size, a.dtype)
    windows = 1 if t.overflow == "truncate" else t.max_windows_per_doc
    bound = n_docs * windows * t.max_length * a.fraction * per_token
    print(f"activation store: hidden states {layers}, d = {hf.hidden_size}, {a.dtype}: {per_token:,} bytes per token "
          f"before compression; at most {bound / 2**30:,.2f} GiB for {n_docs:,} documents "
          f"(fraction {a.fraction:g} of windows)", flush=True)


def run_job(cfg: JobConfig, address: str | None = None, report: bool | None = None, on_shard=None) -> RunResult:
    """Run a job to completion (resuming a run directory), reduce, and build the report.

    ``on_shard(summary)`` is called in the driver after each shard commits (summary includes the
    worker's resident memory after the shard, ``worker_rss_mb``)."""
    from actlake.jobs.reduce import reduce_run

    t0 = time.perf_counter()
    layout = RunLayout(cfg.run_dir)
    shards = make_plan(cfg)
    if not shards:
        raise ActlakeError("the corpus has no documents: nothing to do")
    phash = plan_hash(cfg, shards)
    prepare_run_dir(cfg, layout, shards, phash)
    shutil.rmtree(layout.staging, ignore_errors=True)  # leftovers of attempts that died mid-write
    pending = [s for s in shards if read_record(layout, s.shard_id, phash) is None]
    if cfg.activations.layers and pending:
        announce_activation_store(cfg, sum(s.end - s.start for s in pending))
    log.info("run %s: %d shards, %d to run, %d already complete", layout.root, len(shards), len(pending), len(shards) - len(pending))
    ran: list[dict] = []
    if pending:
        ran = _dispatch(cfg, layout, phash, pending, len(shards), address or cfg.resources.address, on_shard)
    totals = reduce_run(layout, [s.shard_id for s in shards], phash)
    wall = time.perf_counter() - t0
    tokens_run = sum(r["tokens"] for r in ran)
    totals.update(wall_seconds=wall, shards_run=len(pending), tokens_run=tokens_run,
                  tokens_per_second=tokens_run / wall if ran else None)
    write_json_atomic(layout.summary_json, totals)
    report_path = None
    if cfg.output.report if report is None else report:
        from actlake.report import build_report

        report_path = str(build_report(layout.root))
    return RunResult(str(layout.root), len(shards), len(pending), totals, wall, report_path)


def _dispatch(cfg, layout, phash, pending, total, address, on_shard=None) -> list[dict]:
    """Run ``pending`` shards on fresh actors; return their summaries. Raises if any shard failed."""
    import ray

    from actlake.jobs.worker import ShardWorker

    started = init_ray(address)
    try:
        n, cpus, gpus, threads = _worker_shape(cfg)
        n = min(n, len(pending))
        retries = cfg.resources.max_retries
        workers = [
            ShardWorker.options(num_cpus=cpus, num_gpus=gpus, max_restarts=retries, max_task_retries=0)
            .remote(cfg.to_dict(), str(layout.root), phash, threads)
            for _ in range(n)
        ]
        log.info("dispatching %d shards to %d worker(s) (%g CPU, %g GPU each)", len(pending), n, cpus, gpus)
        progress = Progress(total, skipped=total - len(pending))
        def done(summary):
            progress.update(summary)
            if on_shard:
                on_shard(summary)

        summaries, failures = Dispatcher(workers, retries, done).run(pending)
        for w in workers:
            ray.kill(w)
        if failures:
            raise ActlakeError(f"{len(failures)} shard(s) failed; rerun the same run id to retry them:\n  " + "\n  ".join(failures))
        return summaries
    finally:
        if started:
            ray.shutdown()

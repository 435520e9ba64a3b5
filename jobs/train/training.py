"""Training on Ray Train: one TorchTrainer per trial, trials in parallel as the cluster allows.

A trial is a training loop (a :class:`~actlake.jobs.train.loop.TrainLoop` run by a module-level function
taking one config mapping) run by ``ray.train.torch.TorchTrainer``; several trials (a sweep, one predictor
per layer) run as parallel Ray tasks, each starting its own trainer. Checkpoints and the tables trials
leave are the storage layer's (:mod:`actlake.storage.checkpoints`, :mod:`actlake.storage.publish`); why
Ray's own checkpoint and trial APIs are not used: docs/architecture.md.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from actlake.errors import ConfigError, StorageError, TrainingError

log = logging.getLogger("actlake.training")

def warmup_cosine_lr(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate of optimizer step ``step`` (0-based), the schedule of every training job: linear warm-up
    lr·(step+1)/warmup_steps, then cosine from lr to min_lr_ratio·lr at ``total_steps``, held there afterwards."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    frac = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    floor = min_lr_ratio * lr
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


# --------------------------------------------------------------------------- trials


@dataclass
class Trial:
    name: str
    """Trial name: the folder under checkpoints/ and the value of the ``trial`` column."""
    loop: Callable[[dict], None]
    """Module-level training loop run on every Ray Train worker."""
    config: dict = field(default_factory=dict)
    """Passed to ``loop`` (plain data: it travels to the workers)."""

@dataclass
class Resources:
    num_workers: int = 1
    """Ray Train workers per trial (data parallel)."""
    cpus_per_worker: float = 1
    """CPUs reserved per worker; torch uses as many threads."""
    use_gpu: bool = False
    """One GPU per worker."""

HEALTH_CHECK, HEALTH_CHECK_SECONDS = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"
"""How often Ray Train's controller polls its workers, unless set: it learns that the loop returned at the next
poll, and Ray's default (2 s) cost every trial 4-5 s after its loop had finished (a trial whose loop returns at
once: 12.0-12.4 s from submission to result with the default, 7.7-7.8 s polling every 0.2 s; 2026-11-26; 0.5 s, the
value set, was not timed on its own)."""


def _fit(trial: Trial, run_dir: str, resources: Resources) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")  # workers keep the job's working directory (relative paths)
    os.environ.setdefault(HEALTH_CHECK, HEALTH_CHECK_SECONDS)  # read by the controller fit() starts
    cfg = dict(trial.config, trial=trial.name, run_dir=run_dir, cpus_per_worker=resources.cpus_per_worker)
    trainer_name = f"{trial.name}-{uuid.uuid4().hex[:6]}"
    trainer = TorchTrainer(
        trial.loop,
        train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(
            num_workers=resources.num_workers, use_gpu=resources.use_gpu,
            resources_per_worker={"CPU": resources.cpus_per_worker}),
        run_config=ray.train.RunConfig(name=trainer_name,
                                       storage_path=str(Path(run_dir) / "_ray_train"),
                                       failure_config=ray.train.FailureConfig(max_failures=2),
                                       # Ray Train's own INFO lines (resources, worker group, every report) stay
                                       # in its log files; the console gets the loop's progress and warnings
                                       logging_config=ray.train.LoggingConfig(log_level="WARNING")),
    )
    try:
        result = trainer.fit()
    finally:  # Ray Train's own experiment state: our checkpoints live under checkpoints/
        shutil.rmtree(Path(run_dir) / "_ray_train" / trainer_name, ignore_errors=True)
    if result.error:
        raise result.error
    return dict(result.metrics or {})


def run_trials(trials: list[Trial], run_dir: Path, resources: Resources) -> dict[str, dict]:
    """Run every trial (in parallel as far as the cluster's CPUs/GPUs allow); last metrics per trial."""
    import ray

    names = [t.name for t in trials]
    if len(set(names)) != len(names):
        raise TrainingError(f"trial names must be unique, got {names}")
    run_dir = str(Path(run_dir).resolve())
    shutil.rmtree(Path(run_dir) / "_ray_train", ignore_errors=True)  # left by drivers that died
    # Ray Train's helpers query the state API of "the" cluster; name ours (other Ray instances may run here)
    gcs = ray.get_runtime_context().gcs_address
    remote_fit = ray.remote(num_cpus=0)(_fit).options(runtime_env={"env_vars": {"RAY_ADDRESS": gcs}})
    check_fits(resources, [nd["Resources"] for nd in ray.nodes() if nd["Alive"]])
    queue = list(trials)
    slots = concurrent_trials(resources)
    log.info("%d trial(s), up to %d at once (%d worker(s) x %g CPU%s each)", len(trials), slots, resources.num_workers,
             resources.cpus_per_worker, " + 1 GPU" if resources.use_gpu else "")
    pending: dict = {}
    results: dict[str, dict] = {}
    t0 = time.time()
    while pending or queue:
        while queue and len(pending) < slots:
            t = queue.pop(0)
            pending[remote_fit.remote(t, run_dir, resources)] = t.name
        done, _ = ray.wait(list(pending), num_returns=1)
        name = pending.pop(done[0])
        try:
            results[name] = ray.get(done[0])
        except Exception as e:  # a failed trial: stop the others, name it
            for ref in pending:
                ray.cancel(ref, force=True)
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise TrainingError(f"trial {name!r} failed: {first}") from None
        log.info("trial %s finished (%d of %d) after %.0fs", name, len(results), len(trials), time.time() - t0)
    return results


def check_fits(resources: Resources, nodes: list[dict]) -> None:
    """ConfigError naming the key when one trial's worker group cannot be placed on the cluster (``nodes``:
    each alive node's Ray resources): Ray Train would wait for resources that never come."""

    most_cpus = max((nd.get("CPU", 0) for nd in nodes), default=0)
    if resources.cpus_per_worker > most_cpus:
        raise ConfigError(f"resources.cpus_per_worker: {resources.cpus_per_worker:g} CPUs per worker, but no node of "
                          f"the cluster offers Ray more than {most_cpus:g}")
    fits = sum(int(nd.get("CPU", 0) // resources.cpus_per_worker) for nd in nodes)
    if resources.num_workers > fits:
        raise ConfigError(f"resources.num_workers: {resources.num_workers} workers of {resources.cpus_per_worker:g} CPUs, "
                          f"but the cluster holds at most {fits}")
    gpus = sum(int(nd.get("GPU", 0)) for nd in nodes)
    if resources.use_gpu and resources.num_workers > gpus:
        raise ConfigError(f"resources.use_gpu: {resources.num_workers} workers need a GPU each, but the cluster has {gpus}")


def concurrent_trials(resources: Resources) -> int:
    """Trials whose worker groups fit in the cluster at once (at least 1), so none waits for resources
    until Ray Train's start-up timeout."""
    import ray

    total = ray.cluster_resources()
    fit = int(total.get("CPU", 1) // max(resources.cpus_per_worker * resources.num_workers, 1e-9))
    if resources.use_gpu:
        fit = min(fit, int(total.get("GPU", 0) // resources.num_workers))
    return max(1, fit)


def worker_setup(config: dict):
    """In a training loop: threads, the worker's rank and device. Returns (rank, world_size, device)."""
    import ray.train
    import torch
    from transformers.utils import logging as hf_logging

    from actlake.jobs.common.ray_env import quiet_ray_info_on_console

    torch.set_num_threads(max(1, int(config.get("cpus_per_worker", 1))))
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar at every checkpoint
    quiet_ray_info_on_console()
    ctx = ray.train.get_context()
    device = ray.train.torch.get_device() if torch.cuda.is_available() else torch.device("cpu")
    return ctx.get_world_rank(), ctx.get_world_size(), device


# --------------------------------------------------------------------------- run directories


def check_settings(layout, kind: str, key: str, settings: dict, what: str, world_size: int | None) -> None:
    """Refuse to resume a run directory whose recorded ``key`` settings (or world size) differ.

    ``world_size`` (Ray Train workers) changes the effective batch, so it is compared too. The error names the
    keys that differ; a run folder of another format is refused by name."""
    from actlake.storage.manifest import read_run

    if not layout.run_json.exists():
        return
    old = read_run(layout)
    diff = _differing_keys(old.get(key) or {}, settings)
    if world_size is not None and old.get("world_size") != world_size:
        diff.append(f"resources.num_workers ({old['world_size']} -> {world_size})")
    if diff:
        raise StorageError(f"{layout.root} holds a {kind} run with a different {what} ({', '.join(diff)}); "
                           "pick a new output.run_id or delete the folder")


def _differing_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differing_keys(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out



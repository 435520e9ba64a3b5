"""Training on Ray Train: one TorchTrainer per trial, trials in parallel, checkpoints we own.

A trial is a training loop (a module-level function taking one config mapping) run by
``ray.train.torch.TorchTrainer``; several trials (a sweep, one predictor per layer) run as
parallel Ray tasks, each starting its own trainer. Checkpoints are folders under the run
directory, ``checkpoints/<trial>/step-NNNNNNNN/``, written under a temporary name with a manifest
(size and sha256 of every file) and renamed into place; the newest two are kept. Before a trial
starts the driver removes leftover temporary folders and checks the checkpoints against their
manifests, newest first, so a restarted trial resumes from the newest whole one (a damaged one
is named and set aside). Settings and world size are compared with ``run.json`` on resume. On a
cluster the run directory must be on storage every node sees (as for extraction).

Ray's own checkpoint and trial APIs (Ray 2.60, Train V2, the default) were tried and are not used,
as they would break tested guarantees. ``ray.train.report(checkpoint=...)`` copies a checkpoint into
its final folder file by file (a killed copy leaves a partial ``step-N``), or with ``NO_UPLOAD``
registers it after our rename, so ``ray.train.get_checkpoint()`` can be one checkpoint behind (or
empty) after a worker is killed in between. Across driver runs V2 resumes only from its
``checkpoint_manager_snapshot.json`` (``resume_from_checkpoint`` raises): it hands out the newest
registered checkpoint unchecked, refuses to start (``CheckpointManagerInitializationError``) once a
damaged one is set aside, and cannot read a snapshot whose format another Ray version changed. ``CheckpointConfig(num_to_keep)``
keeps the newest N of the current fit only, not log-spaced steps nor an earlier fit's. ``ray.tune.Tuner``
starts trial actors without our ``RAY_ADDRESS`` (Train V2's placement-group cleaner then fails with
"multiple active Ray instances" when several run on a machine) and rejects a zero-CPU trial.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from actlake.errors import ActlakeError, StorageError

log = logging.getLogger("actlake.training")

STATE_FILE = "trainer_state.pt"


# --------------------------------------------------------------------------- checkpoints


def checkpoint_path(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Whole checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("step-") and (p / STATE_FILE).is_file():
            out.append((int(p.name[5:]), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    cks = list_checkpoints(root)
    return cks[-1] if cks else None


MANIFEST = "manifest.json"
"""In every checkpoint folder: size and sha256 of each of its files, written last, before the rename."""
IDENTITY = "identity.json"
"""In every checkpoint folder (and in its manifest): the run and trial it belongs to, :func:`checkpoint_identity`."""


def checkpoint_identity(config_hash: str, trial: str) -> dict:
    """What a checkpoint must carry to be resumed or analysed by this run: the hash of every setting that
    changes training (seed and inputs included, ``TrainJob.config_hash``) and the trial's name."""
    return {"config": config_hash, "trial": trial}


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _digest(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], identity: dict | None = None) -> Path:
    """Call ``write(tmp_folder)``, add the run's ``identity`` and the manifest, then rename the folder to
    ``step-NNNNNNNN`` (replacing one).

    A failed write (disk full, ...) raises :class:`TrainingError` naming the checkpoint; the older
    checkpoints are untouched, and the temporary folder is removed."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step:08d}-{uuid.uuid4().hex[:8]}"
    final = checkpoint_path(root, step)
    try:
        tmp.mkdir()
        write(tmp)
        if identity is not None:
            (tmp / IDENTITY).write_text(json.dumps(identity, sort_keys=True))
        _write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as e:
        free = shutil.disk_usage(root).free / 2**20
        raise TrainingError(f"could not write checkpoint {final}: {_first_line(e)} ({free:,.0f} MiB free on its "
                            "disk); the previous checkpoint is kept") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be used (naming the file), or None if it is whole.

    With a manifest every file's size and sha256 are checked; an older checkpoint without one must
    at least unpickle its trainer state."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        try:
            import torch

            torch.load(path / STATE_FILE, weights_only=False, map_location="cpu")
        except Exception as e:
            return f"{path / STATE_FILE}: unreadable ({_first_line(e)})"
        return None
    try:
        files = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"{manifest}: unreadable ({_first_line(e)})"
    for name, meta in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{f}: {f.stat().st_size} bytes, its manifest says {meta['bytes']}"
        if _digest(f) != meta["sha256"]:
            return f"{f}: contents differ from its manifest (sha256)"
    return None


def foreign(path: Path, identity: dict | None) -> str | None:
    """Why the checkpoint ``path`` belongs to another run or trial than ``identity`` (None: it is this one's,
    or it predates identities, or no identity is asked for)."""
    f = Path(path) / IDENTITY
    if identity is None or not f.is_file():
        return None
    try:
        theirs = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        return f"{f}: unreadable ({_first_line(e)})"
    if theirs != identity:
        differ = ", ".join(f"{k} {theirs.get(k)!r} (this run: {identity.get(k)!r})"
                           for k in sorted(set(theirs) | set(identity)) if theirs.get(k) != identity.get(k))
        return f"{path}: a checkpoint of another run or trial: {differ}"
    return None


def verified_checkpoints(root: Path, steps: list[int], identity: dict | None) -> list[tuple[int, Path]]:
    """The checkpoints of ``steps`` under ``root``, each whole (its manifest) and this run's (its identity);
    a TrainingError naming the first that is missing, damaged or foreign. For readers of a finished run."""
    have = dict(list_checkpoints(root))
    out = []
    for step in steps:
        if step not in have:
            raise TrainingError(f"{checkpoint_path(root, step)}: missing (a checkpoint the analysis reads); train the "
                                "run again without --analysis-only, or delete the trial's checkpoints")
        problem = foreign(have[step], identity) or checkpoint_problem(have[step])
        if problem:
            raise TrainingError(f"{problem}; delete it and train the run again without --analysis-only")
        out.append((step, have[step]))
    return out


def prepare_checkpoints(root: Path, identity: dict | None = None) -> int | None:
    """Before a trial starts: remove leftover ``.tmp-*`` folders, refuse checkpoints of another run
    (``identity``, naming the first), then check checkpoints newest first.

    Damaged ones newer than a whole one are renamed ``damaged-step-NNNNNNNN`` and the whole one is
    used (warnings name each file and cause). Returns the step the trial resumes from (None: from
    scratch); raises :class:`TrainingError`, moving nothing, when checkpoints exist but none is usable."""
    root = Path(root)
    if not root.is_dir():
        return None
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for _, path in list_checkpoints(root):
        why = foreign(path, identity)
        if why:
            raise TrainingError(f"{why}; move it away, or delete {root} to train this trial from the start")
    damaged = []
    for step, path in reversed(list_checkpoints(root)):
        problem = checkpoint_problem(path)
        if problem is not None:
            damaged.append((path, problem))
            continue
        for bad, why in damaged:
            aside = root / f"damaged-{bad.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(bad, aside)
            log.warning("damaged checkpoint %s, moved to %s", why, aside.name)
        if damaged:
            log.warning("%s: falling back to the checkpoint of step %d", root, step)
        return step
    if damaged:
        raise TrainingError(f"no usable checkpoint in {root}: {'; '.join(why for _, why in damaged)}; delete "
                            f"{root} to train this trial from the start")
    return None


def prune_checkpoints(root: Path, keep_steps: set[int], keep_last: int = 2) -> None:
    """Delete checkpoints whose step is not in ``keep_steps``, except the newest ``keep_last``
    (two: the previous one stays as a fallback should the newest be damaged)."""
    cks = list_checkpoints(root)
    for step, path in cks[: max(len(cks) - keep_last, 0)]:
        if step not in keep_steps:
            shutil.rmtree(path, ignore_errors=True)


def log_spaced_steps(total: int, n: int) -> list[int]:
    """About ``n`` steps from 0 to ``total``, evenly spaced in log(1 + step), always with 0 and total."""
    if total <= 0:
        return [0]
    pts = {0, total}
    for i in range(1, n):
        pts.add(int(round(math.expm1(math.log1p(total) * i / (n - 1)))))
    return sorted(p for p in pts if 0 <= p <= total)


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


class TrainingError(ActlakeError):
    """A training trial failed; the message names the trial and the first error line."""


def _fit(trial: Trial, run_dir: str, resources: Resources) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")  # workers keep the job's working directory (relative paths)
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
                                       failure_config=ray.train.FailureConfig(max_failures=2)),
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
    from actlake.errors import ConfigError

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

    torch.set_num_threads(max(1, int(config.get("cpus_per_worker", 1))))
    ctx = ray.train.get_context()
    device = ray.train.torch.get_device() if torch.cuda.is_available() else torch.device("cpu")
    return ctx.get_world_rank(), ctx.get_world_size(), device


# --------------------------------------------------------------------------- run directories


def check_settings(layout, kind: str, key: str, settings: dict, what: str, world_size: int | None) -> None:
    """Refuse to resume a run directory whose recorded ``key`` settings (or world size) differ.

    ``world_size`` (Ray Train workers) changes the effective batch, so it is compared too; a run
    recorded before it was stored is accepted. The error names the keys that differ."""
    if not layout.run_json.exists():
        return
    old = json.loads(layout.run_json.read_text())
    diff = _differing_keys(old.get(key) or {}, settings)
    if old.get("world_size") is not None and world_size is not None and old["world_size"] != world_size:
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


def trial_steps(run_dir: Path, trials: list[str]) -> dict[str, int | None]:
    """Newest checkpoint step of every trial (None: none yet)."""
    out = {}
    for name in trials:
        latest = latest_checkpoint(Path(run_dir) / "checkpoints" / name)
        out[name] = latest[0] if latest else None
    return out


def require_finished(run_dir: Path, trials: list[str], steps: int, how: str) -> None:
    """Raise :class:`TrainingError` unless every trial has a checkpoint of its last step (``how``: how to finish)."""
    behind = {n: s for n, s in trial_steps(run_dir, trials).items() if s != steps}
    if behind:
        shown = ", ".join(f"{n} at step {s if s is not None else 'none'}" for n, s in behind.items())
        raise TrainingError(f"{run_dir}: training is unfinished ({shown} of {steps}); {how}")


PENDING = "_pending"
"""Run-directory folder where trials leave their result tables until every trial has finished."""


def pending_file(run_dir: Path, table: str, partition: str) -> Path:
    """Where a trial writes its part of ``table`` (``partition``: e.g. ``layer=2``) until :func:`publish_pending`."""
    return Path(run_dir) / PENDING / table / partition / "part-0.parquet"


def discard_pending(run_dir: Path) -> None:
    """Drop tables left by trials of an attempt that did not finish (they are written again)."""
    shutil.rmtree(Path(run_dir) / PENDING, ignore_errors=True)


def publish_pending(run_dir: Path, drop: tuple[str, ...] = ()) -> int:
    """Publish every pending table file, and remove the tables in ``drop`` (turned off), in one replacement
    of the run's publication record (:mod:`actlake.storage.publish`), once all trials have finished."""
    from actlake.storage.layout import RunLayout
    from actlake.storage.publish import publish

    root = Path(run_dir) / PENDING
    files = {}
    for f in sorted(root.rglob("*.parquet")) if root.is_dir() else []:
        parts = f.relative_to(root).parts  # (table, [partition,] part-0.parquet)
        files[(parts[0], parts[1] if len(parts) == 3 else None)] = f
    publish(RunLayout(Path(run_dir)), files, drop)
    discard_pending(run_dir)
    return len(files)


def publish_table(run_dir: Path, table: str, partition: str | None, data) -> None:
    """Publish one Arrow table (``partition``: e.g. ``trial=lm``, or None) at once: written whole, then
    named by the publication record."""
    from actlake.storage.layout import RunLayout
    from actlake.storage.parquet_io import write_parquet
    from actlake.storage.publish import publish

    layout = RunLayout(Path(run_dir))
    Path(layout.staging).mkdir(parents=True, exist_ok=True)
    tmp = Path(layout.staging) / f"{uuid.uuid4().hex}.parquet"
    try:
        write_parquet(data, tmp)
        publish(layout, {(table, partition): tmp})
    finally:
        tmp.unlink(missing_ok=True)

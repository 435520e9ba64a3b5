"""``actlake train-synthetic``: train on a factored process (Ray Train), analyse the checkpoints, report."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from actlake.jobs.common.ray_env import init_ray
from actlake.jobs.train.synthetic.analyze import analyze_run
from actlake.jobs.train.synthetic.config import SyntheticConfig
from actlake.jobs.train.synthetic.loop import train_loop
from actlake.jobs.train.synthetic.report import build_synthetic_report
from actlake.jobs.train.training import Resources, Trial, check_settings, run_trials
from actlake.provenance import provenance
from actlake.storage.checkpoints import checkpoint_identity, prepare_checkpoints, require_finished
from actlake.storage.layout import RunLayout, write_json_atomic, write_run_json
from actlake.storage.lock import holds_run_dir

log = logging.getLogger("actlake.synthetic")


@dataclass
class SyntheticResult:
    run_dir: str
    trials: list[str]
    wall_seconds: float
    report: str | None


def _prepare(cfg: SyntheticConfig, layout: RunLayout) -> None:
    """Refuse a run directory trained with other settings or world size; record this config."""

    layout.root.mkdir(parents=True, exist_ok=True)
    training = {k: v for k, v in cfg.to_dict().items() if k not in ("output", "resources", "analysis", "name")}
    check_settings(layout, "synthetic", "training", training, "process, model or training config",
                   cfg.resources.num_workers)
    write_run_json(layout, {"run_id": layout.root.name, "kind": "synthetic", "training": training,
                                        "config": cfg.to_dict(), "world_size": cfg.resources.num_workers,
                                        "created": time.time()})


@holds_run_dir
def run_synthetic(cfg: SyntheticConfig, address: str | None = None, train: bool = True,
                  analyze: bool | None = None, report: bool | None = None) -> SyntheticResult:
    """Train every trial (resuming), then analyse the checkpoints and render the report."""
    t0 = time.perf_counter()
    layout = RunLayout(cfg.run_dir)
    _prepare(cfg, layout)
    shutil.rmtree(layout.staging, ignore_errors=True)
    trials = [dict(t, identity=checkpoint_identity(cfg.config_hash, t["name"])) for t in cfg.trials()]
    resumes = {t["name"]: prepare_checkpoints(layout.root / "checkpoints" / t["name"], t["identity"]) for t in trials}
    if not train:
        require_finished(layout.root, [t["name"] for t in trials], cfg.training.steps,
                         f"run `actlake train-synthetic {cfg.source_file}` without --analysis-only to finish it")
    to_train = [t for t in trials if train and resumes[t["name"]] != cfg.training.steps]
    if train and len(to_train) < len(trials):
        log.info("trained to step %d already: %s", cfg.training.steps,
                 ", ".join(t["name"] for t in trials if t not in to_train))
    analysing = cfg.analysis.enabled if analyze is None else analyze
    if to_train or analysing:
        _on_ray(cfg, layout, trials, to_train, analysing, address)
    return _finish(cfg, layout, trials, t0, report)


def _on_ray(cfg: SyntheticConfig, layout: RunLayout, trials: list[dict], to_train: list[dict], analysing: bool,
            address: str | None) -> None:
    """Train the trials ``to_train`` (Ray Train), then analyse every trial's checkpoints if ``analysing``."""
    r = cfg.resources
    started = init_ray(address or r.address, dashboard=bool(to_train))  # Ray Train's controller needs the dashboard
    try:
        if to_train:
            log.info("training %d trial(s): %s", len(to_train), ", ".join(t["name"] for t in to_train))
            run_trials([Trial(t["name"], train_loop, {"job": cfg.to_dict(), **t}) for t in to_train], layout.root,
                       Resources(r.num_workers, r.cpus_per_worker, r.use_gpu))
        if analysing:
            log.info("analysing the checkpoints of %d trial(s)", len(trials))
            analyze_run(cfg, layout.root, cpus=r.cpus_per_worker)
    finally:
        if started:
            import ray

            ray.shutdown()


def _finish(cfg: SyntheticConfig, layout: RunLayout, trials: list[dict], t0: float, report: bool | None) -> SyntheticResult:
    """The report (when asked for and the analysis tables exist) and the summary."""
    report_path = None
    if (cfg.output.report if report is None else report) and (layout.tables / "factored_dimension").exists():
        report_path = str(build_synthetic_report(layout.root))
    wall = time.perf_counter() - t0
    write_json_atomic(layout.summary_json, {"kind": "synthetic", "trials": [t["name"] for t in trials],
                                            "wall_seconds": wall, "provenance": provenance(None)})
    return SyntheticResult(str(layout.root), [t["name"] for t in trials], wall, report_path)


def summary_lines(run_dir: str | Path) -> list[str]:
    """Effective dimension and factor R² at the first and last checkpoint of each trial (from SQL)."""
    from actlake.storage.sql import query

    sql = """
        WITH d AS (SELECT trial, step, effective_dim, factored_reference, joint_reference, belief_dimension
                   FROM factored_dimension WHERE kind = 'checkpoint'),
             f AS (SELECT trial, step, min(r2) AS min_factor_r2 FROM factored_fit
                   WHERE kind = 'checkpoint' AND target LIKE 'factor%' GROUP BY trial, step)
        SELECT trial, step, effective_dim, factored_reference, joint_reference, belief_dimension, round(min_factor_r2, 3) AS min_factor_r2
        FROM d JOIN f USING (trial, step) ORDER BY trial, step"""
    rows = query(run_dir, sql).to_pylist()
    return [f"{r['trial']:>14} step {r['step']:>6}: effective dim {r['effective_dim']:>3} "
            f"(factored {r['factored_reference']}, joint {r['joint_reference']}, beliefs {r['belief_dimension']}); "
            f"lowest factor R2 {r['min_factor_r2']}" for r in rows]

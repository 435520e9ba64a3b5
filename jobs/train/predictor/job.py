"""``actlake train-predictor``: one predictor per layer of an activation store (Ray Train trials), probes, report."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from actlake.config import resolve_model_path
from actlake.errors import ConfigError, StorageError
from actlake.fs import read_regular
from actlake.jobs.common.ray_env import init_ray
from actlake.jobs.train.predictor.config import PredictorJobConfig
from actlake.jobs.train.predictor.loop import held_out, train_loop
from actlake.jobs.train.predictor.report import build_predictive_report
from actlake.jobs.train.training import Resources, Trial, check_settings, run_trials
from actlake.provenance import provenance
from actlake.storage.activations import check_store_values, verify_store
from actlake.storage.checkpoints import checkpoint_identity, prepare_checkpoints
from actlake.storage.layout import RunLayout, write_json_atomic, write_run_json
from actlake.storage.lock import holds_run_dir
from actlake.storage.publish import discard_pending, publish_pending

log = logging.getLogger("actlake.predictive")


def store_info(store: str | Path) -> dict:
    """Layers in the store and the analysed model's attention shape (from the store's run.json)."""
    from transformers import AutoConfig

    from actlake.storage.sql import query

    root = Path(store)
    layers = [r["layer"] for r in query(root, "SELECT DISTINCT layer FROM activations ORDER BY layer").to_pylist()]
    run = json.loads(read_regular(root / "run.json"))
    hf = AutoConfig.from_pretrained(resolve_model_path(run["config"]["model"]["name_or_path"]))
    heads = hf.num_attention_heads
    return {"layers": layers, "model_heads": (heads, hf.hidden_size // heads), "model": run["config"]["model"]["name_or_path"]}


@holds_run_dir
def run_predictor_job(cfg: PredictorJobConfig, address: str | None = None, report: bool | None = None) -> dict:
    """Train one predictor per layer (resuming), fit the probes, write the report.

    Before Ray starts: the store must be complete (completion records, file sizes), unchanged since
    this run began (its fingerprint), whole and finite; the settings must match the run directory,
    and the checkpoints must be usable."""

    t0 = time.perf_counter()
    layout = RunLayout(cfg.run_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in cfg.to_dict().items() if k in ("store", "layers", "predictor")}
    check_settings(layout, "predictor", "settings", settings, "store or predictor settings", cfg.resources.num_workers)
    store = _checked_store(cfg, layout)
    info = store_info(cfg.store)
    layers = cfg.layers or info["layers"]
    missing = sorted(set(layers) - set(info["layers"]))
    if missing:
        raise ConfigError(f"{cfg.source_file}: 'layers': {missing} not in the store {cfg.store} "
                          f"(it holds hidden states {info['layers']})")
    write_run_json(layout, {"run_id": layout.root.name, "kind": "predictor", "settings": settings,
                                        "store": cfg.store, "store_fingerprint": store["fingerprint"],
                                        "world_size": cfg.resources.num_workers, "model": info["model"]})
    shutil.rmtree(layout.staging, ignore_errors=True)
    discard_pending(layout.root)
    identity = {layer: checkpoint_identity(cfg.config_hash, f"layer{layer}") for layer in layers}
    for layer in layers:
        prepare_checkpoints(layout.root / "checkpoints" / f"layer{layer}", identity[layer])
    r = cfg.resources
    started = init_ray(address or r.address, dashboard=True)
    try:
        trials = [Trial(f"layer{layer}", train_loop, {"job": cfg.to_dict(), "layer": layer,
                                                      "model_heads": list(info["model_heads"]),
                                                      "identity": identity[layer]})
                  for layer in layers]
        log.info("training %d predictor(s): layers %s", len(trials), layers)
        run_trials(trials, layout.root, Resources(r.num_workers, r.cpus_per_worker, r.use_gpu))
    finally:
        if started:
            import ray

            ray.shutdown()
    # every layer's tables at once (none if a layer failed); probes turned off leave no old probe_scores
    publish_pending(layout.root, drop=() if cfg.probes.enabled else ("probe_scores",))
    report_path = None
    if cfg.output.report if report is None else report:
        report_path = str(build_predictive_report(layout.root))
    summary = {"kind": "predictor", "layers": layers, "wall_seconds": time.perf_counter() - t0, "report": report_path,
               "provenance": provenance({"store": {"hash": json.loads(layout.run_json.read_text())["store_fingerprint"]}})}
    write_json_atomic(layout.summary_json, summary)
    return dict(summary, run_dir=str(layout.root))


def _checked_store(cfg: PredictorJobConfig, layout: RunLayout) -> dict:
    """The store's fingerprint after checking it: complete, the one this run started on, whole and finite.

    The full read (page checksums, non-finite values) is skipped when the run directory records
    this fingerprint: it passed when it was recorded."""

    store = verify_store(cfg.store)
    old = json.loads(layout.run_json.read_text()).get("store_fingerprint") if layout.run_json.exists() else None
    if old is not None and old != store["fingerprint"]:
        raise StorageError(f"the activation store {cfg.store} changed since the predictor run {layout.root} started on "
                           f"it (fingerprint {old} -> {store['fingerprint']}: other shards, rows or file sizes); pick "
                           "a new output.run_id or delete the folder")
    if old is None:
        rows, windows = check_store_values(store["files"], cfg.layers or None)
        log.info("activation store %s: %d shard file(s), %d rows checked", cfg.store, len(store["files"]), rows)
        _check_split(cfg, windows)
    return store


def _check_split(cfg: PredictorJobConfig, windows: set) -> None:
    """Both the training and the evaluation split of the store's windows must be non-empty."""

    pairs = sorted(windows)
    ev = held_out([d for d, _ in pairs], [w for _, w in pairs], cfg.predictor.eval_fraction)
    if ev.all() or not ev.any():
        raise ConfigError(f"{cfg.source_file}: 'predictor.eval_fraction': {int(ev.sum())} of the store's {len(ev)} "
                          f"windows would be held out for evaluation, {len(ev) - int(ev.sum())} trained on; both "
                          "must be non-empty (change eval_fraction or store more windows)")


SUMMARY_SQL = """
    SELECT s.layer, round(s.r2, 3) AS r2, round(s.mse, 4) AS mse, round(s.spearman, 3) AS spearman_r_surprisal,
           s.n_eval_windows AS eval_windows
    FROM predictor_summary s ORDER BY s.layer"""
PROBE_SQL = """
    SELECT task, layer, """ + ", ".join(
    f"max(CASE WHEN representation = '{r}' THEN round(macro_f1, 3) END) AS \"{r}\"" for r in ("h", "h_hat", "r", "h_hat+r")
) + """ FROM probe_scores GROUP BY task, layer ORDER BY task, layer"""

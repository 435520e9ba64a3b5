"""``actlake train-predictor`` workers: one external predictor per layer (METHODS.md §6), then probes.

Each layer is a Ray Train trial. Its loop reads that layer of the activation store through DuckDB,
holds out windows by a hash of (doc_id, window_index), trains :class:`PredictorTrainer` with
checkpoints every ``checkpoint_every`` steps (resume continues the same batches, learning-rate
schedule and optimizer state), evaluates every ``eval_every`` steps, and at the end writes that
layer's tables: curve, per-position MSE and Spearman, per-token ‖r‖ next to surprisal, probe scores
(probes train, validate and test on the held-out windows only).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from actlake.hashing import unit_hash

log = logging.getLogger("actlake.predictive")

REPRESENTATIONS = ("h", "h_hat", "r", "h_hat+r")


def held_out(doc_ids, windows, fraction: float) -> np.ndarray:
    """(N,) bool: evaluation windows, a deterministic function of (doc_id, window_index)."""
    return np.array([unit_hash(f"predictor-eval:{int(d)}:{int(w)}") < fraction for d, w in zip(doc_ids, windows)],
                    dtype=bool)


def predictor_config(job, d: int, model_heads: tuple[int, int]):
    from actlake.jobs.predictor.model import PredictorConfig, default_heads

    p = job.predictor
    n_heads, head_dim = (p.n_heads, p.head_dim) if p.n_heads else default_heads(*model_heads)
    return PredictorConfig(d_model=d, n_heads=n_heads, head_dim=head_dim, lr=p.lr, weight_decay=p.weight_decay,
                           warmup_steps=min(p.warmup_steps, p.steps), total_steps=p.steps).validate()


def train_loop(config: dict) -> None:
    """Ray Train loop of one layer; ``config``: job (PredictorJobConfig dict), layer, model_heads, trial, run_dir."""
    import ray.train
    import torch

    from actlake.jobs.predictor.model import PredictorTrainer, fit_standardisation
    from actlake.config import parse_config
    from actlake.jobs.training import STATE_FILE, latest_checkpoint, prune_checkpoints, save_checkpoint, worker_setup
    from actlake.jobs.predictor.config import PredictorJobConfig
    from actlake.storage.activations import read_windows
    from actlake.storage.sql import open_run

    job = parse_config(config["job"], where="train-predictor config", root=PredictorJobConfig)
    p, layer, run_dir = job.predictor, config["layer"], Path(config["run_dir"])
    rank, _, device = worker_setup(config)
    con = open_run(job.store)
    try:
        h, valid, meta = read_windows(con, layer)  # (N, T, d), (N, T)
    finally:
        con.close()
    ev = held_out(meta["doc_id"], meta["window_index"], p.eval_fraction)
    if ev.all() or not ev.any():
        raise ValueError(f"layer {layer}: {int(ev.sum())} of {len(ev)} windows held out; adjust eval_fraction")
    tr_h, tr_v = torch.from_numpy(h[~ev]), torch.from_numpy(valid[~ev])
    ev_h, ev_v = torch.from_numpy(h[ev]), torch.from_numpy(valid[ev])
    mean, std = fit_standardisation([(h[~ev], valid[~ev])])
    cfg = predictor_config(job, h.shape[2], tuple(config["model_heads"]))
    trainer = PredictorTrainer(cfg, mean, std, seed=p.seed, device=device)
    ck_root = run_dir / "checkpoints" / config["trial"]
    latest, curve, resumes = latest_checkpoint(ck_root), [], []
    if latest is not None:
        state = torch.load(latest[1] / STATE_FILE, weights_only=False)
        trainer.load_state_dict(state["trainer"])
        curve, resumes = state["curve"], state["resumes"]
        if trainer.step < p.steps:  # a rerun of a finished layer only rewrites its tables
            resumes = resumes + [trainer.step]
            log.info("layer %d: resuming from step %d", layer, trainer.step)

    def checkpoint() -> None:
        save_checkpoint(ck_root, trainer.step, lambda f: torch.save({"trainer": trainer.state_dict(), "curve": curve, "resumes": resumes},
                                                                    f / STATE_FILE), config.get("identity"))
        prune_checkpoints(ck_root, keep_steps=set())

    last_eval = None
    while trainer.step < p.steps:
        idx = trainer.sample_indices(len(tr_h), p.batch_size)
        loss = trainer.train_step(tr_h[idx], tr_v[idx])
        step = trainer.step
        if step % p.eval_every == 0 or step == p.steps:
            res = last_eval = trainer.evaluate(ev_h, ev_v)
            curve.append({"step": step, "train_mse": loss, "mse": res.mse, "r2": res.r2})
            ray.train.report(dict(curve[-1], layer=layer))
            if rank == 0:
                log.info("layer %d step %d/%d: eval MSE %.4g, R2 %.3f", layer, step, p.steps, res.mse, res.r2)
        if rank == 0 and (step % p.checkpoint_every == 0 or step == p.steps):
            checkpoint()
    if rank == 0:
        if last_eval is None:  # resumed after the final step; the loop evaluates at the final step otherwise
            last_eval = trainer.evaluate(ev_h, ev_v)
        finish_layer(job, layer, trainer, curve, (h, valid, meta), ev, run_dir, resumes, last_eval)


def finish_layer(job, layer: int, trainer, curve: list[dict], data, ev: np.ndarray, run_dir: Path,
                 resumes: list[int], res) -> None:
    """Final evaluation tables (from ``res``, the evaluation at the last step) and probes of one layer."""
    import pyarrow as pa

    from actlake.jobs.predictor.metrics import spearman, spearman_by_position
    from actlake.jobs.training import pending_file
    from actlake.storage.layout import RunLayout
    from actlake.storage.parquet_io import write_parquet_atomic

    h, valid, meta = data
    norms = res.residual_norm  # (Ne, T-1): ‖r‖ of the state at positions 1..T-1
    surprisal = meta["surprisal"][ev][:, 1:]  # (Ne, T-1): s of the token at the same position
    ok = np.isfinite(norms) & np.isfinite(surprisal)
    by_pos = spearman_by_position(norms, surprisal, ok)
    overall = spearman(norms[ok], surprisal[ok]) if ok.sum() > 2 else float("nan")
    n_pos = ok.sum(0)
    tables = {
        "predictor_curve": pa.Table.from_pylist(curve),
        "predictor_position": pa.table({
            "position": pa.array(np.arange(1, norms.shape[1] + 1), pa.int32()),
            "mse": pa.array(res.mse_by_position, pa.float64()), "spearman": pa.array(by_pos, pa.float64()),
            "n_tokens": pa.array(n_pos, pa.int64())}),
        "predictor_summary": pa.Table.from_pylist([{
            "mse": res.mse, "r2": res.r2, "target_variance": res.var, "spearman": overall, "n_eval_tokens": int(ok.sum()),
            "n_train_windows": int((~ev).sum()), "n_eval_windows": int(ev.sum()), "steps": trainer.step,
            "n_heads": trainer.cfg.n_heads, "head_dim": trainer.cfg.head_dim, "resumed_from": resumes}],
            schema=pa.schema([("mse", pa.float64()), ("r2", pa.float64()), ("target_variance", pa.float64()),
                              ("spearman", pa.float64()), ("n_eval_tokens", pa.int64()), ("n_train_windows", pa.int64()),
                              ("n_eval_windows", pa.int64()), ("steps", pa.int64()), ("n_heads", pa.int32()),
                              ("head_dim", pa.int32()), ("resumed_from", pa.list_(pa.int64()))])),
        "predictor_tokens": _token_table(meta, ev, norms, surprisal),
    }
    if job.probes.enabled:
        tables["probe_scores"] = pa.Table.from_pylist(probe_rows(job, trainer, h, valid, meta, ev))
    layout = RunLayout(run_dir)
    for name, table in tables.items():  # published by the driver once every layer has finished
        write_parquet_atomic(table, pending_file(run_dir, name, f"layer={layer}"), layout.staging)


def _token_table(meta, ev, norms, surprisal):
    import pyarrow as pa

    rows, cols = np.nonzero(np.isfinite(norms))
    return pa.table({
        "doc_id": pa.array(meta["doc_id"][ev][rows], pa.int64()),
        "window_index": pa.array(meta["window_index"][ev][rows], pa.int32()),
        "position": pa.array(cols + 1, pa.int32()),
        "residual_norm": pa.array(norms[rows, cols], pa.float64()),
        "surprisal": pa.array(surprisal[rows, cols], pa.float64()),
    })


def last_position_features(trainer, h, valid) -> dict[str, np.ndarray]:
    """h, ĥ, r and [ĥ, r] at the last real position of every window: name -> (N, F)."""
    import torch

    pred = trainer.predict(torch.from_numpy(h), torch.from_numpy(valid))  # (N, T-1, d): ĥ of positions 1..T-1
    last = valid.sum(1) - 1  # (N,) index of the last real token (>= 1 for windows of 2+ tokens)
    rows = np.arange(len(h))
    h_last = h[rows, last]
    h_hat = pred[rows, last - 1]
    r = h_last - h_hat
    return {"h": h_last, "h_hat": h_hat, "r": r, "h_hat+r": np.concatenate([h_hat, r], axis=1)}


def probe_rows(job, trainer, h, valid, meta, held: np.ndarray) -> list[dict]:
    """Probe scores of every task and representation, on the windows the predictor never trained on
    (``held``, its evaluation windows) with at least two tokens: ĥ and r of a training window would carry
    what the predictor memorised there."""
    from actlake.jobs.predictor.probes import fit_probe, split_per_class, split_total

    q = job.probes
    keep = np.asarray(held, dtype=bool) & (valid.sum(1) >= 2)
    feats = last_position_features(trainer, h[keep], valid[keep])
    last = valid[keep].sum(1) - 1
    labels = {"source": np.array(meta["source"], dtype=object)[keep],
              "type8": meta["type8"][keep][np.arange(keep.sum()), last]}
    out = []
    for task in q.tasks:
        y = labels[task].astype(str)
        if len(np.unique(y)) < 2:
            log.warning("probe %s: fewer than 2 classes in the store; skipped", task)
            continue
        split = (split_per_class(y, tuple(q.source_caps), q.seed) if task == "source"
                 else split_total(y, tuple(q.type8_totals), q.seed))
        for rep in REPRESENTATIONS:
            r = fit_probe(feats[rep], y, split, Cs=tuple(q.Cs), seed=q.seed)
            out.append({"task": task, "representation": rep, "macro_f1": r.macro_f1, "val_macro_f1": r.val_macro_f1,
                        "n_train": r.n_train, "n_test": r.n_test, "n_classes": len(r.classes), "C": r.C})
    return out

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

from actlake.config import parse_config
from actlake.hashing import unit_hash
from actlake.jobs.train.loop import TrainLoop
from actlake.jobs.train.predictor.config import PredictorJobConfig
from actlake.jobs.train.predictor.metrics import spearman, spearman_by_position
from actlake.storage.activations import read_windows
from actlake.storage.checkpoints import STATE_FILE
from actlake.storage.layout import RunLayout
from actlake.storage.publish import pending_file

log = logging.getLogger("actlake.predictive")

REPRESENTATIONS = ("h", "h_hat", "r", "h_hat+r")


def held_out(doc_ids, windows, fraction: float) -> np.ndarray:
    """(N,) bool: evaluation windows, a deterministic function of (doc_id, window_index)."""
    return np.array([unit_hash(f"predictor-eval:{int(d)}:{int(w)}") < fraction for d, w in zip(doc_ids, windows)],
                    dtype=bool)


def predictor_config(job, d: int, model_heads: tuple[int, int]):
    from actlake.jobs.train.predictor.model import PredictorConfig, default_heads

    p = job.predictor
    n_heads, head_dim = (p.n_heads, p.head_dim) if p.n_heads else default_heads(*model_heads)
    return PredictorConfig(d_model=d, n_heads=n_heads, head_dim=head_dim, lr=p.lr, weight_decay=p.weight_decay,
                           warmup_steps=min(p.warmup_steps, p.steps), total_steps=p.steps).validate()


class PredictorLoop(TrainLoop):
    """One layer's trial: ``config`` has job (PredictorJobConfig as dict), layer and model_heads."""

    def __init__(self, config: dict):
        import torch

        from actlake.jobs.train.predictor.model import fit_standardisation
        from actlake.storage.sql import open_run

        super().__init__(config)
        self.job = parse_config(config["job"], where="train-predictor config", root=PredictorJobConfig)
        p, self.layer = self.job.predictor, config["layer"]
        self.steps, self.eval_every, self.checkpoint_every = p.steps, p.eval_every, p.checkpoint_every
        con = open_run(self.job.store)
        try:
            self.data = h, valid, meta = read_windows(con, self.layer)  # (N, T, d), (N, T)
        finally:
            con.close()
        ev = self.ev = held_out(meta["doc_id"], meta["window_index"], p.eval_fraction)
        if ev.all() or not ev.any():
            raise ValueError(f"layer {self.layer}: {int(ev.sum())} of {len(ev)} windows held out; adjust eval_fraction")
        self.tr_h, self.tr_v = torch.from_numpy(h[~ev]), torch.from_numpy(valid[~ev])
        self.ev_h, self.ev_v = torch.from_numpy(h[ev]), torch.from_numpy(valid[ev])
        self.standardisation = fit_standardisation([(h[~ev], valid[~ev])])
        self.resumes, self.last_eval = [], None

    def start(self) -> None:
        from actlake.jobs.train.predictor.model import PredictorTrainer

        cfg = predictor_config(self.job, self.data[0].shape[2], tuple(self.config["model_heads"]))
        self.trainer = PredictorTrainer(cfg, *self.standardisation, seed=self.job.predictor.seed, device=self.device)

    def resume(self, folder: Path) -> int:
        import torch

        self.start()
        state = torch.load(folder / STATE_FILE, weights_only=False)
        self.trainer.load_state_dict(state["trainer"])
        self.curve, self.resumes = state["curve"], state["resumes"]
        if self.trainer.step < self.steps:  # a rerun of a finished layer only rewrites its tables
            self.resumes = self.resumes + [self.trainer.step]
        return self.trainer.step

    def train_step(self, step: int) -> float:
        idx = self.trainer.sample_indices(len(self.tr_h), self.job.predictor.batch_size)
        return self.trainer.train_step(self.tr_h[idx], self.tr_v[idx])

    def evaluate(self, done: int, train_loss: float) -> dict:
        res = self.last_eval = self.trainer.evaluate(self.ev_h, self.ev_v)
        return {"step": done, "train_mse": train_loss, "mse": res.mse, "r2": res.r2}

    def reported(self, row: dict) -> dict:
        return dict(row, layer=self.layer)

    def describe(self, row: dict) -> str:
        return f"eval MSE {row['mse']:.4g}, R2 {row['r2']:.3f}"

    def save(self, folder: Path, done: int) -> None:
        import torch

        torch.save({"trainer": self.trainer.state_dict(), "curve": self.curve, "resumes": self.resumes}, folder / STATE_FILE)

    def finish(self, start: int) -> None:
        if self.last_eval is None:  # resumed after the final step; the loop evaluates at the final step otherwise
            self.last_eval = self.trainer.evaluate(self.ev_h, self.ev_v)
        finish_layer(self.job, self.layer, self.trainer, self.curve, self.data, self.ev, Path(self.config["run_dir"]),
                     self.resumes, self.last_eval)


def train_loop(config: dict) -> None:
    """Ray Train's entry point of one layer's trial."""
    PredictorLoop(config).run()


def finish_layer(job, layer: int, trainer, curve: list[dict], data, ev: np.ndarray, run_dir: Path,
                 resumes: list[int], res) -> None:
    """Final evaluation tables (from ``res``, the evaluation at the last step) and probes of one layer."""
    import pyarrow as pa

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
    from actlake.jobs.train.predictor.probes import (
        fit_probe,
        split_per_class,
        split_total,
    )

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

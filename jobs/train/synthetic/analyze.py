"""Analysis over the checkpoints of a synthetic run (METHODS.md §7, "Measurements").

Per trial (one Ray task each) and per checkpoint, on the same sampled sequences:
final-residual activations (BOS dropped, positions pooled) -> effective dimension next to the
three references; affine fits onto each factor's beliefs, their concatenation and the joint
belief; vary-one factor subspaces and their overlaps, also for randomly initialised models (the
band). Tables (one Parquet file per trial, ``trial`` from the folder name):
``factored_dimension``, ``factored_fit``, ``factor_overlap``, ``belief_scatter``, ``activations``,
``analysis_tokens`` (the token ids of the analysed sequences, so every stored activation can be
traced back to its context).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from actlake.jobs.train.synthetic.loop import build_process, config_from_dict
from actlake.storage.checkpoints import checkpoint_identity, list_checkpoints, log_spaced_steps, verified_checkpoints
from actlake.storage.layout import RunLayout
from actlake.storage.publish import discard_pending, pending_file, publish_pending

log = logging.getLogger("actlake.synthetic")

STORED_SEQUENCES = 500
"""Sequences whose activations go to the ``activations`` table, per checkpoint."""

TABLES = ("factored_dimension", "factored_fit", "factor_overlap", "belief_scatter", "activations", "analysis_tokens")


def _acts(model, tokens: np.ndarray, bos: int) -> tuple[np.ndarray, np.ndarray]:
    """Pooled final-residual activations (N*(L-1), D) and their positions (1 .. L-1)."""
    import torch

    from actlake.jobs.train.synthetic.models import final_residual, with_bos

    x = with_bos(torch.from_numpy(tokens), bos)
    h = final_residual(model, x)[:, 1:].double().numpy()  # (N, L-1, D): BOS dropped
    pos = np.broadcast_to(np.arange(1, tokens.shape[1]), h.shape[:2])
    return h.reshape(-1, h.shape[-1]), pos.reshape(-1)


def _model_rows(model, data: dict, dims: list[int], threshold: float) -> dict:
    """Every measurement of one model on the analysis data."""
    from actlake.jobs.train.synthetic import factored as F

    acts, pos = _acts(model, data["tokens"], data["bos"])
    out = {"effective_dim": F.effective_dimension(acts, threshold), "fits": [], "preds": [], "acts": (acts, pos)}
    for i, b in enumerate(data["factor_beliefs"]):
        fit = F.affine_fit(acts, b)
        out["fits"].append((f"factor{i}", fit.r2, fit.rmse))
        out["preds"].append(fit.pred)
    for target in ("concat", "joint"):
        fit = F.affine_fit(acts, data[target])
        out["fits"].append((target, fit.r2, fit.rmse))
    subspaces = []
    for i, toks in enumerate(data["vary_one"]):
        a, pos = _acts(model, toks, data["bos"])
        subspaces.append(F.pca_subspace(F.position_centre(a, pos), dims[i] - 1))
    out["overlap"] = F.overlap_matrix(subspaces)
    return out


def analysis_data(process, cfg) -> dict:
    """Sequences, true beliefs and vary-one sets shared by every checkpoint of a trial."""
    a, L = cfg.analysis, cfg.model.context
    rng = np.random.default_rng(a.seed)
    tokens = process.sample(a.sequences, L, rng)  # (N, L)
    fb = [b[:, 1:L].reshape(-1, b.shape[-1]) for b in process.factor_beliefs(tokens)]  # belief after x1..xp, p=1..L-1
    joint = process.joint_beliefs(tokens)[:, 1:L]
    return {"tokens": tokens, "bos": process.vocab_size, "factor_beliefs": fb, "concat": np.concatenate(fb, axis=1),
            "joint": joint.reshape(-1, joint.shape[-1]),
            "vary_one": [process.sample_vary_one(i, a.vary_one_sequences, L, rng) for i in range(process.n_factors)]}


def token_rows(data: dict) -> list[dict]:
    """``analysis_tokens`` rows: every analysed sequence's token ids. ``sequence_set`` ``sampled``: the
    sequences of the dimension, the fits and ``activations`` (whose ``row`` r is sequence r // (context - 1)
    at position r % (context - 1) + 1); ``vary<i>``: factor i's vary-one set of the overlaps."""
    sets = [("sampled", data["tokens"])] + [(f"vary{i}", t) for i, t in enumerate(data["vary_one"])]
    return [{"sequence_set": name, "sequence": k, "tokens": [int(x) for x in seq]}
            for name, toks in sets for k, seq in enumerate(np.asarray(toks))]


def analyze_trial(cfg_dict: dict, trial: dict, run_dir: str, threads: int = 1) -> dict:
    """Measure every kept checkpoint of one trial and the random-init band; write its tables."""
    import pyarrow as pa
    import torch

    from actlake.jobs.train.synthetic import factored as F
    from actlake.jobs.train.synthetic.models import build_model, load_model

    torch.set_num_threads(max(1, threads))
    cfg = config_from_dict(cfg_dict)
    process = build_process(cfg.process, trial["noise"])
    dims, name = list(process.state_dims), trial["name"]
    data = analysis_data(process, cfg)
    refs = {"factored_reference": F.factored_dimension(dims), "joint_reference": F.joint_dimension(dims),
            "belief_dimension": F.effective_dimension(data["joint"], cfg.analysis.threshold)}
    wanted = set(log_spaced_steps(cfg.training.steps, cfg.training.n_checkpoints))
    ckpts = [(s, p) for s, p in list_checkpoints(Path(run_dir) / "checkpoints" / name) if s in wanted]  # not resume ones
    if not ckpts:
        raise FileNotFoundError(f"no checkpoints for trial {name!r} under {run_dir}/checkpoints")
    rows = {t: [] for t in TABLES}
    rows["analysis_tokens"] = token_rows(data)
    models = [("checkpoint", step, load_model(p / "model")) for step, p in ckpts]
    models += [("random", -(j + 1), build_model(cfg.model, trial["arch"], process.vocab_size + 1, 10_000 + j))
               for j in range(cfg.analysis.random_models)]
    last = ckpts[-1][0]
    for kind, step, model in models:
        model.eval()
        m = _model_rows(model, data, dims, cfg.analysis.threshold)
        rows["factored_dimension"].append({"kind": kind, "step": step, "effective_dim": m["effective_dim"],
                                           "threshold": cfg.analysis.threshold, **refs})
        rows["factored_fit"] += [{"kind": kind, "step": step, "target": t, "r2": r2, "rmse": rmse}
                                 for t, r2, rmse in m["fits"]]
        n = len(dims)
        rows["factor_overlap"] += [{"kind": kind, "step": step, "factor_i": i, "factor_j": j,
                                    "overlap": float(m["overlap"][i, j])} for i in range(n) for j in range(n)]
        if kind == "checkpoint" and step in (0, last):
            rows["belief_scatter"] += _scatter_rows(step, data["factor_beliefs"], m["preds"], cfg.analysis.scatter_points)
        if kind == "checkpoint":  # the first STORED_SEQUENCES sequences' rows (sequence-major order)
            acts, pos = (a[: STORED_SEQUENCES * (cfg.model.context - 1)] for a in m["acts"])
            rows["activations"] += [{"step": step, "row": r, "position": int(p), "act": a.astype(np.float32).tolist()}
                                    for r, (p, a) in enumerate(zip(pos, acts))]
        log.info("trial %s %s %d: effective dim %d, R2 %s", name, kind, step, m["effective_dim"],
                 " ".join(f"{t}={r2:.3f}" for t, r2, _ in m["fits"]))
    from actlake.storage.parquet_io import write_parquet_atomic

    layout = RunLayout(Path(run_dir))
    for t, r in rows.items():  # published by the driver once every trial is analysed (analyze_run)
        if r:
            write_parquet_atomic(pa.Table.from_pylist(r), pending_file(run_dir, t, f"trial={name}"), layout.staging)
    return {"trial": name, "checkpoints": len(ckpts), **refs}


def _scatter_rows(step: int, beliefs: list[np.ndarray], preds: list[np.ndarray], n: int) -> list[dict]:
    out = []
    for i, (b, p) in enumerate(zip(beliefs, preds)):
        idx = np.random.default_rng(i).choice(len(b), size=min(n, len(b)), replace=False)
        out += [{"step": step, "factor": i, "point": int(k), "true": b[k].tolist(), "pred": p[k].tolist()} for k in idx]
    return out


def analyze_run(cfg, run_dir: Path, cpus: float = 1) -> list[dict]:
    """One Ray task per trial; returns each trial's reference dimensions. Every checkpoint the tasks read is
    checked first, here: present, whole (its manifest) and this run's (its identity)."""
    import ray


    steps = log_spaced_steps(cfg.training.steps, cfg.training.n_checkpoints)
    for trial in cfg.trials():
        verified_checkpoints(Path(run_dir) / "checkpoints" / trial["name"], steps,
                             checkpoint_identity(cfg.config_hash, trial["name"]))
    discard_pending(run_dir)
    task = ray.remote(num_cpus=cpus)(analyze_trial)
    refs = [task.remote(cfg.to_dict(), trial, str(run_dir), int(max(1, cpus))) for trial in cfg.trials()]
    out = ray.get(refs)
    publish_pending(run_dir)  # every trial's tables at once: none if one failed (a full disk)
    return out

"""Training loop of ``actlake train-synthetic`` (runs on Ray Train workers).

Every step draws fresh sequences from the process (seeded by (seed, step, rank), so a resumed run
draws exactly the batches an uninterrupted one would). Checkpoints: log-spaced steps are kept for
the analysis, a resume checkpoint every ``checkpoint_every`` steps (the newest two). Each is a
folder ``checkpoints/<trial>/step-NNNNNNNN/`` with ``model/`` (save_pretrained) and the trainer
state (optimizer, step, learning curve so far).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from actlake.jobs.training import (STATE_FILE, latest_checkpoint, log_spaced_steps, prune_checkpoints, save_checkpoint,
                                   worker_setup)
from actlake.jobs.synthetic import processes as P
from actlake.jobs.synthetic.config import FactorConfig, ProcessConfig, SyntheticConfig

log = logging.getLogger("actlake.synthetic")

CURVES_TABLE = "training_curves"


def _factor_ghmm(f: FactorConfig, v=None):
    pick = lambda name: (getattr(v, name, None) if v is not None and getattr(v, name, None) is not None  # noqa: E731
                         else getattr(f, name))
    if f.kind == "mess3":
        return P.mess3(x=pick("x") if pick("x") is not None else 0.15,
                       alpha=pick("alpha") if pick("alpha") is not None else 0.6)
    if f.kind == "bloch_walk":
        return P.bloch_walk(alpha=pick("alpha") if pick("alpha") is not None else 1.0,
                            beta=pick("beta") if pick("beta") is not None else 3.0)
    return P.from_matrices(f.matrices, f.eta0, name="matrices")  # validated there (ragged, NaN, eigenvalues)


def build_process(pcfg: ProcessConfig, noise: float | None = None) -> "P.ProductProcess":
    """The product process a config describes (``noise`` overrides ``pcfg.noise``)."""
    factors = [[_factor_ghmm(f, v) for v in f.variants] if f.variants else [_factor_ghmm(f)] for f in pcfg.factors]
    return P.ProductProcess(factors=factors, noise=pcfg.noise if noise is None else noise)


def config_from_dict(d: dict) -> SyntheticConfig:
    from actlake.config import parse_config

    return parse_config(d, where="synthetic job config", root=SyntheticConfig)


def train_loop(config: dict) -> None:
    """Ray Train loop of one trial; ``config``: job (SyntheticConfig as dict), trial, noise, arch, run_dir."""
    import ray.train
    import torch

    from actlake.jobs.synthetic.models import build_model, load_model, logits, with_bos

    cfg = config_from_dict(config["job"])
    t, trial = cfg.training, config["trial"]
    rank, world, device = worker_setup(config)
    process = build_process(cfg.process, config["noise"])
    bos = process.vocab_size
    ck_root = Path(config["run_dir"]) / "checkpoints" / trial
    latest = latest_checkpoint(ck_root)
    if latest is None:
        model, start, curve = build_model(cfg.model, config["arch"], bos + 1, t.seed), 0, []
    else:
        model = load_model(latest[1] / "model")
        state = torch.load(latest[1] / STATE_FILE, weights_only=False)
        start, curve = state["step"], state["curve"]
        log.info("trial %s: resuming from step %d", trial, start)
    model = ray.train.torch.prepare_model(model)
    raw = model.module if hasattr(model, "module") else model
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    if latest is not None:
        opt.load_state_dict(state["optimizer"])

    eval_tokens = torch.from_numpy(process.sample(t.eval_sequences, cfg.model.context, np.random.default_rng([t.seed, 10**9])))
    optimal = float(process.optimal_loss(eval_tokens.numpy()).mean())
    keep = set(log_spaced_steps(t.steps, t.n_checkpoints))

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            x = eval_tokens.to(device)
            out = logits(raw, with_bos(x, bos))
            value = torch.nn.functional.cross_entropy(out.flatten(0, 1), x.flatten()).item()
        model.train()
        return value

    def checkpoint(step: int) -> None:
        def write(folder: Path) -> None:
            raw.save_pretrained(folder / "model")
            torch.save({"step": step, "optimizer": opt.state_dict(), "curve": curve}, folder / STATE_FILE)

        save_checkpoint(ck_root, step, write, config.get("identity"))
        prune_checkpoints(ck_root, keep)
        _write_curve(Path(config["run_dir"]), trial, curve)

    if latest is None:  # a run resumed from the step-0 checkpoint has this row already
        curve.append({"step": 0, "train_loss": None, "eval_loss": eval_loss(), "optimal_loss": optimal})
        if rank == 0:
            checkpoint(0)
    model.train()
    for step in range(start + 1, t.steps + 1):
        toks = torch.from_numpy(process.sample(t.batch_size, cfg.model.context, np.random.default_rng([t.seed, step, rank])))
        toks = toks.to(device)
        out = logits(model if world > 1 else raw, with_bos(toks, bos))  # (B, L, V)
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), toks.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % t.eval_every == 0 or step == t.steps:
            row = {"step": step, "train_loss": loss.item(), "eval_loss": eval_loss(), "optimal_loss": optimal}
            curve.append(row)
            ray.train.report(dict(row, trial=trial))
            if rank == 0:
                log.info("trial %s step %d/%d: loss %.4f (Bayes-optimal %.4f)", trial, step, t.steps,
                         row["eval_loss"], optimal)
        if rank == 0 and (step in keep or step % t.checkpoint_every == 0):
            checkpoint(step)


def _write_curve(run_dir: Path, trial: str, curve: list[dict]) -> None:
    import pyarrow as pa

    from actlake.jobs.training import publish_table

    table = pa.Table.from_pylist(curve, schema=pa.schema([("step", pa.int64()), ("train_loss", pa.float64()),
                                                          ("eval_loss", pa.float64()), ("optimal_loss", pa.float64())]))
    publish_table(run_dir, CURVES_TABLE, f"trial={trial}", table)

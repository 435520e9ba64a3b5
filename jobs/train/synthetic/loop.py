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

from actlake.config import parse_config
from actlake.jobs.train.loop import ModelLoop
from actlake.jobs.train.synthetic import processes as P
from actlake.jobs.train.synthetic.config import FactorConfig, ProcessConfig, SyntheticConfig
from actlake.storage.checkpoints import log_spaced_steps
from actlake.storage.publish import publish_table

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
    return parse_config(d, where="synthetic job config", root=SyntheticConfig)


class SyntheticLoop(ModelLoop):
    """One trial of train-synthetic: ``config`` has job (SyntheticConfig as dict), noise and arch. Step k
    (1-based) draws fresh sequences seeded by (seed, k, rank); the untrained model is evaluated and
    checkpointed as step 0; log-spaced checkpoints are kept for the analysis."""

    def __init__(self, config: dict):
        super().__init__(config)
        self.cfg = config_from_dict(config["job"])
        t = self.t = self.cfg.training
        self.steps, self.eval_every, self.checkpoint_every = t.steps, t.eval_every, t.checkpoint_every
        self.keep_steps = frozenset(log_spaced_steps(t.steps, t.n_checkpoints))
        self.process = build_process(self.cfg.process, config["noise"])
        self.bos = self.process.vocab_size
        self.eval_tokens = self.process.sample(t.eval_sequences, self.cfg.model.context, np.random.default_rng([t.seed, 10**9]))
        self.optimal = float(self.process.optimal_loss(self.eval_tokens).mean())

    def new_model(self):
        from actlake.jobs.train.synthetic.models import build_model

        return build_model(self.cfg.model, self.config["arch"], self.bos + 1, self.t.seed)

    def load_model(self, folder: Path):
        from actlake.jobs.train.synthetic.models import load_model

        return load_model(folder)

    def adamw_options(self) -> dict:
        return {"lr": self.t.lr, "weight_decay": self.t.weight_decay}

    def begin(self, resumed: bool) -> None:
        if not resumed:  # a run resumed from the step-0 checkpoint has this row already
            self.curve.append({"step": 0, "train_loss": None, "eval_loss": self._eval_loss(), "optimal_loss": self.optimal})
            if self.rank == 0:
                self.checkpoint(0)

    def train_step(self, step: int) -> float:
        import torch

        from actlake.jobs.train.synthetic.models import logits, with_bos

        t = self.t
        toks = self.process.sample(t.batch_size, self.cfg.model.context, np.random.default_rng([t.seed, step + 1, self.rank]))
        toks = torch.from_numpy(toks).to(self.device)  # (B, L)
        out = logits(self.model if self.world > 1 else self.raw, with_bos(toks, self.bos))  # (B, L, V)
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), toks.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.item()

    def _eval_loss(self) -> float:
        import torch

        from actlake.jobs.train.synthetic.models import logits, with_bos

        self.model.eval()
        with torch.no_grad():
            x = torch.from_numpy(self.eval_tokens).to(self.device)
            out = logits(self.raw, with_bos(x, self.bos))
            value = torch.nn.functional.cross_entropy(out.flatten(0, 1), x.flatten()).item()
        self.model.train()
        return value

    def evaluate(self, done: int, train_loss: float) -> dict:
        return {"step": done, "train_loss": train_loss, "eval_loss": self._eval_loss(), "optimal_loss": self.optimal}

    def reported(self, row: dict) -> dict:
        return dict(row, trial=self.config["trial"])

    def describe(self, row: dict) -> str:
        return f"loss {row['eval_loss']:.4f} (Bayes-optimal {self.optimal:.4f})"

    def after_checkpoint(self, done: int) -> None:
        _write_curve(Path(self.config["run_dir"]), self.config["trial"], self.curve)


def train_loop(config: dict) -> None:
    """Ray Train's entry point of one trial."""
    SyntheticLoop(config).run()


def _write_curve(run_dir: Path, trial: str, curve: list[dict]) -> None:
    import pyarrow as pa


    table = pa.Table.from_pylist(curve, schema=pa.schema([("step", pa.int64()), ("train_loss", pa.float64()),
                                                          ("eval_loss", pa.float64()), ("optimal_loss", pa.float64())]))
    publish_table(run_dir, CURVES_TABLE, f"trial={trial}", table)

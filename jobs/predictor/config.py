"""Config of ``actlake train-predictor`` (seed 003)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from actlake.train_config import RunOutputConfig, TrainJob, TrainResourcesConfig, check_optimizer


@dataclass
class PredictorSettings:
    n_heads: Optional[int] = None
    """Attention heads of the predictor; null: 4x one attention layer of the analysed model (2x heads, 2x head size)."""
    head_dim: Optional[int] = None
    """Head size of the predictor; null: see n_heads."""
    steps: int = 2000
    """Optimizer steps per layer."""
    batch_size: int = 32
    """Windows per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 100
    """Linear warm-up steps."""
    eval_every: int = 100
    """Steps between evaluations (a point of the learning curves)."""
    checkpoint_every: int = 500
    """Steps between resume checkpoints (the newest two are kept)."""
    eval_fraction: float = 0.2
    """Windows held out for evaluation (by a hash of doc id and window), never trained on."""
    seed: int = 0
    """Seeds initialisation and batch order."""


@dataclass
class ProbeSettings:
    enabled: bool = True
    """Fit the linear probes after training."""
    tasks: list[Literal["source", "type8"]] = field(default_factory=lambda: ["source", "type8"])
    """``source``: the document's source label; ``type8``: the type of the token at the window's last position."""
    source_caps: list[int] = field(default_factory=lambda: [4000, 500, 500])
    """Per-class caps (train, val, test) for the source task."""
    type8_totals: list[int] = field(default_factory=lambda: [40000, 5000, 5000])
    """Totals (train, val, test) for the type8 task."""
    Cs: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0])
    """Inverse regularisation strengths tried; the best on validation is scored on test."""
    seed: int = 0
    """Seeds the splits."""


@dataclass
class PredictorJobConfig(TrainJob):
    RUN_ID_EXCLUDE = ("probes",)

    name: str = "predictor"
    """Job name; part of the default run id."""
    store: str = "runs/predictive-extract"
    """Run directory of an ``actlake run`` with an activation store (``activations.layers``)."""
    layers: list[int] = field(default_factory=list)
    """Hidden-state layers to train predictors for; empty: every layer in the store."""
    predictor: PredictorSettings = field(default_factory=PredictorSettings)
    probes: ProbeSettings = field(default_factory=ProbeSettings)
    output: RunOutputConfig = field(default_factory=RunOutputConfig)
    resources: TrainResourcesConfig = field(default_factory=TrainResourcesConfig)
    source_file: Optional[str] = field(default=None, metadata={"internal": True})

    def check(self, err) -> None:
        p, q = self.predictor, self.probes
        for key in ("steps", "batch_size", "eval_every", "checkpoint_every"):
            if getattr(p, key) < 1:
                err(("predictor", key), "must be at least 1")
        check_optimizer(err, "predictor", p)
        if (p.n_heads is None) != (p.head_dim is None):
            err(("predictor", "n_heads"), "set both n_heads and head_dim, or neither")
        if not 0 < p.eval_fraction < 1:
            err(("predictor", "eval_fraction"), f"must be in (0, 1), got {p.eval_fraction}")
        for key in ("source_caps", "type8_totals"):
            v = getattr(q, key)
            if len(v) != 3 or min(v) < 1:
                err(("probes", key), f"must be three positive counts (train, val, test), got {v}")
        if self.resources.num_workers != 1:
            err(("resources", "num_workers"), "must be 1: each layer's predictor trains on one worker; layers run "
                "as parallel trials")
        if not q.Cs or min(q.Cs) <= 0:
            err(("probes", "Cs"), f"must be positive numbers, got {q.Cs}")

    def check_files(self) -> None:
        from actlake.errors import ConfigError

        tables = Path(self.store) / "tables" / "activations"
        if not tables.is_dir():
            raise ConfigError(f"{self.source_file}: 'store': {Path(self.store).resolve()} has no activation store "
                              "(run an extraction with activations.layers set first)")

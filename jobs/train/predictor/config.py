"""Config of ``actlake train-predictor`` (seed 003)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import Field

from actlake.config_base import LocalPath, Section
from actlake.errors import ConfigError
from actlake.train_config import TrainingLoop, TrainJob, Warmup


class PredictorSettings(TrainingLoop.with_defaults(steps=2000, batch_size=32, lr=1e-3, weight_decay=0.01,
                                                   eval_every=100, checkpoint_every=500), Warmup):
    n_heads: Optional[int] = None
    """Attention heads of the predictor; null: 4x one attention layer of the analysed model (2x heads, 2x head size)."""
    head_dim: Optional[int] = None
    """Head size of the predictor; null: see n_heads."""
    eval_fraction: float = Field(0.2, gt=0, lt=1, allow_inf_nan=False)
    """Windows held out for evaluation (by a hash of doc id and window), never trained on."""

class ProbeSettings(Section):
    enabled: bool = True
    """Fit the linear probes after training."""
    tasks: list[Literal["source", "type8"]] = ["source", "type8"]
    """``source``: the document's source label; ``type8``: the type of the token at the window's last position."""
    source_caps: list[Annotated[int, Field(ge=1)]] = [4000, 500, 500]
    """Per-class caps (train, val, test) for the source task."""
    type8_totals: list[Annotated[int, Field(ge=1)]] = [40000, 5000, 5000]
    """Totals (train, val, test) for the type8 task."""
    Cs: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] = [0.01, 0.1, 1.0]
    """Inverse regularisation strengths tried; the best on validation is scored on test."""
    seed: int = 0
    """Seeds the splits."""

class PredictorJobConfig(TrainJob.with_defaults(name="predictor")):
    RUN_ID_EXCLUDE = ("probes",)

    store: LocalPath = "runs/predictive-extract"
    """Run directory of an ``actlake run`` with an activation store (``activations.layers``): a local folder or a shared mount (``~`` expanded, relative to the working directory, resolved to an absolute path when the config is read)."""
    layers: list[int] = []
    """Hidden-state layers to train predictors for; empty: every layer in the store."""
    predictor: PredictorSettings
    probes: ProbeSettings

    def check(self, err) -> None:
        p, q = self.predictor, self.probes
        if (p.n_heads is None) != (p.head_dim is None):
            err(("predictor", "n_heads"), "set both n_heads and head_dim, or neither")
        for key in ("source_caps", "type8_totals"):  # each count >= 1 is a bound on the items
            v = getattr(q, key)
            if len(v) != 3:
                err(("probes", key), f"must be three positive counts (train, val, test), got {v}")
        if self.resources.num_workers != 1:
            err(("resources", "num_workers"), "must be 1: each layer's predictor trains on one worker; layers run "
                "as parallel trials")
        if not q.Cs:  # each C > 0 is a bound on the items
            err(("probes", "Cs"), f"must be positive numbers, got {q.Cs}")

    def check_files(self) -> None:
        tables = Path(self.store) / "tables" / "activations"
        if not tables.is_dir():
            raise ConfigError(f"{self.source_file}: 'store': {self.store} has no activation store "
                              "(run an extraction with activations.layers set first)")

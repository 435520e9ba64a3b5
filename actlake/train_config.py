"""Config pieces shared by the training jobs (train-lm, train-predictor, train-synthetic)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional


@dataclass
class RunOutputConfig:
    dir: str = "runs"
    """Parent folder of run directories."""
    run_id: Optional[str] = None
    """Run directory name. Default: the config's name plus a hash of its contents (a rerun resumes)."""
    report: bool = True
    """Render ``report/report.html`` at the end (train-predictor, train-synthetic)."""


@dataclass
class TrainResourcesConfig:
    address: Optional[str] = None
    """Ray address. None: ``RAY_ADDRESS`` if set, else an embedded local Ray on 127.0.0.1."""
    num_workers: int = 1
    """Ray Train workers per trial (data parallel; each draws its own batches)."""
    cpus_per_worker: float = 1
    """CPUs per Ray Train worker (torch threads)."""
    use_gpu: bool = False
    """One GPU per Ray Train worker."""


def check_optimizer(err, section: str, settings) -> None:
    """Shared value checks of a training section: lr > 0 and finite, weight_decay >= 0, warmup_steps >= 0."""
    import math

    lr = settings.lr
    if not (math.isfinite(lr) and lr > 0):
        err((section, "lr"), f"must be a positive number, got {lr}")
    if not (math.isfinite(settings.weight_decay) and settings.weight_decay >= 0):
        err((section, "weight_decay"), f"must be at least 0, got {settings.weight_decay}")
    if getattr(settings, "warmup_steps", 0) < 0:
        err((section, "warmup_steps"), f"must be at least 0, got {settings.warmup_steps}")


class TrainJob:
    """``to_dict``, ``run_id`` and ``run_dir`` of a training job config (a dataclass with ``name`` and ``output``)."""

    RUN_ID_EXCLUDE: tuple[str, ...] = ()
    """Sections besides output/resources/name that do not change the run id (they do not change training)."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("source_file", None)
        return d

    @property
    def run_id(self) -> str:
        d = self.to_dict()
        for k in ("output", "resources", "name", *self.RUN_ID_EXCLUDE):
            d.pop(k, None)
        h = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]
        return self.output.run_id or f"{self.name}-{h}"

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir).resolve() / self.run_id

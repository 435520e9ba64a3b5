"""Config pieces shared by the training jobs (train-lm, train-predictor, train-synthetic)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import ClassVar

from pydantic import model_validator

from actlake.config import OutputConfig, RayAddress
from actlake.config_base import ConfigRoot, Section, config_error
from actlake.fs import url_scheme


class TrainResourcesConfig(RayAddress):
    num_workers: int = 1
    """Ray Train workers per trial (data parallel; each draws its own batches)."""
    cpus_per_worker: float = 1
    """CPUs per Ray Train worker (torch threads)."""
    use_gpu: bool = False
    """One GPU per Ray Train worker."""

    @model_validator(mode="after")
    def _counts(self):
        if self.num_workers < 1:
            config_error(("resources", "num_workers"), f"must be at least 1, got {self.num_workers}")
        if not self.cpus_per_worker > 0:
            config_error(("resources", "cpus_per_worker"), f"must be more than 0, got {self.cpus_per_worker:g}")
        return self


class AdamW(Section):
    """The optimiser of every training loop; a job sets the defaults (``AdamW.with_defaults``)."""

    lr: float
    """Peak AdamW learning rate: linear warm-up, then cosine decay to 10% (train-synthetic: constant, as in the paper)."""
    weight_decay: float
    """AdamW weight decay."""

    def check(self, err, section: str) -> None:
        """lr > 0 and finite, weight_decay >= 0, warmup_steps (where there is one) >= 0."""
        if not (math.isfinite(self.lr) and self.lr > 0):
            err((section, "lr"), f"must be a positive number, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            err((section, "weight_decay"), f"must be at least 0, got {self.weight_decay}")
        if getattr(self, "warmup_steps", 0) < 0:
            err((section, "warmup_steps"), f"must be at least 0, got {self.warmup_steps}")


class Warmup(Section):
    warmup_steps: int = 100
    """Linear warm-up steps (from lr/warmup_steps up to lr)."""

class TrainingLoop(AdamW):
    """The ``training`` section every training job shares; a job sets the defaults (``with_defaults``)."""

    COUNTS: ClassVar[tuple[str, ...]] = ("steps", "batch_size", "eval_every", "checkpoint_every")
    """Fields that must be at least 1."""

    steps: int
    """Optimizer steps (train-predictor: per layer; train-synthetic: each on fresh sequences from the process)."""
    batch_size: int
    """Windows (train-synthetic: sequences) per step and worker."""
    eval_every: int
    """Steps between evaluations on held-out data (a point of the learning curves)."""
    checkpoint_every: int
    """Steps between resume checkpoints (the newest two are kept)."""
    seed: int = 0
    """Seeds the initialisation and every batch (a resumed run draws the same batches)."""

    def check(self, err, section: str) -> None:
        for key in self.COUNTS:
            if getattr(self, key) < 1:
                err((section, key), "must be at least 1")
        super().check(err, section)


class TrainJob(ConfigRoot):
    """A training job's config: its ``output`` and ``resources`` sections, ``run_id`` and ``run_dir``."""

    RUN_ID_EXCLUDE: ClassVar[tuple[str, ...]] = ()
    """Sections besides output/resources/name that do not change the run id (they do not change training)."""

    output: OutputConfig
    resources: TrainResourcesConfig

    @model_validator(mode="after")
    def _local_output(self):
        if url_scheme(self.output.dir) not in (None, "file"):
            config_error(("output", "dir"), f"{self.output.dir!r}: training jobs write to a local folder or a shared "
                         "mount (object stores hold the runs of `actlake run` only)")
        return self

    @property
    def config_hash(self) -> str:
        """Hash of every setting that changes training (output, resources, name and RUN_ID_EXCLUDE left out)."""
        d = self.to_dict()
        for k in ("output", "resources", "name", *self.RUN_ID_EXCLUDE):
            d.pop(k, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def run_id(self) -> str:
        return self.output.run_id or f"{self.name}-{self.config_hash}"

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir) / self.run_id

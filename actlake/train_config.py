"""Config pieces shared by the training jobs (train-lm, train-predictor, train-synthetic)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from actlake.config import OutputConfig, RayAddress
from actlake.config_base import ConfigRoot, Section, config_error
from actlake.fs import url_scheme


class TrainResourcesConfig(RayAddress):
    num_workers: int = Field(1, ge=1)
    """Ray Train workers per trial (data parallel; each draws its own batches)."""
    cpus_per_worker: float = Field(1, gt=0, allow_inf_nan=False)
    """CPUs per Ray Train worker (torch threads)."""
    use_gpu: bool = False
    """One GPU per Ray Train worker."""


class AdamW(Section):
    """The optimiser of every training loop; a job sets the defaults (``AdamW.with_defaults``)."""

    lr: float = Field(gt=0, allow_inf_nan=False)
    """Peak AdamW learning rate: linear warm-up, then cosine decay to 10% (train-synthetic: constant, as in the paper)."""
    weight_decay: float = Field(ge=0, allow_inf_nan=False)
    """AdamW weight decay."""


class Warmup(Section):
    warmup_steps: int = Field(100, ge=0)
    """Linear warm-up steps (from lr/warmup_steps up to lr)."""

class TrainingLoop(AdamW):
    """The ``training`` section every training job shares; a job sets the defaults (``with_defaults``)."""

    steps: int = Field(ge=1)
    """Optimizer steps (train-predictor: per layer; train-synthetic: each on fresh sequences from the process)."""
    batch_size: int = Field(ge=1)
    """Windows (train-synthetic: sequences) per step and worker."""
    eval_every: int = Field(ge=1)
    """Steps between evaluations on held-out data (a point of the learning curves)."""
    checkpoint_every: int = Field(ge=1)
    """Steps between resume checkpoints (the newest two are kept)."""
    seed: int = 0
    """Seeds the initialisation and every batch (a resumed run draws the same batches)."""


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

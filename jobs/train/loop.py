"""The training loop every training job runs on its Ray Train workers, as a template.

:meth:`TrainLoop.run`: resume from the trial's newest checkpoint (or start) -> step -> evaluate on its
cadence (a learning-curve row, reported to Ray Train and logged) -> checkpoint and prune on its cadence
(rank 0) -> finish (rank 0). A job subclasses it and fills in what differs: building or loading its model
and optimizer, one optimisation step, one evaluation, what a checkpoint holds; the order, the cadences,
the step numbering and the checkpoint bookkeeping are here, once.

Steps are counted as completed optimiser steps: ``done`` runs from the resumed step to ``steps``;
``train_step(step)`` is called with the 0-based index of the step it takes (``done`` before it).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path

from actlake.jobs.common.clock import hms
from actlake.jobs.train.training import worker_setup
from actlake.storage.checkpoints import STATE_FILE, latest_checkpoint, prune_checkpoints, save_checkpoint

log = logging.getLogger("actlake.training")


class Pace:
    """Between evaluations, a line every ``every_s`` seconds: the mean training loss since the last line, and
    the time left at the pace of the steps this attempt took so far."""

    def __init__(self, start: int, steps: int, every_s: float = 15.0, clock=time.monotonic):
        self.start, self.steps, self.every_s, self.clock = start, steps, every_s, clock
        self.t0 = self.last = clock()
        self.done, self.losses = start, []

    def step(self, loss: float) -> None:
        self.done += 1
        self.losses.append(float(loss))

    def due(self) -> bool:
        return self.clock() - self.last >= self.every_s

    def mean_loss(self) -> float:
        return sum(self.losses) / max(1, len(self.losses))

    def said(self) -> None:
        self.last, self.losses = self.clock(), []

    def eta(self) -> str:
        """``, ETA 00:01:05`` (empty when no step has run or none is left)."""
        ran, left = self.done - self.start, self.steps - self.done
        if ran <= 0 or left <= 0:
            return ""
        return ", ETA " + hms((self.clock() - self.t0) / ran * left)


class TrainLoop(ABC):
    """One trial's loop on one Ray Train worker; ``config`` is the trial's config mapping (``trial``,
    ``run_dir``, ``identity``, ``cpus_per_worker`` and the job's own keys)."""

    steps: int
    """Optimiser steps in all."""
    eval_every: int
    checkpoint_every: int
    keep_steps: frozenset = frozenset()
    """Steps whose checkpoints are kept (and written) besides the newest two."""

    def __init__(self, config: dict):
        self.config = config
        self.curve: list[dict] = []
        self.ck_root = Path(config["run_dir"]) / "checkpoints" / config["trial"]

    # ------------------------------------------------------------------ what a job fills in
    @abstractmethod
    def start(self) -> None:
        """A fresh model and optimizer (no checkpoint yet)."""

    @abstractmethod
    def resume(self, folder: Path) -> int:
        """Model, optimizer and :attr:`curve` from a checkpoint folder; returns its step."""

    @abstractmethod
    def train_step(self, step: int) -> float:
        """Take optimiser step ``step`` (0-based); returns its training loss."""

    @abstractmethod
    def evaluate(self, done: int, train_loss: float) -> dict:
        """The learning-curve row after ``done`` steps."""

    @abstractmethod
    def save(self, folder: Path, done: int) -> None:
        """Write a checkpoint's files (model, trainer state with :attr:`curve`) into ``folder``."""

    def describe(self, row: dict) -> str:
        """The log line of a learning-curve row."""
        return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())

    def reported(self, row: dict) -> dict:
        """What goes to ``ray.train.report`` for a row (default: the row)."""
        return row

    def begin(self, resumed: bool) -> None:
        """After start or resume, before the first step (the model is on its device)."""

    def after_checkpoint(self, done: int) -> None:
        """After a checkpoint was written and old ones pruned (rank 0)."""

    def finish(self, start: int) -> None:
        """After the last step, on rank 0 (``start``: the step this attempt resumed from)."""

    # ------------------------------------------------------------------ the template
    def checkpoint(self, done: int) -> None:
        save_checkpoint(self.ck_root, done, lambda folder: self.save(folder, done), self.config.get("identity"))
        prune_checkpoints(self.ck_root, set(self.keep_steps))
        self.after_checkpoint(done)

    def run(self) -> None:
        import ray.train

        self.rank, self.world, self.device = worker_setup(self.config)
        latest = latest_checkpoint(self.ck_root)
        if latest is None:
            self.start()
            start = 0
        else:
            start = self.resume(latest[1])
            log.info("%s: resuming from step %d", self.config["trial"], start)
        self.begin(resumed=latest is not None)
        pace = Pace(start, self.steps)
        for step in range(start, self.steps):
            loss = self.train_step(step)
            done = step + 1
            pace.step(loss)
            if done % self.eval_every == 0 or done == self.steps:
                row = self.evaluate(done, loss)
                self.curve.append(row)
                ray.train.report(self.reported(row))
                if self.rank == 0:
                    log.info("%s step %d/%d: %s%s", self.config["trial"], done, self.steps, self.describe(row),
                             pace.eta())
                pace.said()
            elif self.rank == 0 and pace.due():
                log.info("%s step %d/%d: train loss %.4g (mean since the last line)%s", self.config["trial"], done,
                         self.steps, pace.mean_loss(), pace.eta())
                pace.said()
            if self.rank == 0 and (done % self.checkpoint_every == 0 or done == self.steps or done in self.keep_steps):
                self.checkpoint(done)
        if self.rank == 0:
            self.finish(start)


class ModelLoop(TrainLoop):
    """A loop whose checkpoint is a ``save_pretrained`` model with AdamW's state and the learning curve
    (train-lm, train-synthetic): a job gives its model (:meth:`new_model`, :meth:`load_model`) and AdamW's
    options; starting, resuming and saving are here."""

    @abstractmethod
    def new_model(self):
        """A freshly initialised model."""

    @abstractmethod
    def load_model(self, folder: Path):
        """The model saved in ``folder`` (a checkpoint's ``model/``)."""

    def adamw_options(self) -> dict:
        """Keyword arguments of ``torch.optim.AdamW`` besides the parameters."""
        return {}

    def start(self) -> None:
        self._prepare(self.new_model(), None)

    def resume(self, folder: Path) -> int:
        import torch

        model = self.load_model(folder / "model")
        state = torch.load(folder / STATE_FILE, weights_only=False)
        self.curve = state["curve"]
        self._prepare(model, state["optimizer"])
        return state["step"]

    def _prepare(self, model, optimizer_state) -> None:
        import ray.train
        import torch

        self.model = ray.train.torch.prepare_model(model)
        self.raw = self.model.module if hasattr(self.model, "module") else self.model  # unwrapped from DDP
        self.opt = torch.optim.AdamW(self.model.parameters(), **self.adamw_options())
        if optimizer_state is not None:
            self.opt.load_state_dict(optimizer_state)
        self.model.train()

    def save(self, folder: Path, done: int) -> None:
        import torch

        self.raw.save_pretrained(folder / "model")
        torch.save({"step": done, "optimizer": self.opt.state_dict(), "curve": self.curve}, folder / STATE_FILE)

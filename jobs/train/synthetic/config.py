"""Config of ``actlake train-synthetic``: a factored process, a small model, training, the analysis.

Parsed by the same YAML machinery as extraction jobs (unknown keys, wrong types and bad values
are errors naming the file, key and line).
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field

from actlake.config_base import Section
from actlake.errors import ConfigError
from actlake.train_config import TrainingLoop, TrainJob


class VariantConfig(Section):
    x: Optional[float] = None
    """Mess3 x of this variant (default: the factor's)."""
    alpha: Optional[float] = None
    """Mess3 or Bloch-walk alpha of this variant (default: the factor's)."""
    beta: Optional[float] = None
    """Bloch-walk beta of this variant (default: the factor's)."""

class FactorConfig(Section):
    kind: Literal["mess3", "bloch_walk", "matrices"] = "mess3"
    """Process of this factor: Mess3, Bloch walk, or any GHMM given by ``matrices``."""
    x: Optional[float] = None
    """Mess3 x (stay probability 1 - 2x); default 0.15 as in the paper."""
    alpha: Optional[float] = None
    """Mess3 alpha (default 0.6) or Bloch-walk alpha (default 1.0)."""
    beta: Optional[float] = None
    """Bloch-walk beta (default 3.0)."""
    matrices: Optional[list[list[list[float]]]] = None
    """``kind: matrices``: T(x) for every token x, a V x S x S nested list."""
    eta0: Optional[list[float]] = None
    """``kind: matrices``: initial belief (default: the stationary one)."""
    variants: list[VariantConfig] = []
    """Hidden dependency: one parameter set per sub-token of the previous factor, chosen by that sub-token at each step. Empty: independent."""

class ProcessConfig(Section):
    factors: list[FactorConfig] = [FactorConfig(), FactorConfig(), FactorConfig()]
    """The factors; the joint token is their radix encoding (factor 0 most significant)."""
    noise: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    """epsilon: probability that the emitted joint token is replaced by a uniform one."""

class SyntheticModelConfig(Section):
    arch: Literal["transformer", "rnn", "lstm"] = "transformer"
    """GPT-2-style transformer (transformers' GPT2LMHeadModel), or a recurrent network."""
    n_layers: int = 4
    """Transformer blocks (or recurrent layers)."""
    d_model: int = 64
    """Residual width (hidden size of the recurrent layers)."""
    n_heads: int = 4
    """Attention heads (transformer)."""
    d_mlp: int = 256
    """MLP width (transformer)."""
    context: int = Field(8, ge=2)
    """Tokens per sequence; the model reads [BOS, x1 .. x(context-1)] and predicts x1 .. x(context)."""

class SyntheticTrainingConfig(TrainingLoop.with_defaults(steps=2000, batch_size=512, lr=5e-4, weight_decay=0.0,
                                                          eval_every=50, checkpoint_every=250)):
    n_checkpoints: int = Field(12, ge=2)
    """Checkpoints kept for the analysis, log-spaced over the steps (step 0 included)."""
    eval_sequences: int = Field(2048, ge=1)
    """Held-out sequences for the evaluation loss and the Bayes-optimal loss."""

class SweepConfig(Section):
    noise: list[Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]] = []
    """One trial per epsilon (overrides process.noise); empty: just process.noise."""
    arch: list[Literal["transformer", "rnn", "lstm"]] = []
    """One trial per architecture (overrides model.arch); empty: just model.arch."""

class SyntheticAnalysisConfig(Section):
    enabled: bool = True
    """Run the analysis over the checkpoints after training."""
    sequences: int = 2000
    """Sampled sequences whose final-residual activations are analysed (BOS dropped, positions pooled)."""
    vary_one_sequences: int = 400
    """Sequences per factor for the vary-one subspaces."""
    random_models: int = 3
    """Randomly initialised models giving the overlap band."""
    threshold: float = Field(0.95, gt=0, lt=1, allow_inf_nan=False)
    """Explained-variance fraction defining the effective dimension."""
    scatter_points: int = 600
    """Points per factor kept for the belief-simplex scatter."""
    seed: int = 1234
    """Seeds the analysis sequences (the same for every checkpoint)."""

class SyntheticConfig(TrainJob.with_defaults(name="synthetic")):
    process: ProcessConfig
    model: SyntheticModelConfig
    training: SyntheticTrainingConfig
    sweep: SweepConfig
    analysis: SyntheticAnalysisConfig

    RUN_ID_EXCLUDE = ("analysis",)

    def trials(self) -> list[dict]:
        """One mapping per trial: name, noise, arch."""
        noises = self.sweep.noise or [self.process.noise]
        archs = self.sweep.arch or [self.model.arch]
        out = []
        for arch in archs:
            for eps in noises:
                name = arch if len(archs) > 1 else ""
                name += (f"{'-' if name else ''}eps{eps:g}") if self.sweep.noise else ""
                out.append({"name": name or arch, "noise": eps, "arch": arch})
        return out

    def check(self, err) -> None:
        m = self.model
        if not self.process.factors:
            err(("process", "factors"), "at least one factor is needed")
        for i, f in enumerate(self.process.factors):
            if f.kind == "matrices" and f.matrices is None:
                err(("process", "factors", i, "kind"), "kind 'matrices' needs 'matrices'")
            if f.kind != "matrices" and (f.matrices is not None or f.eta0 is not None):
                err(("process", "factors", i, "matrices"), f"only for kind 'matrices' (this factor is {f.kind})")
            if f.variants and i == 0:
                err(("process", "factors", 0, "variants"), "factor 0 has no previous factor to depend on")
            _check_factor(f, i, err)
        if m.arch == "transformer" and m.d_model % m.n_heads:
            err(("model", "n_heads"), f"d_model ({m.d_model}) must be divisible by n_heads ({m.n_heads})")
        if self.output.run_id is not None and (not self.output.run_id or "/" in self.output.run_id):
            err(("output", "run_id"), f"not a valid folder name: {self.output.run_id!r}")


def _check_factor(f: FactorConfig, i: int, err) -> None:
    """Build the factor's process (each variant's too) here, before Ray: ragged, non-finite or
    non-stochastic matrices and parameters out of range are one line naming the factor."""
    from actlake.jobs.train.synthetic.loop import (  # actlake.jobs.train.synthetic.loop imports this module: imported when used
        _factor_ghmm,
    )

    if f.kind == "matrices" and f.matrices is None:
        return  # named by the caller
    key = ("process", "factors", i, "matrices" if f.kind == "matrices" else "kind")
    for v in f.variants or [None]:
        try:
            _factor_ghmm(f, v)
        except ConfigError as e:
            err(key, str(e))

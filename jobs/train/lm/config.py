"""Config of ``actlake train-lm`` (a small causal LM)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field

from actlake.config import CorpusConfig, resolve_corpus_files
from actlake.config_base import LocalPath, Section
from actlake.errors import ConfigError
from actlake.fs import check_folder
from actlake.train_config import TrainingLoop, TrainJob, Warmup

MAX_VOCAB = 1 << 20
"""Largest ``tokenizer.vocab_size``: the BPE trainer aborted the process (exit 134) at 10^9."""


class LMTokenizerConfig(Section):
    path: Optional[LocalPath] = None
    """Existing tokenizer folder to use (stored absolute); null: train a byte-level BPE tokenizer on the corpus."""
    vocab_size: int = Field(4096, le=MAX_VOCAB)  # at least 300 when trained: checked in LMConfig.check
    """Vocabulary of the trained tokenizer (special tokens included)."""

class LMArchConfig(Section):
    hidden_size: int = 128
    """Residual width."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    intermediate_size: int = 512
    """MLP width."""
    rotary_pct: float = 0.25
    """Fraction of each head rotated by RoPE (Pythia: 0.25)."""

class LMTrainingConfig(TrainingLoop.with_defaults(steps=1200, batch_size=16, lr=1e-3, weight_decay=0.1,
                                                  eval_every=100, checkpoint_every=200), Warmup):
    seq_len: int = Field(128, ge=8)
    """Tokens per training window."""
    eval_fraction: float = Field(0.05, gt=0, lt=0.5, allow_inf_nan=False)
    """Documents held out for evaluation (chosen by a hash of the document number)."""
    snapshots: int = 0
    """Models kept for a checkpoint sweep, log-spaced over the steps (step 0, the initial weights, and the last included): each a ``save_pretrained`` folder with the tokenizer, ``RUN/snapshots/step-STEP``, listed in ``summary.json``; name them in ``model.checkpoints`` (``configs/lm_quick_sweep.yaml``). 0: only the final model."""

class LMConfig(TrainJob.with_defaults(name="lm")):
    corpus: CorpusConfig
    tokenizer: LMTokenizerConfig
    model: LMArchConfig
    training: LMTrainingConfig

    def to_dict(self) -> dict:
        d = super().to_dict()
        if not d["training"]["snapshots"]:  # off, a run hashes, and resumes, as before the key existed
            d["training"].pop("snapshots")
        return d

    def check(self, err) -> None:
        t, m = self.training, self.model
        if m.hidden_size % m.num_heads:
            err(("model", "num_heads"), f"hidden_size ({m.hidden_size}) must be divisible by num_heads ({m.num_heads})")
        if t.snapshots == 1 or t.snapshots < 0:
            err(("training", "snapshots"), f"must be 0 (none) or at least 2 (the first and the last step), got {t.snapshots}")
        if self.tokenizer.path is None and self.tokenizer.vocab_size < 300:
            err(("tokenizer", "vocab_size"), "must be at least 300 (256 bytes + merges + specials)")

    def check_files(self) -> None:
        resolve_corpus_files(self)
        if self.tokenizer.path is not None and not Path(self.tokenizer.path).is_dir():
            raise ConfigError(f"{self.source_file}: 'tokenizer.path': no tokenizer folder at {self.tokenizer.path}")
        if self.tokenizer.path is not None:  # from_pretrained opens its files by name: no FIFO, no device
            check_folder(self.tokenizer.path, f"{self.source_file}: 'tokenizer.path'", ConfigError, recursive=True)

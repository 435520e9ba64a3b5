"""Config of ``actlake train-lm`` (a small causal LM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from actlake.config import CorpusConfig
from actlake.train_config import RunOutputConfig, TrainJob, TrainResourcesConfig, check_optimizer


@dataclass
class LMTokenizerConfig:
    path: Optional[str] = None
    """Existing tokenizer folder to use; null: train a byte-level BPE tokenizer on the corpus."""
    vocab_size: int = 4096
    """Vocabulary of the trained tokenizer (special tokens included)."""


@dataclass
class LMArchConfig:
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


@dataclass
class LMTrainingConfig:
    steps: int = 1200
    """Optimizer steps."""
    batch_size: int = 16
    """Windows per step (per worker)."""
    seq_len: int = 128
    """Tokens per training window."""
    lr: float = 1e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    warmup_steps: int = 100
    """Linear warm-up steps."""
    eval_every: int = 100
    """Steps between held-out evaluations."""
    checkpoint_every: int = 200
    """Steps between resume checkpoints (the newest two are kept)."""
    eval_fraction: float = 0.05
    """Documents held out for evaluation (chosen by a hash of the document number)."""
    seed: int = 0
    """Seeds initialisation and batches (a resumed run draws the same batches)."""


@dataclass
class LMConfig(TrainJob):
    name: str = "lm"
    """Job name; part of the default run id."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: LMTokenizerConfig = field(default_factory=LMTokenizerConfig)
    model: LMArchConfig = field(default_factory=LMArchConfig)
    training: LMTrainingConfig = field(default_factory=LMTrainingConfig)
    output: RunOutputConfig = field(default_factory=RunOutputConfig)
    resources: TrainResourcesConfig = field(default_factory=TrainResourcesConfig)
    source_file: Optional[str] = field(default=None, metadata={"internal": True})

    def check(self, err) -> None:
        t, m = self.training, self.model
        if m.hidden_size % m.num_heads:
            err(("model", "num_heads"), f"hidden_size ({m.hidden_size}) must be divisible by num_heads ({m.num_heads})")
        for key in ("steps", "batch_size", "eval_every", "checkpoint_every"):
            if getattr(t, key) < 1:
                err(("training", key), "must be at least 1")
        check_optimizer(err, "training", t)
        if t.seq_len < 8:
            err(("training", "seq_len"), f"must be at least 8, got {t.seq_len}")
        if not 0 < t.eval_fraction < 0.5:
            err(("training", "eval_fraction"), f"must be in (0, 0.5), got {t.eval_fraction}")
        if self.tokenizer.path is None and self.tokenizer.vocab_size < 300:
            err(("tokenizer", "vocab_size"), "must be at least 300 (256 bytes + merges + specials)")

    def check_files(self) -> None:
        from actlake.config import resolve_corpus_files

        resolve_corpus_files(self)

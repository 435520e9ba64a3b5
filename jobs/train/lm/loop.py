"""A small causal LM of the Pythia architecture (GPT-NeoX), trained on a Pile-format corpus.

The driver tokenizes the corpus once into a token stream (documents joined by EOS; a hash of the
document number holds some out for evaluation) saved in the run directory; Ray Train workers
draw windows from it, seeded by (seed, step, rank), so a resumed run draws the same batches.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import numpy as np

from actlake.config import parse_config, resolve_corpus_files
from actlake.corpus.readers import Reject, file_format, iter_items
from actlake.errors import ConfigError, CorpusError
from actlake.hashing import unit_hash
from actlake.jobs.train.lm.config import LMConfig
from actlake.jobs.train.loop import ModelLoop
from actlake.jobs.train.training import warmup_cosine_lr
from actlake.storage.checkpoints import log_spaced_steps

log = logging.getLogger("actlake.lm")

EOS = "<|endoftext|>"
PAD = "<|padding|>"


def iter_texts(cfg) -> "Iterator[tuple[int, str]]":  # noqa: F821
    """(document number, text) over the corpus files in order; bad records are skipped (and counted)."""

    c, n = cfg.corpus, 0
    for path in resolve_corpus_files(cfg):
        for item in iter_items(path, file_format(path, c.format), 0, 2**62, c.text_field, c.source_field, c.hf_split,
                               max_line=c.max_line_bytes):
            if isinstance(item, Reject):
                continue
            yield n, item.text
            n += 1
            if c.max_docs and n >= c.max_docs:
                return


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    """A byte-level BPE tokenizer (GPT-NeoX style, EOS doubles as BOS), saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD, unk_token=None)
    fast.save_pretrained(out)
    return fast


def held_out(doc: int, fraction: float) -> bool:
    return unit_hash(f"eval:{doc}") < fraction


def build_token_streams(cfg, out: Path) -> dict:
    """Tokenizer + train/eval token streams (uint32 .npy) under ``out``; returns their sizes."""
    from transformers import AutoTokenizer


    out.mkdir(parents=True, exist_ok=True)
    tok = None
    if cfg.tokenizer.path:  # checked before the corpus is read: documents are joined by its EOS token
        tok = AutoTokenizer.from_pretrained(cfg.tokenizer.path)
        if tok.eos_token_id is None:
            raise ConfigError(f"{cfg.source_file}: 'tokenizer.path': the tokenizer at {cfg.tokenizer.path} has no EOS "
                              "token, which train-lm puts between documents; set its eos_token or leave path empty")
    docs = list(iter_texts(cfg))
    if not docs:
        raise CorpusError("the corpus has no usable documents")
    if tok is not None:
        tok.save_pretrained(out / "tokenizer")
    else:
        tok = train_tokenizer([t for _, t in docs], cfg.tokenizer.vocab_size, out / "tokenizer")
    eos = tok.eos_token_id
    streams = {"train": [], "eval": []}
    for n, text in docs:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        streams["eval" if held_out(n, cfg.training.eval_fraction) else "train"] += [*ids, eos]
    sizes = {}
    for split, ids in streams.items():
        tmp = out / f".{split}.npy.tmp"
        with open(tmp, "wb") as f:  # renamed into place whole: a full disk leaves no truncated stream
            np.save(f, np.asarray(ids, dtype=np.uint32))
        os.replace(tmp, out / f"{split}.npy")
        sizes[split] = len(ids)
    sizes["vocab_size"] = len(tok)
    sizes["documents"] = len(docs)
    return sizes


def check_token_counts(cfg, sizes: dict) -> None:
    """Both token streams must be longer than ``training.seq_len`` (windows are drawn from them); else ConfigError."""

    t = cfg.training
    for split, fix in (("train", "a smaller training.eval_fraction"), ("eval", "a larger training.eval_fraction")):
        if sizes[split] <= t.seq_len:
            name = "training" if split == "train" else "held-out"
            raise ConfigError(f"{cfg.source_file}: 'training.seq_len': windows of {t.seq_len} tokens need more tokens "
                              f"than the {name} split has ({sizes[split]:,} tokens of {sizes['documents']:,} "
                              f"document(s), eval_fraction {t.eval_fraction}); use a shorter seq_len, more "
                              f"documents or {fix}")


def lr_at(step: int, t) -> float:
    """``warmup_cosine_lr`` with the training section's lr, warmup_steps and steps: cosine decay to 10% of the peak."""
    return warmup_cosine_lr(step, t.lr, t.warmup_steps, t.steps, 0.1)


def windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """(n, length) windows at random offsets of the stream."""
    starts = rng.integers(0, len(stream) - length, size=n)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)


def build_model(cfg, vocab_size: int, tokenizer):
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    m, t = cfg.model, cfg.training
    torch.manual_seed(t.seed)
    config = GPTNeoXConfig(vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                           num_attention_heads=m.num_heads, intermediate_size=m.intermediate_size,
                           rotary_pct=m.rotary_pct, max_position_embeddings=max(2048, t.seq_len),
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
                           hidden_dropout=0.0, attention_dropout=0.0)
    return GPTNeoXForCausalLM(config)


class LMLoop(ModelLoop):
    """train-lm's trial: ``config`` has job (LMConfig as dict) and data (the folder of the token streams)."""

    def __init__(self, config: dict):
        from transformers import AutoTokenizer

        super().__init__(config)
        self.cfg = parse_config(config["job"], where="train-lm config", root=LMConfig)
        t = self.t = self.cfg.training
        self.steps, self.eval_every, self.checkpoint_every = t.steps, t.eval_every, t.checkpoint_every
        self.keep_steps = frozenset(snapshot_steps(t))
        data = Path(config["data"])
        self.tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
        self.train, held = np.load(data / "train.npy"), np.load(data / "eval.npy")
        self.eval_x = windows(held, 32, t.seq_len, np.random.default_rng([t.seed, 10**9]))  # (32, seq_len)

    def new_model(self):
        return build_model(self.cfg, len(self.tokenizer), self.tokenizer)

    def load_model(self, folder: Path):
        from transformers import GPTNeoXForCausalLM

        return GPTNeoXForCausalLM.from_pretrained(folder)

    def begin(self, resumed: bool) -> None:
        if not resumed and 0 in self.keep_steps and self.rank == 0:  # the initial weights, for a sweep from step 0
            self.checkpoint(0)

    def adamw_options(self) -> dict:
        return {"lr": self.t.lr, "weight_decay": self.t.weight_decay, "betas": (0.9, 0.95)}

    def train_step(self, step: int) -> float:
        import torch

        t = self.t
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, t)
        x = windows(self.train, t.batch_size, t.seq_len, np.random.default_rng([t.seed, step, self.rank]))  # (B, seq_len)
        x = torch.from_numpy(x).to(self.device)
        loss = self.model(input_ids=x, labels=x).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()

    def evaluate(self, done: int, train_loss: float) -> dict:
        import torch

        self.model.eval()
        with torch.no_grad():
            x = torch.from_numpy(self.eval_x).to(self.device)
            eval_loss = self.raw(input_ids=x, labels=x).loss.item()
        self.model.train()
        return {"step": done, "train_loss": train_loss, "eval_loss": eval_loss, "lr": lr_at(done - 1, self.t)}

    def describe(self, row: dict) -> str:
        return (f"train loss {row['train_loss']:.3f}, held-out loss {row['eval_loss']:.3f} "
                f"(perplexity {math.exp(row['eval_loss']):.1f})")


def snapshot_steps(t) -> list[int]:
    """The steps whose models train-lm keeps (``training.snapshots``, log-spaced, 0 and the last included)."""
    return log_spaced_steps(t.steps, t.snapshots) if t.snapshots else []


def train_loop(config: dict) -> None:
    """Ray Train's entry point of a train-lm trial."""
    LMLoop(config).run()

"""Documents -> token windows -> length-bucketed batches under a token budget."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from actlake.config import BatchingConfig, TokenizationConfig
from actlake.errors import ConfigError

if TYPE_CHECKING:
    import torch

CHARS_PER_TOKEN_CAP = 32
"""Text beyond (tokens needed x this) is never tokenized: bounds work on huge documents."""


@dataclass
class Window:
    doc_id: int
    window: int
    ids: list[int]
    source: str


def special_affixes(tokenizer, prepend_bos: bool = False) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after one sequence ([CLS] ... [SEP], BOS ..., none);
    ``prepend_bos`` (``tokenization.prepend_bos``): its BOS token first when it puts no special token first."""
    cached = getattr(tokenizer, "_actlake_affixes", None)
    if cached is None:
        probe = "hello world"
        plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
        full = tokenizer(probe, add_special_tokens=True)["input_ids"]
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                cached = (full[:i], full[i + len(plain):])
                break
        else:  # pragma: no cover - a tokenizer that rewrites the text when adding specials
            cached = ([], [])
        tokenizer._actlake_affixes = cached
    prefix, suffix = cached
    if prepend_bos and not prefix:
        if tokenizer.bos_token_id is None:
            raise ConfigError(f"'tokenization.prepend_bos': the tokenizer of {tokenizer.name_or_path} has no BOS "
                              "token to put first (set it to false)")
        prefix = [tokenizer.bos_token_id, *prefix]
    return prefix, suffix


def document_windows(tokenizer, text: str, cfg: TokenizationConfig) -> tuple[list[list[int]], bool]:
    """Token ids of each window of one document (special tokens included), and whether the
    document was cut: longer than the windows allowed (``truncate``, ``max_windows_per_doc``)."""
    return documents_windows(tokenizer, [text], cfg)[0]


def documents_windows(tokenizer, texts: list[str], cfg: TokenizationConfig) -> list[tuple[list[list[int]], bool]]:
    """:func:`document_windows` of each text, from one tokenizer call for them all. A fast (Rust) tokenizer
    encodes a list with the interpreter lock released, where one call per document holds it for most of
    its time: beside a thread that launches the model's kernels (a GPU worker reading ahead), per-document
    calls hold it and starve that thread (``benchmarks/host_work.py``)."""
    prefix, suffix = special_affixes(tokenizer, cfg.prepend_bos)
    body = cfg.max_length - len(prefix) - len(suffix)
    step = body - cfg.stride
    n_max = 1 if cfg.overflow == "truncate" else cfg.max_windows_per_doc
    limit = (body + step * (n_max - 1)) * CHARS_PER_TOKEN_CAP
    encoded = tokenizer([t[:limit] for t in texts], add_special_tokens=False, verbose=False)["input_ids"]
    results = []
    for text, ids in zip(texts, encoded):
        out = []
        for w in range(n_max):
            chunk = ids[w * step : w * step + body]
            if len(chunk) < cfg.min_tokens or (w > 0 and w * step + cfg.stride >= len(ids)):
                break
            out.append(prefix + chunk + suffix)
        covered = (len(out) - 1) * step + body if out else 0
        results.append((out, len(text) > limit or len(ids) > covered))
    return results


def make_batches(windows: list[Window], cfg: BatchingConfig, by_source: bool = False) -> list[list[Window]]:
    """Greedy batches over windows sorted by length: padding stays small, budget never exceeded.
    ``by_source``: each batch holds one source's windows (sources in label order)."""
    if by_source:
        labels = sorted({w.source for w in windows})
        return [b for label in labels for b in make_batches([w for w in windows if w.source == label], cfg)]
    order = sorted(windows, key=lambda w: (len(w.ids), w.doc_id, w.window))
    batches: list[list[Window]] = []
    cur: list[Window] = []
    for w in order:
        if cur and ((len(cur) + 1) * len(w.ids) > cfg.max_tokens or len(cur) >= cfg.max_batch_size):
            batches.append(cur)
            cur = []
        cur.append(w)
    if cur:
        batches.append(cur)
    return batches


def collate(batch: list[Window], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) input ids and attention mask."""
    import torch  # loads torch: imported when used (a shard's reader process tokenises without it)

    ids = right_padded([w.ids for w in batch], pad_id)
    lengths = torch.tensor([len(w.ids) for w in batch])
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    return ids, mask


def right_padded(rows: list[list[int]], fill: int) -> torch.Tensor:
    """(B, T) int64 tensor of the rows, each followed by ``fill`` up to the longest row's length T. One
    conversion of all the values at once (a tensor per row costs about 20 times as much per token)."""
    import torch

    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    T = int(lengths.max(initial=0))
    out = np.full((len(rows), T), fill, dtype=np.int64)
    out[np.arange(T)[None] < lengths[:, None]] = np.fromiter(chain.from_iterable(rows), np.int64, int(lengths.sum()))
    return torch.from_numpy(out)

"""A deterministic shard plan: the same config and corpus give the same shards and ids."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from actlake.config import JobConfig, resolve_corpus_files
from actlake.corpus.readers import count_records, file_format, load_hf


@dataclass(frozen=True)
class Shard:
    shard_id: int
    path: str
    """Corpus file (or hf dataset name)."""
    fmt: str
    start: int
    """First record index within the file (inclusive)."""
    end: int
    """Last record index within the file (exclusive)."""
    doc_offset: int
    """Global doc id of record 0 of this file: doc_id = doc_offset + record index."""


def make_plan(cfg: JobConfig) -> list[Shard]:
    c = cfg.corpus
    if c.format == "hf":
        sources = [(c.hf_dataset, "hf", len(load_hf(c.hf_dataset, c.hf_split)))]
    else:
        sources = [(p, file_format(p, c.format), None) for p in resolve_corpus_files(cfg)]
    shards: list[Shard] = []
    offset = 0
    budget = c.max_docs if c.max_docs is not None else float("inf")
    for path, fmt, n in sources:
        if budget <= 0:
            break
        n = count_records(path, fmt) if n is None else n
        n_used = int(min(n, budget))
        for start in range(0, n_used, cfg.sharding.docs_per_shard):
            end = min(start + cfg.sharding.docs_per_shard, n_used)
            shards.append(Shard(len(shards), path, fmt, start, end, offset))
        offset += n
        budget -= n_used
    return shards


def plan_hash(cfg: JobConfig, shards: list[Shard]) -> str:
    payload = json.dumps({"config": cfg.content_hash(), "shards": [asdict(s) for s in shards]}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]

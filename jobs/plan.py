"""A deterministic shard plan: the same config and corpus give the same shards and ids."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from actlake.config import JobConfig, resolve_corpus_files
from actlake.corpus.readers import count_records, file_format, load_hf
from actlake.storage.layout import write_json_atomic


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


COUNT_CACHE = "_record_counts.json"
"""In ``output.dir``: records per corpus file, keyed by path, size and mtime, so that planning
reads a large file (a Pile .jsonl.zst) once, not at every run or resume."""


def cached_count(path: str, fmt: str, cache_file: Path) -> int:
    st = os.stat(path)
    try:
        cache = json.loads(cache_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cache = {}
    hit = cache.get(path)
    if hit and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns and hit["format"] == fmt:
        return hit["records"]
    n = count_records(path, fmt)
    cache[path] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "format": fmt, "records": n}
    write_json_atomic(cache_file, cache)
    return n


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
        n = cached_count(path, fmt, Path(cfg.output.dir).resolve() / COUNT_CACHE) if n is None else n
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

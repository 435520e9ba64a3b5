"""A deterministic shard plan: the same config and corpus give the same shards and ids."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from actlake.config import JobConfig, resolve_corpus_files
from actlake.corpus.fingerprint import file_fingerprint, hf_fingerprint
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
    size: Optional[int] = None
    """File size in bytes when this run planned it (None for hf datasets); not part of the plan hash."""
    mtime_ns: Optional[int] = None
    """File modification time when this run planned it; a worker refuses the shard if either moved."""


STAT_FIELDS = ("size", "mtime_ns")
"""Shard fields that describe the file at planning time, checked by workers, left out of the plan hash
(the inputs' fingerprints in run.json decide whether a resumed run's corpus is the same)."""

COUNT_CACHE = "_record_counts.json"
"""In ``output.dir``: records per corpus file, keyed by path, size, mtime and content hash (the
file's fingerprint), so that planning reads a large file (a Pile .jsonl.zst) once, not at every
run or resume, and never answers for a file whose content changed."""


def cached_count(path: str, fmt: str, fingerprint: dict, cache_file: Path) -> int:
    """Records in ``path``, from the cache when its entry matches the file's fingerprint."""
    try:
        cache = json.loads(cache_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cache = {}
    key = {k: fingerprint[k] for k in ("size", "mtime_ns", "hash")}
    hit = cache.get(path)
    if hit and hit.get("format") == fmt and all(hit.get(k) == v for k, v in key.items()):
        return hit["records"]
    n = count_records(path, fmt)
    cache[path] = {**key, "format": fmt, "records": n}
    write_json_atomic(cache_file, cache)
    return n


def plan_with_inputs(cfg: JobConfig) -> tuple[list[Shard], dict[str, dict]]:
    """The shard plan and the fingerprint of every input it counted (path or hf name -> fingerprint)."""
    c = cfg.corpus
    inputs: dict[str, dict] = {}
    if c.format == "hf":
        ds = load_hf(c.hf_dataset, c.hf_split)
        inputs[c.hf_dataset] = hf_fingerprint(ds, c.hf_dataset, c.hf_split)
        sources = [(c.hf_dataset, "hf", len(ds))]
    else:
        sources = [(p, file_format(p, c.format), None) for p in resolve_corpus_files(cfg)]
    shards: list[Shard] = []
    offset = 0
    budget = c.max_docs if c.max_docs is not None else float("inf")
    for path, fmt, n in sources:
        if budget <= 0:
            break
        stat = {}
        if n is None:
            fp = inputs[path] = file_fingerprint(path)
            n = cached_count(path, fmt, fp, Path(cfg.output.dir).resolve() / COUNT_CACHE)
            stat = {"size": fp["size"], "mtime_ns": fp["mtime_ns"]}
        n_used = int(min(n, budget))
        for start in range(0, n_used, cfg.sharding.docs_per_shard):
            end = min(start + cfg.sharding.docs_per_shard, n_used)
            shards.append(Shard(len(shards), path, fmt, start, end, offset, **stat))
        offset += n
        budget -= n_used
    return shards, inputs


def make_plan(cfg: JobConfig) -> list[Shard]:
    """The shard plan (see :func:`plan_with_inputs`)."""
    return plan_with_inputs(cfg)[0]


def plan_hash(cfg: JobConfig, shards: list[Shard]) -> str:
    """Hash of the config and the shards' ranges (not the files' stat: see STAT_FIELDS)."""
    ranges = [{k: v for k, v in asdict(s).items() if k not in STAT_FIELDS} for s in shards]
    payload = json.dumps({"config": cfg.content_hash(), "shards": ranges}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]

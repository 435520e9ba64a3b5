"""A deterministic shard plan: the same config and corpus give the same shards and ids."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Optional

from actlake.config import JobConfig, resolve_corpus_files
from actlake.corpus.fingerprint import file_exists, file_fingerprint, hf_fingerprint
from actlake.corpus.index import INDEX_DIR, index_files, load_points
from actlake.corpus.readers import HF_STREAM, MAX_LINE_BYTES, Entry, column_labels, file_format, load_hf, load_hf_stream
from actlake.fs import location, write_atomic


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
    ctime_ns: Optional[int] = None
    """A large local file's change time when this run planned it (its fingerprint's), checked like mtime."""
    entry_file: Optional[str] = None
    """jsonl inputs: the file a worker reads, the input or its seekable ``.zst`` copy (actlake/corpus/index.py)."""
    entry_offset: Optional[int] = None
    """Byte offset in ``entry_file`` where record ``entry_record`` starts (a frame start for ``.zst``)."""
    entry_record: Optional[int] = None
    """The record at ``entry_offset``: at most ``start``, equal to it when the index has an entry point there."""

    def entry(self) -> Optional[Entry]:
        """Where a worker starts reading (None: Parquet and hf inputs, which need none)."""
        return None if self.entry_file is None else Entry(self.entry_file, self.entry_offset, self.entry_record)


STAT_FIELDS = ("size", "mtime_ns", "ctime_ns", "entry_file", "entry_offset", "entry_record")
"""Shard fields that describe the file at planning time, checked by workers, and where to start
reading it, left out of the plan hash (the inputs' fingerprints in run.json decide whether a resumed
run's corpus is the same)."""

COUNT_CACHE = "_record_counts.json"
"""In ``output.dir``: records (and the entry-point index) per corpus file, keyed by path, size, mtime
and content hash (the file's fingerprint), so that planning reads a large file (a Pile .jsonl.zst)
once, not at every run or resume, and never answers for a file whose content changed."""


def _usable(hit: dict | None, fmt: str, key: dict, every: int) -> bool:
    """A cache entry answers for this file and shard size: same fingerprint, and for jsonl an index
    whose entry points fall on every shard start (its ``every`` divides the shard size), still on disk."""
    if not hit or hit.get("format") != fmt or any(hit.get(k) != v for k, v in key.items()):
        return False
    if fmt == "parquet":
        return True
    if "index" not in hit or every % hit["every"] != 0 or not file_exists(hit["index"], "corpus index"):
        return False
    return file_exists(load_points(hit["index"])["file"], "corpus index")


def cached_counts(files: list[tuple[str, str, dict]], every: int, out_dir, workers: int,
                  max_line: int = MAX_LINE_BYTES) -> dict[str, dict]:
    """Per ``(path, fmt, fingerprint)``: ``{"records": n}`` (+ ``index``, ``every`` for jsonl), from the
    cache where it matches the file's fingerprint, else by indexing the files, in parallel. ``out_dir``
    (a Path or an ObjectPath) holds the cache and the index."""

    cache_file = out_dir / COUNT_CACHE
    try:
        cache = json.loads(cache_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cache = {}
    keys = {path: {**{k: fp[k] for k in ("size", "mtime_ns", "hash")}, "max_line": max_line} for path, _, fp in files}
    todo = [(path, fmt, every, fp["hash"], max_line) for path, fmt, fp in files
            if not _usable(cache.get(path), fmt, keys[path], every)]
    if todo:
        for (path, fmt, *_), built in zip(todo, index_files(todo, str(out_dir / INDEX_DIR), workers)):
            cache[path] = {**keys[path], "format": fmt, **built}
        write_atomic(cache_file, json.dumps(cache, indent=2, sort_keys=True).encode())
    return {path: cache[path] for path, _, _ in files}


def plan_with_inputs(cfg: JobConfig) -> tuple[list[Shard], dict[str, dict]]:
    """The shard plan and the fingerprint of every input it counted (path or hf name -> fingerprint)."""
    c = cfg.corpus
    if c.format == "hf" and c.hf_streaming:
        return _plan_hf_stream(cfg)
    inputs: dict[str, dict] = {}
    every = cfg.sharding.docs_per_shard
    if c.format == "hf":
        ds = load_hf(c.hf_dataset, c.hf_split)
        inputs[c.hf_dataset] = hf_fingerprint(ds, c.hf_dataset, c.hf_split)
        sources = [(c.hf_dataset, "hf", {"records": len(ds)})]
    else:
        sources = _counted_files(cfg, inputs)
    shards: list[Shard] = []
    offset = 0
    budget = c.max_docs if c.max_docs is not None else float("inf")
    for path, fmt, counted in sources:
        n = counted["records"]
        if budget <= 0:
            break
        stat = ({"size": inputs[path]["size"], "mtime_ns": inputs[path]["mtime_ns"],
                 "ctime_ns": inputs[path].get("ctime_ns")} if fmt != "hf" else {})
        points = load_points(counted["index"]) if "index" in counted else None
        n_used = int(min(n, budget))
        for start in range(0, n_used, every):
            end = min(start + every, n_used)
            shards.append(Shard(len(shards), path, fmt, start, end, offset, **stat, **_entry(points, start)))
        offset += n
        budget -= n_used
    return shards, inputs


def _counted_files(cfg: JobConfig, inputs: dict[str, dict]) -> list[tuple[str, str, dict]]:
    """``(path, format, counted)`` of the corpus files the plan reads, fingerprinted into ``inputs``:
    all of them, indexed in parallel; with ``corpus.max_docs``, file by file until the budget is met."""
    c, every = cfg.corpus, cfg.sharding.docs_per_shard
    out_dir = location(cfg.output.dir)
    files = [(p, file_format(p, c.format)) for p in resolve_corpus_files(cfg)]
    groups = [files] if c.max_docs is None else [[f] for f in files]
    sources, seen = [], 0
    for group in groups:
        if c.max_docs is not None and seen >= c.max_docs:
            break
        inputs.update({p: file_fingerprint(p) for p, _ in group})
        counts = cached_counts([(p, fmt, inputs[p]) for p, fmt in group], every, out_dir, cfg.sharding.plan_workers,
                               cfg.corpus.max_line_bytes)
        sources += [(p, fmt, counts[p]) for p, fmt in group]
        seen += sum(counts[p]["records"] for p, _ in group)
    return sources


def _entry(points: dict | None, start: int) -> dict:
    """Shard fields of the last entry point at or before record ``start`` (none without an index)."""
    if points is None:
        return {}
    i = start // points["every"]
    return {"entry_file": points["file"], "entry_offset": points["points"][i], "entry_record": i * points["every"]}


HF_STREAM_STRIDE = 1 << 32
"""doc_id of row r of dataset shard i of a streamed dataset: i * HF_STREAM_STRIDE + r (rows are not
counted at planning, so ids are unique and ordered, not consecutive)."""


def _plan_hf_stream(cfg: JobConfig) -> tuple[list[Shard], dict[str, dict]]:
    """One shard per dataset shard (file) of a streamed dataset: nothing is downloaded or counted."""
    c = cfg.corpus
    ds = load_hf_stream(c.hf_dataset, c.hf_split)
    config = getattr(getattr(ds, "info", None), "config_name", None)
    inputs = {c.hf_dataset: {"rows": None, "hash_kind": "name", "hash": f"{c.hf_dataset}|{c.hf_split}|{config}|{ds.n_shards}"}}
    shards = [Shard(i, c.hf_dataset, HF_STREAM, i, i + 1, i * HF_STREAM_STRIDE) for i in range(ds.n_shards)]
    return shards, inputs


def make_plan(cfg: JobConfig) -> list[Shard]:
    """The shard plan (see :func:`plan_with_inputs`)."""
    return plan_with_inputs(cfg)[0]


def plan_hash(cfg: JobConfig, shards: list[Shard]) -> str:
    """Hash of the config and the shards' ranges (not the files' stat: see STAT_FIELDS)."""
    ranges = [{k: v for k, v in asdict(s).items() if k not in STAT_FIELDS} for s in shards]
    payload = json.dumps({"config": cfg.content_hash(), "shards": ranges}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def planned_labels(cfg: JobConfig, shards: list[Shard]) -> set[str]:
    """The source labels of the planned records that can be listed before Ray starts: Parquet files' and a
    Hugging Face dataset's source column (:func:`~actlake.corpus.readers.column_labels`); jsonl records'
    labels are known once a worker parses them, and it checks them (``analyses.max_sources``)."""
    spans: dict[tuple[str, str], list[int]] = {}
    for s in shards:
        if s.fmt in ("parquet", "hf"):
            lo, hi = spans.get((s.path, s.fmt), [s.start, s.end])
            spans[(s.path, s.fmt)] = [min(lo, s.start), max(hi, s.end)]
    labels: set[str] = set()
    for (path, fmt), (start, end) in spans.items():
        labels |= column_labels(path, fmt, cfg.corpus.source_field, start, end, cfg.corpus.hf_split) or set()
    return labels

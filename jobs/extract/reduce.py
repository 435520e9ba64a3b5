"""The reduce step: verify every shard, merge the groups' partial statistics, publish aggregate tables."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from actlake.analysis.by_source import BySource
from actlake.analysis.registry import failure
from actlake.errors import ConfigError, StorageError
from actlake.fs import read_regular
from actlake.storage.layout import RunLayout
from actlake.storage.manifest import REDUCE_RECORD, aggregate_path, write_reduce_record
from actlake.storage.parquet_io import read_parquet, verify_parquet, write_parquet_atomic
from actlake.storage.shards import Committed, committed


def collect(layout: RunLayout, shard_ids: list[int], plan_hash: str, done: Committed | None = None) -> Committed:
    """The accepted commit records of the plan (``done``: as the caller has just read them); StorageError naming the
    shards no record covers."""
    done = committed(layout, plan_hash) if done is None else done
    missing = [sid for sid in shard_ids if sid not in done.shards]
    if missing:
        shown = ", ".join(f"{s:05d}" for s in missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise StorageError(f"{layout.root}: {len(missing)} shard(s) incomplete, nothing published: {shown}")
    return done


def verify(layout: RunLayout, done: Committed) -> None:
    """Read every committed file whole (magic, size, rows, page checksums)."""
    for rec in done.groups:
        metas = list(rec["partials"].values()) + [m for e in rec["shards"].values() for m in e["files"].values()]
        for meta in metas:
            verify_parquet(layout.root / meta["path"], rows=meta["rows"], size=meta["bytes"])


def merge_partials(layout: RunLayout, groups: list[dict], cls, max_sources: int | None = None) -> BySource:
    """Merge one statistics class over the given groups, in the given order (any order gives the same
    result), by source label (:mod:`~actlake.analysis.by_source`)."""
    total = None
    for rec in groups:
        tables = {t: read_parquet(layout.root / rec["partials"][t]["path"]) for t in cls.tables}
        stats = BySource.from_tables(cls, tables)
        stats.max_sources = max_sources
        total = stats if total is None else total.merge(stats)
    return total


def model_dtype(layout: RunLayout, summaries: list[dict]) -> str | None:
    """The model dtype every shard ran in (None without shards). StorageError when
    shards differ: ``model.dtype: auto`` resolved differently on different machines (GPU or not), and
    merging them would mix two precisions."""
    dtypes = sorted({s["dtype"] for s in summaries})
    if len(dtypes) > 1:
        raise StorageError(f"{layout.root}: shards ran the model in different dtypes ({', '.join(dtypes)}), e.g. "
                           f"model.dtype: auto on GPU and CPU workers; set model.dtype and rerun under a new run id")
    return dtypes[0] if dtypes else None


def previous_aggregates(layout: RunLayout) -> set:
    """The files the last reduce record names (unique names in an object store, replaced by a new reduce)."""
    try:
        files = json.loads(read_regular(layout.complete / REDUCE_RECORD))["files"]
        return {aggregate_path(layout, "reduce record", t, m["path"]) for t, m in files.items()}
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError, StorageError):
        return set()  # nothing, or nothing we wrote: leave it


COUNTS = ("docs", "windows", "tokens", "padded_tokens", "batches", "oom_splits", "cut_docs")
"""The counts a shard's summary holds and a job's totals add up."""


def add_counts(rows: list[dict], keys: tuple[str, ...] = COUNTS) -> dict:
    """``keys`` and the rejects by reason summed over ``rows`` (shard summaries, or the totals of a sweep's
    jobs), with the padded fraction."""
    out: dict = {k: 0 for k in keys} | {"rejects": {}}
    for r in rows:
        for k in keys:
            out[k] += r.get(k) or 0
        for reason, n in r.get("rejects", {}).items():
            out["rejects"][reason] = out["rejects"].get(reason, 0) + n
    out["padded_fraction"] = out["padded_tokens"] / max(1, out["tokens"])
    return out


def totals_of(summaries: list[dict]) -> dict:
    """The job's totals over the shards' summaries."""
    return {"shards": len(summaries)} | add_counts(summaries)


def reduce_run(layout: RunLayout, shard_ids: list[int], plan_hash: str, analyses, verify_files: bool = True,
               max_sources: int | None = None, done: Committed | None = None) -> dict:
    """Verify every shard, merge the partials of each analysis in ``analyses`` (the classes of the job's
    enabled analyses), publish the reduced tables (by source label, with the rows over every document);
    return the job's totals. ``done``: the commit records as the job last read them (None: read here)."""
    done = collect(layout, shard_ids, plan_hash, done)
    planned = set(shard_ids)
    groups = [g for g in done.groups if all(int(s) in planned for s in g["shards"])]
    if verify_files:
        verify(layout, done)
    summaries = [done.shards[sid]["summary"] for sid in shard_ids]
    dtype = model_dtype(layout, summaries)  # before anything is published
    layers = next((s["attention_layers"] for s in summaries if "attention_layers" in s), None)  # a hybrid's
    published = {}
    for cls in analyses:
        having = [g for g in groups if cls.tables[0] in g["partials"]]
        if having:
            try:
                merged = merge_partials(layout, having, cls, max_sources).to_tables(with_total=True)
            except ConfigError:
                raise
            except Exception as e:
                raise (failure(e, [cls]) or e) from None
            for table, data in merged.items():
                if layers is not None and "attention" in cls.sites and "layer" in data.column_names:
                    data = data.filter(pc.is_in(data["layer"], pa.array(layers, data["layer"].type)))
                path = layout.aggregate_file(table, unique=True)
                published[table] = (path, write_parquet_atomic(data, path, layout.staging))
    replaced = previous_aggregates(layout)
    views = {name: (cls.tables[0], sql) for cls in analyses for name, sql in cls.views.items() if cls.tables[0] in published}
    write_reduce_record(layout, plan_hash, published, views)  # readers see the aggregates this record names, no others
    for path in replaced - {p for p, _ in published.values()}:
        if layout.remote:  # an object store's aggregates of an earlier reduce (a disk overwrote them)
            path.unlink(missing_ok=True)
    totals = totals_of(summaries)
    totals["dtype"] = dtype
    if layers is not None:
        totals["attention_layers"] = layers
    totals["groups"] = len(groups)
    return totals

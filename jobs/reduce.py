"""The reduce step: verify every shard, merge per-shard statistics, publish aggregate tables."""

from __future__ import annotations

import pyarrow.parquet as pq

from actlake.errors import StorageError
from actlake.storage.layout import RunLayout
from actlake.storage.manifest import write_reduce_record
from actlake.storage.parquet_io import verify_parquet, write_parquet_atomic
from actlake.storage.shards import read_record



def collect_records(layout: RunLayout, shard_ids: list[int], plan_hash: str) -> list[dict]:
    records, missing = [], []
    for sid in shard_ids:
        rec = read_record(layout, sid, plan_hash)
        (records.append(rec) if rec else missing.append(sid))
    if missing:
        shown = ", ".join(f"{s:05d}" for s in missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise StorageError(f"{layout.root}: {len(missing)} shard(s) incomplete, nothing published: {shown}")
    return records


def verify_records(layout: RunLayout, records: list[dict]) -> None:
    for rec in records:
        for meta in rec["files"].values():
            verify_parquet(layout.root / meta["path"], rows=meta["rows"], size=meta["bytes"])


def merge_partials(layout: RunLayout, records: list[dict], cls):
    """Merge one statistics class over the given shards, in the given order (any order gives the same result)."""
    total = None
    for r in records:
        tables = {t: pq.read_table(layout.root / r["files"][f"{t}_by_shard"]["path"]) for t in cls.tables}
        stats = cls.from_tables(tables)
        total = stats if total is None else total.merge(stats)
    return total


def model_dtype(layout: RunLayout, records: list[dict]) -> str | None:
    """The model dtype every shard ran in (None for shards from before it was recorded). StorageError when
    shards differ: ``model.dtype: auto`` resolved differently on different machines (GPU or not), and
    merging them would mix two precisions."""
    dtypes = sorted({r["summary"]["dtype"] for r in records if "dtype" in r["summary"]})
    if len(dtypes) > 1:
        raise StorageError(f"{layout.root}: shards ran the model in different dtypes ({', '.join(dtypes)}), e.g. "
                           f"model.dtype: auto on GPU and CPU workers; set model.dtype and rerun under a new run id")
    return dtypes[0] if dtypes else None


def reduce_run(layout: RunLayout, shard_ids: list[int], plan_hash: str, analyses, verify: bool = True) -> dict:
    """Verify every shard, merge the partials of each analysis in ``analyses`` (the classes of the job's
    enabled analyses), publish the reduced tables; return the job's totals."""
    records = collect_records(layout, shard_ids, plan_hash)
    if verify:
        verify_records(layout, records)
    dtype = model_dtype(layout, records)  # before anything is published
    published = {}
    for cls in analyses:
        having = [r for r in records if f"{cls.tables[0]}_by_shard" in r["files"]]
        if having:
            for table, data in merge_partials(layout, having, cls).to_tables().items():
                write_parquet_atomic(data, layout.aggregate_file(table), layout.staging)
                published[table] = layout.aggregate_file(table)
    write_reduce_record(layout, plan_hash, published)  # readers see the aggregates this record names, no others
    totals: dict = {"shards": len(records), "docs": 0, "windows": 0, "tokens": 0, "padded_tokens": 0, "oom_splits": 0, "cut_docs": 0,
                    "rejects": {}}
    for r in records:
        s = r["summary"]
        for k in ("docs", "windows", "tokens", "padded_tokens", "oom_splits", "cut_docs"):
            totals[k] += s.get(k, 0)
        for reason, n in s["rejects"].items():
            totals["rejects"][reason] = totals["rejects"].get(reason, 0) + n
    totals["padded_fraction"] = totals["padded_tokens"] / max(1, totals["tokens"])
    totals["dtype"] = dtype
    return totals

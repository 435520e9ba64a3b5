"""The reduce step: verify every shard, merge per-shard statistics, publish aggregate tables."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from actlake.analysis.attention_mass import AttentionMass
from actlake.analysis.dim_moments import DimMoments
from actlake.errors import StorageError
from actlake.storage.layout import RunLayout
from actlake.storage.parquet_io import verify_parquet, write_parquet_atomic
from actlake.storage.shards import read_record

MERGEABLE = {"dim_moments": DimMoments, "attention_mass": AttentionMass}
"""Aggregate table -> statistics class; partials live in ``<table>_by_shard``."""


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


def merge_partials(paths: list[Path], cls):
    """Merge per-shard statistics in the given order (any order gives the same result)."""
    total = None
    for p in paths:
        stats = cls.from_arrow(pq.read_table(p))
        total = stats if total is None else total.merge(stats)
    return total


def reduce_run(layout: RunLayout, shard_ids: list[int], plan_hash: str, verify: bool = True) -> dict:
    records = collect_records(layout, shard_ids, plan_hash)
    if verify:
        verify_records(layout, records)
    for table, cls in MERGEABLE.items():
        paths = [layout.root / r["files"][f"{table}_by_shard"]["path"] for r in records if f"{table}_by_shard" in r["files"]]
        if paths:
            merged = merge_partials(paths, cls)
            write_parquet_atomic(merged.to_arrow(), layout.aggregate_file(table), layout.staging)
    totals: dict = {"shards": len(records), "docs": 0, "windows": 0, "tokens": 0, "padded_tokens": 0, "rejects": {}}
    for r in records:
        s = r["summary"]
        for k in ("docs", "windows", "tokens", "padded_tokens"):
            totals[k] += s[k]
        for reason, n in s["rejects"].items():
            totals["rejects"][reason] = totals["rejects"].get(reason, 0) + n
    totals["padded_fraction"] = totals["padded_tokens"] / max(1, totals["tokens"])
    return totals

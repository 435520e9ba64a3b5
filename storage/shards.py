"""Exactly-once shard commits.

A shard's tables are written under ``_staging/``, renamed into their tables
(one deterministic file name per shard and table, so a retry overwrites rather
than duplicates), and only then is the completion record written. A shard
without a valid record is incomplete and runs again.
"""

from __future__ import annotations

import json
import shutil
import uuid

import pyarrow as pa

from actlake.storage.layout import RunLayout, write_json_atomic
from actlake.storage.parquet_io import write_parquet
import os


class ShardWriter:
    def __init__(self, layout: RunLayout, shard_id: int, plan_hash: str):
        self.layout = layout
        self.shard_id = shard_id
        self.plan_hash = plan_hash
        self.dir = layout.staging / f"{shard_id:05d}-{uuid.uuid4().hex[:8]}"
        self.files: dict[str, dict] = {}

    def write(self, table: str, data: pa.Table) -> None:
        path = self.dir / f"{table}.parquet"
        write_parquet(data, path)
        self.files[table] = {"rows": data.num_rows, "bytes": path.stat().st_size}

    def commit(self, summary: dict) -> dict:
        """Rename every staged file into its table, then record completion."""
        for table, meta in self.files.items():
            dest = self.layout.shard_file(table, self.shard_id)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.dir / f"{table}.parquet", dest)
            meta["path"] = str(dest.relative_to(self.layout.root))
        record = {"shard_id": self.shard_id, "plan_hash": self.plan_hash, "files": self.files, "summary": summary}
        write_json_atomic(self.layout.completion_record(self.shard_id), record)
        shutil.rmtree(self.dir, ignore_errors=True)
        return record

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def read_record(layout: RunLayout, shard_id: int, plan_hash: str) -> dict | None:
    """The shard's completion record if it is valid for this plan and its files exist, else None."""
    path = layout.completion_record(shard_id)
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if record.get("plan_hash") != plan_hash:
        return None
    for meta in record["files"].values():
        p = layout.root / meta["path"]
        if not p.is_file() or p.stat().st_size != meta["bytes"]:
            return None
    return record

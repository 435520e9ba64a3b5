"""Where everything of a run lives on disk.

::

    RUN_DIR/
      run.json                      config, plan hash, shard list
      tables/<table>/shard=NNNNN/part-NNNNN.parquet   per-shard rows and partial statistics
      tables/<table>/part-0.parquet                    reduced (aggregate) tables
      _staging/                     shard outputs being written (outside every table's glob)
      _complete/shard-NNNNN.json    completion record: files, row counts, sizes
      _complete/reduced.json        reduce record: the aggregate files published for this plan
      summary.json                  totals of the last job
      report/report.html, *.png

A reader globbing ``tables/<table>/**/*.parquet`` only ever sees whole files, but possibly files
no completion record names (an earlier plan's shards, strays); actlake's own readers use
:func:`actlake.storage.manifest.committed_files` instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @property
    def tables(self) -> Path:
        return self.root / "tables"

    @property
    def staging(self) -> Path:
        return self.root / "_staging"

    @property
    def complete(self) -> Path:
        return self.root / "_complete"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def summary_json(self) -> Path:
        return self.root / "summary.json"

    def shard_file(self, table: str, shard_id: int) -> Path:
        return self.tables / table / f"shard={shard_id:05d}" / f"part-{shard_id:05d}.parquet"

    def aggregate_file(self, table: str) -> Path:
        return self.tables / table / "part-0.parquet"

    def completion_record(self, shard_id: int) -> Path:
        return self.complete / f"shard-{shard_id:05d}.json"

    def table_names(self) -> list[str]:
        """Folders under ``tables/`` (committed or not; SQL views use the manifest instead)."""
        if not self.tables.is_dir():
            return []
        return sorted(p.name for p in self.tables.iterdir() if p.is_dir())


def write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)

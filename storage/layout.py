"""Where everything of a run lives, on a disk or in an object store (``actlake.fs``).

::

    RUN_DIR/
      run.json                      run format, config, plan hash, shard list, inputs, identity
      tables/<table>/shard=NNNNN/part-NNNNN[-UNIQUE].parquet   per-shard rows
      tables/<table>_partial/group=GROUP/part-0.parquet        a worker's merged partial statistics
      tables/<table>/part-0[-UNIQUE].parquet                   reduced (aggregate) tables
      _staging/                     files being written on a disk (outside every table's glob)
      _complete/group-GROUP.json    commit record: the shards of one group, their files and the partials
      _complete/reduced.json        reduce record: the aggregate files published for this plan
      summary.json                  totals of the last job
      report/report.html, *.png

On a disk a file is written under ``_staging/`` and renamed into its table, so a reader globbing
``tables/<table>/**/*.parquet`` only ever sees whole files; an object store has no rename, and an
object appears whole when its upload completes, so files go straight to a unique name there
(``-UNIQUE``). Either way a file counts only once a record names it: actlake's readers use
:func:`actlake.storage.manifest.committed_files`, never a glob.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from actlake.errors import StorageError
from actlake.fs import ObjectPath, read_regular, write_atomic
from actlake.tables import PARTIAL_SUFFIX


@dataclass(frozen=True)
class RunLayout:
    root: "Path | ObjectPath"

    tables = property(lambda self: self.root / "tables")
    staging = property(lambda self: self.root / "_staging")
    complete = property(lambda self: self.root / "_complete")
    report = property(lambda self: self.root / "report")
    run_json = property(lambda self: self.root / "run.json")
    summary_json = property(lambda self: self.root / "summary.json")

    @property
    def remote(self) -> bool:
        """In an object store: files go to unique names (no rename), see the module docstring."""
        return isinstance(self.root, ObjectPath)

    def _unique(self, stem: str) -> str:
        return f"{stem}-{uuid.uuid4().hex[:12]}.parquet" if self.remote else f"{stem}.parquet"

    def shard_file(self, table: str, shard_id: int, unique: bool = False) -> "Path | ObjectPath":
        """Where a shard's ``table`` goes: one fixed name on a disk; with ``unique`` in an object store, a fresh one."""
        stem = f"part-{shard_id:05d}"
        return self.tables / table / f"shard={shard_id:05d}" / (self._unique(stem) if unique else f"{stem}.parquet")

    def partial_file(self, table: str, group: str) -> "Path | ObjectPath":
        """A group's merged partial of analysis table ``table`` (``<table>_partial``); a group id is unique."""
        return self.tables / f"{table}{PARTIAL_SUFFIX}" / f"group={group}" / "part-0.parquet"

    def aggregate_file(self, table: str, unique: bool = False) -> "Path | ObjectPath":
        return self.tables / table / (self._unique("part-0") if unique else "part-0.parquet")

    def group_record(self, group: str) -> "Path | ObjectPath":
        return self.complete / f"group-{group}.json"

    def relative(self, path) -> str:
        """``path`` relative to the run folder, as records store it."""
        return str(path.relative_to(self.root))


SWEEP_RECORD = "sweep.json"
"""In a checkpoint sweep's folder (``model.checkpoints``): its checkpoints in order, written once every
checkpoint's run is complete (:mod:`~actlake.jobs.extract.sweep`)."""
CHECKPOINTS_DIR = "checkpoints"
"""In a sweep's folder: a run folder per checkpoint, named by its label."""


def sweep_checkpoints(root) -> list[dict] | None:
    """The checkpoint rows of a sweep folder's record (``root``: a Path or ObjectPath); None for a run."""
    try:
        return json.loads(read_regular(root / SWEEP_RECORD))["checkpoints"]  # a FIFO there: refused, never read
    except FileNotFoundError:
        return None


RUN_FORMAT = 2
"""The layout of the run folders this actlake writes and reads (``run.json``'s ``format``). 2: commit groups,
recorded views, a ``source`` column on every reduced table, training runs' publication record, the run's
identity. A run folder of another format is refused by name: run the job again under a new run id."""


def write_run_json(layout: RunLayout, record: dict) -> None:
    """The run's ``run.json``: ``record`` and the :data:`RUN_FORMAT` it is written in."""
    write_json_atomic(layout.run_json, {"format": RUN_FORMAT, **record})


def check_run_format(run: dict, where) -> None:
    """StorageError naming ``where`` (a run.json) unless ``run`` is of this actlake's :data:`RUN_FORMAT`."""
    got = run.get("format", 1)
    if got != RUN_FORMAT or isinstance(got, bool):
        who = ("an older" if got < RUN_FORMAT else "a newer") if isinstance(got, int) and not isinstance(got, bool) \
            else "no known"
        raise StorageError(f"{where}: run format {got!r} (written by {who} actlake); this actlake reads format "
                           f"{RUN_FORMAT}: run the job again under a new run id, or delete the folder")


def write_json_atomic(path, obj) -> None:
    """Write ``obj`` as JSON: whole or not at all (temporary name and rename; one PUT in an object store)."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True).encode())

"""Which files of a run are committed: the only files readers (SQL views, reports) may see.

A run's ``tables/`` folder can hold more than its results: files of an earlier plan of the same
run id, a shard that died before its completion record, files someone copied in. Readers use
this manifest instead of globbing:

- extraction runs (``run.json`` with a plan hash and a shard list): per-shard tables and the groups'
  partial statistics are the files named by the accepted commit records of this plan
  (``_complete/group-GROUP.json``, see :func:`actlake.storage.shards.committed`); reduced tables are
  the files named by the reduce record (``_complete/reduced.json``, same plan hash), written by the
  reduce step after it publishes them;
- training runs (``run.json`` kind ``predictor``, ``synthetic``, ``train-lm``): their jobs write no
  completion records; their tables are the files their publication record names
  (``_complete/published.json``, :mod:`actlake.storage.publish`: ``tables/<table>/[<key>=<value>/]part-0-*.parquet``,
  the partition key in the folder's name, as DuckDB's hive reader reads it).

Only tables a record names are listed: per-shard tables (built in or custom, as the commit records' shard
entries name them), the analyses' partials (``<table>_partial``, one file per commit group) and reduced tables
as the records name them, and a training run's tables as its publication record names them. The manifest knows no
table by name (in storage only the activation store's reader, :mod:`actlake.storage.activations`, names one:
``activations``); a name must be a plain identifier (:func:`is_table_name`). Other folders under ``tables/`` are
ignored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from actlake.errors import StorageError
from actlake.fs import read_regular
from actlake.storage.layout import RunLayout, check_run_format, write_json_atomic
from actlake.storage.publish import published
from actlake.storage.shards import committed
from actlake.tables import PARTIAL_SUFFIX, is_table_name


TRAINING_KINDS = ("predictor", "synthetic", "train-lm")
"""``run.json`` kinds of the training jobs (``jobs/train/``): their tables are what their publication record names
(:func:`actlake.storage.publish.published`)."""


def extraction_kind(table: str) -> str | None:
    """How an extraction run (``actlake run``) commits ``table`` when a record names it: ``partial`` (an analysis's
    partial statistics, one file per commit group) or ``reduced`` (an analysis's merged table, by the reduce
    record); a shard's own tables are those its commit record's shard entries name. None for a name actlake never
    gives."""
    if not is_table_name(table):
        return None
    return "partial" if table.endswith(PARTIAL_SUFFIX) else "reduced"


REDUCE_RECORD = "reduced.json"
"""The reduce step's record under ``_complete/``: plan hash and the aggregate files it published."""


def read_run(layout: RunLayout) -> dict:
    """The run's ``run.json``; a StorageError naming it when missing or unreadable."""
    try:
        run = json.loads(read_regular(layout.run_json))  # a FIFO or a device there: refused by name, never read
    except (FileNotFoundError, NotADirectoryError):
        raise StorageError(f"{layout.run_json}: missing (is {layout.root} a run directory?)") from None
    except (OSError, ValueError) as e:
        raise StorageError(f"{layout.run_json}: unreadable ({e})") from None
    if not isinstance(run, dict) or ("shards" in run and not (
            isinstance(run["shards"], list) and all(isinstance(s, dict) and "shard_id" in s for s in run["shards"]))):
        raise StorageError(f"{layout.run_json}: not a run record (a mapping whose shards each have a shard_id)")
    check_run_format(run, layout.run_json)
    return run


def is_training(run: dict, run_json: Path) -> bool:
    """True for a training run, False for an extraction run; a StorageError for a run.json that is neither."""
    kind = run.get("kind")
    if kind in TRAINING_KINDS:
        return True
    if kind is None and "plan_hash" in run and "shards" in run:
        return False  # extraction: tables as the records name them
    raise StorageError(f"{run_json}: unknown run kind {kind!r} (no plan hash and shard list either)")


def write_reduce_record(layout: RunLayout, plan_hash: str, files: dict[str, tuple],
                        views: dict[str, tuple[str, str]] | None = None) -> None:
    """Record the aggregate files the reduce step has just published (after they are in place):
    ``files``: table -> (path, bytes); and the SQL views the job's analyses declare over them
    (``views``: name -> (source table, SELECT)), so readers create them without importing any analysis."""
    entries = {t: {"path": layout.relative(p), "bytes": size} for t, (p, size) in files.items()}
    write_json_atomic(layout.complete / REDUCE_RECORD, {
        "plan_hash": plan_hash, "files": entries,
        "views": {name: {"source": source, "sql": sql} for name, (source, sql) in sorted((views or {}).items())}})


def reduce_record(layout: RunLayout, plan_hash) -> dict | None:
    """The reduce record when it is one of plan ``plan_hash`` (None: none, or another plan's)."""
    path = layout.complete / REDUCE_RECORD
    try:
        record = json.loads(read_regular(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StorageError(f"{path}: unreadable ({e})") from None
    return record if isinstance(record, dict) and record.get("plan_hash") == plan_hash else None


def recorded_views(layout: RunLayout) -> dict[str, tuple[str, str]]:
    """The views the reduce record of the run's plan names (name -> (source table, SELECT)); {} for a training
    run or an extraction without a reduce record."""
    run = read_run(layout)
    if is_training(run, layout.run_json):
        return {}
    path = layout.complete / REDUCE_RECORD
    record = reduce_record(layout, run.get("plan_hash"))
    if record is None:
        return {}
    try:
        return {str(name): (str(v["source"]), str(v["sql"])) for name, v in record.get("views", {}).items()}
    except (AttributeError, KeyError, TypeError):
        raise StorageError(f"{path}: its views are not name -> {{source, sql}}") from None


_AGGREGATE = re.compile(r"part-0(-[0-9a-f]{12})?\.parquet")


def reduced_tables(layout: RunLayout) -> set[str]:
    """The tables the reduce record of the run's plan names (none for a training run or without a record)."""
    run = read_run(layout)
    record = None if is_training(run, layout.run_json) else reduce_record(layout, run.get("plan_hash"))
    return set((record or {}).get("files") or {})


def aggregate_path(layout: RunLayout, source, table: str, path: str):
    """A recorded aggregate file path, which must be one actlake writes for that table."""
    parts = path.split("/")
    if len(parts) != 3 or not is_table_name(table) or parts[:2] != ["tables", table] or not _AGGREGATE.fullmatch(parts[2]):
        raise StorageError(f"{source}: names {path} for table {table}, not a file of that table")
    return layout.root / path


def _reduced_files(layout: RunLayout, plan_hash: str, shard_tables: set[str]) -> dict[str, list[Path]]:
    """Aggregate files named by a reduce record of this plan whose files are present and whole (never one of a
    table the shards write: ``shard_tables``)."""
    path = layout.complete / REDUCE_RECORD
    record = reduce_record(layout, plan_hash)
    if record is None:
        return {}
    if not isinstance(record.get("files"), dict) or not all(
            isinstance(m, dict) and isinstance(m.get("path"), str) and isinstance(m.get("bytes"), int)
            for m in record["files"].values()):
        raise StorageError(f"{path}: its files are not table -> {{path, bytes}}")
    out = {}
    for table, meta in record["files"].items():
        if extraction_kind(table) != "reduced" or table in shard_tables:
            continue
        p = aggregate_path(layout, path, table, meta["path"])
        try:
            if p.stat().st_size == meta["bytes"]:
                out[table] = [p]
        except FileNotFoundError:
            pass
    return out


def _extraction_files(layout: RunLayout, run: dict) -> dict[str, list[Path]]:
    """Files named by the accepted commit records of the run's plan (their paths are checked there),
    and by its reduce record."""
    planned = {int(s["shard_id"]) for s in run["shards"]}
    done = committed(layout, run["plan_hash"])
    files: dict[str, list[Path]] = {}

    for rec in done.groups:
        if not all(int(sid) in planned for sid in rec["shards"]):
            continue
        for table, meta in rec["partials"].items():
            if extraction_kind(f"{table}{PARTIAL_SUFFIX}") == "partial":
                files.setdefault(f"{table}{PARTIAL_SUFFIX}", []).append(layout.root / meta["path"])
        for entry in rec["shards"].values():  # a shard's own tables: the built-in ones and custom ShardTables
            for table, meta in entry["files"].items():
                if is_table_name(table) and not table.endswith(PARTIAL_SUFFIX):
                    files.setdefault(table, []).append(layout.root / meta["path"])
    shard_tables = {t for rec in done.groups for entry in rec["shards"].values() for t in entry["files"]}
    files.update(_reduced_files(layout, run["plan_hash"], shard_tables))
    return files


def committed_files(layout: RunLayout) -> dict[str, list[Path]]:
    """Table name -> the committed Parquet files of that table (tables without any are left out).

    Every file lies inside the run: a symbolic link on its way below the run folder (a linked
    ``tables/``, a record naming a link to a file elsewhere) is a StorageError naming it."""

    run = read_run(layout)
    training = is_training(run, layout.run_json)
    record = published(layout) if training else None
    if not training:
        files = _extraction_files(layout, run)
    else:  # a training run: what its publication record names (nothing before its first publication)
        files = {name: [layout.root / p for p in paths] for name, paths in (record or {}).items()}
    out = {t: sorted(fs) for t, fs in sorted(files.items()) if fs}
    for fs in out.values():
        for f in fs:
            inside_the_run(layout, f)
            if record is not None and not f.is_file():
                raise StorageError(f"{f}: named by {layout.complete}/published.json but missing")
    return out


def inside_the_run(layout: RunLayout, path) -> None:
    """StorageError unless ``path`` lies under the run folder with no symbolic link on the way (object
    stores have none)."""
    if not isinstance(path, Path):
        return
    root = Path(layout.root)
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        raise StorageError(f"{path}: not inside the run {root}") from None
    here = root
    for part in parts:
        here = here / part
        if part == ".." or here.is_symlink():
            raise StorageError(f"{here}: a link (or '..') inside the run {root}; actlake serves only the run's own "
                               "files, so remove it or run the job again")

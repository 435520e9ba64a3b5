"""What a training run publishes: its tables all at once, through one record.

A training job (``train-predictor``, ``train-synthetic``, ``train-lm``) writes a table's files under
new, unique names (``tables/<table>/[<key>=<value>/]part-0-UNIQUE.parquet``), then replaces the run's
publication record ``_complete/published.json`` in one rename: readers
(:func:`actlake.storage.manifest.committed_files`) serve exactly the files the record names, so a
job that dies midway (a full disk) publishes nothing of its attempt, and a rerun that turns a
table off (``probes.enabled: false``) removes it from the run. Files the new record no longer
names are deleted after it is in place. Trials that publish at the same time (their learning
curves) take turns on an advisory lock, so no update is lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from actlake.errors import StorageError
from actlake.fs import read_regular
from actlake.storage.layout import RunLayout, write_json_atomic
from actlake.tables import is_table_name

RECORD = "published.json"
"""Under ``_complete/``: ``{"files": {table: [path relative to the run, ...]}}``."""

_FILE = re.compile(r"part-0(-[0-9a-f]{32})?\.parquet")
_PARTITION = re.compile(r"[a-z_]+=[A-Za-z0-9_.+-]+")


def record_path(layout: RunLayout) -> Path:
    return Path(layout.complete) / RECORD


def published(layout: RunLayout) -> dict[str, list[str]] | None:
    """Table -> files (relative to the run) the record names, each checked to be one of that table's; None
    when the run has no record (nothing published yet)."""
    path = record_path(layout)
    try:
        record = json.loads(read_regular(path))  # a FIFO or a device: refused by name, never read
        files = record["files"]
        assert isinstance(files, dict)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise StorageError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    for table, paths in files.items():
        if not is_table_name(table):
            raise StorageError(f"{path}: names a table {table!r}, not a table name actlake gives")
        for rel in paths:
            parts = str(rel).split("/")
            if not (parts[:2] == ["tables", table] and len(parts) in (3, 4) and _FILE.fullmatch(parts[-1])
                    and (len(parts) == 3 or _PARTITION.fullmatch(parts[2]))):
                raise StorageError(f"{path}: names {rel} for table {table}, not a file of that table")
    return files


@contextlib.contextmanager
def _turn(layout: RunLayout):
    import fcntl  # POSIX only: imported when used

    Path(layout.complete).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(layout.complete) / ".published.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def publish(layout: RunLayout, files: dict[tuple[str, str | None], Path], drop: tuple[str, ...] = ()) -> None:
    """Publish ``files`` (``(table, partition or None) -> a written Parquet file``, moved into the run) and
    remove the tables in ``drop``, in one replacement of the record. Other tables and partitions keep
    their files."""
    with _turn(layout):
        current = published(layout) or {}
        new = {t: list(ps) for t, ps in current.items() if t not in drop}
        for (table, partition), src in sorted(files.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
            folder = Path(layout.tables) / table / (partition or "")
            folder.mkdir(parents=True, exist_ok=True)
            dest = folder / f"part-0-{uuid.uuid4().hex}.parquet"
            os.replace(src, dest)
            rel = layout.relative(dest)
            prefix = f"tables/{table}/{partition}/" if partition else f"tables/{table}/part-0"
            new[table] = [p for p in new.get(table, []) if not p.startswith(prefix)] + [rel]
        write_json_atomic(record_path(layout), {"files": {t: sorted(ps) for t, ps in sorted(new.items()) if ps}})
    kept = {p for ps in new.values() for p in ps}
    for p in {p for ps in current.values() for p in ps} - kept:
        with contextlib.suppress(OSError):
            (Path(layout.root) / p).unlink()


# --------------------------------------------------------------------------- tables trials leave for the driver


PENDING = "_pending"
"""Run-directory folder where trials leave their result tables until every trial has finished."""


def pending_file(run_dir: Path, table: str, partition: str) -> Path:
    """Where a trial writes its part of ``table`` (``partition``: e.g. ``layer=2``) until :func:`publish_pending`."""
    return Path(run_dir) / PENDING / table / partition / "part-0.parquet"


def discard_pending(run_dir: Path) -> None:
    """Drop tables left by trials of an attempt that did not finish (they are written again)."""
    shutil.rmtree(Path(run_dir) / PENDING, ignore_errors=True)


def publish_pending(run_dir: Path, drop: tuple[str, ...] = ()) -> int:
    """Publish every pending table file, and remove the tables in ``drop`` (turned off), in one replacement
    of the run's publication record (:mod:`actlake.storage.publish`), once all trials have finished."""
    root = Path(run_dir) / PENDING
    files = {}
    for f in sorted(root.rglob("*.parquet")) if root.is_dir() else []:
        parts = f.relative_to(root).parts  # (table, [partition,] part-0.parquet)
        files[(parts[0], parts[1] if len(parts) == 3 else None)] = f
    publish(RunLayout(Path(run_dir)), files, drop)
    discard_pending(run_dir)
    return len(files)


def publish_table(run_dir: Path, table: str, partition: str | None, data) -> None:
    """Publish one Arrow table (``partition``: e.g. ``trial=lm``, or None) at once: written whole, then
    named by the publication record."""
    from actlake.storage.parquet_io import write_parquet

    layout = RunLayout(Path(run_dir))
    Path(layout.staging).mkdir(parents=True, exist_ok=True)
    tmp = Path(layout.staging) / f"{uuid.uuid4().hex}.parquet"
    try:
        write_parquet(data, tmp)
        publish(layout, {(table, partition): tmp})
    finally:
        tmp.unlink(missing_ok=True)

"""Exactly-once commits, a group of shards at a time.

A worker writes each shard's tables as soon as the shard is done (on a disk under ``_staging/``, then
renamed to the shard's fixed name; in an object store straight to a unique name) and merges the
shard's statistics into its open *group*. Committing the group writes the group's merged partial
statistics (one file per analysis table, under the group's unique id), then the group's record
``_complete/group-GROUP.json``, last and in one piece: every shard of the group with its files and
summary, and the partials. A shard is complete when an accepted record names it; nothing else is read.
A worker that dies loses its open group: those shards run again, in a new group. So partial
statistics cost one file per table per group, not per shard (:class:`CommitPolicy` says when a group
commits).

Accepting records (:func:`committed`): records of this plan, taken in the order they arrived (their
modification time; the name, which starts with the commit's start time, breaks ties), whose files
are all present with their recorded sizes; a record naming a shard that an accepted record already
covers is skipped (only a worker thought dead but still running could write one), so no shard's rows
or statistics count twice, and a record that arrives late cannot displace one accepted before it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field

import pyarrow as pa

from actlake.errors import StorageError
from actlake.fs import file_sizes, read_regular, remove_tree
from actlake.storage.layout import RunLayout, write_json_atomic
from actlake.storage.parquet_io import write_parquet, write_parquet_atomic
from actlake.tables import PARTIAL_SUFFIX

log = logging.getLogger("actlake.commit")



class ShardFiles:
    """One shard's tables: written as the shard finishes, published into their tables (not yet committed)."""

    def __init__(self, layout: RunLayout, shard_id: int):
        self.layout, self.shard_id = layout, shard_id
        self.staging = layout.staging / f"{shard_id:05d}-{uuid.uuid4().hex[:8]}"
        self.files: dict[str, dict] = {}
        self.written: list = []

    def write(self, table: str, data: pa.Table) -> None:
        if self.layout.remote:  # no rename in an object store: a unique name, whole once uploaded
            path = self.layout.shard_file(table, self.shard_id, unique=True)
        else:
            path = self.staging / f"{table}.parquet"
        size = write_parquet(data, path)
        self.written.append(path)
        self.files[table] = {"rows": data.num_rows, "bytes": size, "path": self.layout.relative(path)}

    def publish(self) -> dict[str, dict]:
        """Move the staged files into their tables (a disk; in an object store they are there); the files' records."""
        if not self.layout.remote:
            for table, meta in self.files.items():
                dest = self.layout.shard_file(table, self.shard_id)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.staging / f"{table}.parquet", dest)
                meta["path"] = self.layout.relative(dest)
            remove_tree(self.staging)
        return self.files

    def abort(self) -> None:
        if self.layout.remote:
            for p in self.written:
                p.unlink(missing_ok=True)
        else:
            remove_tree(self.staging)


@dataclass
class CommitPolicy:
    """When a worker commits its open group (besides when the driver has no more shards for it)."""

    max_seconds: float = 600.0
    """At most this long between commits: the work a dead worker loses."""
    partial_fraction: float = 0.05
    """Commit once the group's partials would be at most this fraction of the bytes of its shards' tables."""


@dataclass
class Group:
    """A worker's shards since its last commit: their files and summaries, and the bytes of their tables. Storage
    sees Arrow tables and records only: the worker merges the shards' statistics and hands the merged partials to
    :meth:`commit` (:class:`~actlake.jobs.extract.group.OpenGroup`)."""

    layout: RunLayout
    plan_hash: str
    policy: CommitPolicy = field(default_factory=CommitPolicy)
    shards: dict = field(default_factory=dict)  # shard id -> {"files": ..., "summary": ...}
    started: float = field(default_factory=time.monotonic)  # the last commit (or the worker's start)
    table_bytes: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    """Held by ``add`` and ``commit``; a worker running two shards at once holds it to decide and commit."""

    def add(self, shard_id: int, files: dict, summary: dict) -> None:
        with self.lock:
            self.shards[shard_id] = {"files": files, "summary": summary}
            self.table_bytes += sum(m["bytes"] for m in files.values())

    def due(self, partial_bytes: float) -> bool:
        """Whether to commit now, the group's partials being ``partial_bytes`` (an estimate) when written."""
        if not self.shards:
            return False
        if time.monotonic() - self.started >= self.policy.max_seconds:
            return True
        return partial_bytes <= self.policy.partial_fraction * self.table_bytes

    def commit(self, partials: dict) -> list[int]:
        """Write the ``partials`` (table -> Arrow table), then the record (last); the shard ids now complete.
        Afterwards the group is empty, also when writing failed (its shards are then not complete; the dispatcher
        runs them again)."""
        with self.lock:
            return self._commit(partials)

    def _commit(self, partials: dict) -> list[int]:
        if not self.shards:
            return []
        try:
            gid = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
            written = {}
            for table, data in partials.items():
                path = self.layout.partial_file(table, gid)
                size = write_parquet_atomic(data, path, self.layout.staging)
                written[table] = {"path": self.layout.relative(path), "rows": data.num_rows, "bytes": size}
            record = {"group": gid, "plan_hash": self.plan_hash, "partials": written,
                      "shards": {str(sid): entry for sid, entry in sorted(self.shards.items())}}
            write_json_atomic(self.layout.group_record(gid), record)
            return sorted(self.shards)
        finally:
            self.clear()

    def clear(self) -> None:
        """Empty the group (its shards are not complete unless a commit recorded them)."""
        self.shards, self.table_bytes, self.started = {}, 0, time.monotonic()


@dataclass
class Committed:
    """What the accepted records of one plan say."""

    shards: dict[int, dict]
    """Shard id -> {"files": {table: meta}, "summary": {...}, "group": id}."""
    groups: list[dict]
    """The accepted records, in commit order."""
    skipped: list[str]
    """Records not accepted, each with why (another plan's are not listed)."""


_GROUP = re.compile(r"[0-9]{20}-[0-9a-f]{8}")
_SHARD_PART = re.compile(r"part-(\d{5,})(-[0-9a-f]{12})?\.parquet")


def _path_ok(layout: RunLayout, table: str, path: str, shard_id: int | None, group: str | None) -> bool:
    """A recorded path is one actlake writes for that table and shard (or group): records name no other file."""
    parts = path.split("/")
    if len(parts) != 4 or parts[0] != "tables" or parts[1] != table:
        return False
    if group is not None:
        return parts[2] == f"group={group}" and parts[3] == "part-0.parquet"
    m = _SHARD_PART.fullmatch(parts[3])
    return parts[2] == f"shard={shard_id:05d}" and m is not None and int(m.group(1)) == shard_id


def _problem(layout: RunLayout, name: str, rec: dict, sizes: dict[str, int], taken: dict, groups: set) -> str | None:
    gid = rec.get("group", "")
    if not _GROUP.fullmatch(str(gid)) or name != f"group-{gid}.json" or gid in groups:
        return "no valid group id, or not the one its name says"
    if not rec["shards"] or any(not str(sid).isdigit() or str(sid) != str(int(sid)) for sid in rec["shards"]):
        return "no shards, or a shard id that is not a plain number"
    files = [(f"{t}{PARTIAL_SUFFIX}", m, None, gid) for t, m in rec["partials"].items()]
    for sid, entry in rec["shards"].items():
        if int(sid) in taken:
            return f"shard {int(sid):05d} is already in group {taken[int(sid)]}"
        if not isinstance(entry.get("summary"), dict):
            return f"shard {int(sid):05d} has no summary"
        files += [(t, m, int(sid), None) for t, m in entry["files"].items()]
    for table, meta, sid, group in files:
        if not (isinstance(meta, dict) and isinstance(meta.get("path"), str)
                and all(isinstance(meta.get(k), int) and not isinstance(meta.get(k), bool) for k in ("rows", "bytes"))):
            return f"its entry for table {table} is not a path with rows and bytes"
        rel = meta["path"].removeprefix("tables/")
        if not _path_ok(layout, table, meta["path"], sid, group):
            return f"names {meta['path']}, not a file of table {table}"
        if sizes.get(rel) != meta["bytes"]:
            return f"{meta['path']} is missing or not {meta['bytes']} bytes"
    return None


def _arrival(path) -> int:
    """When a record arrived (its modification time, ns; an object's upload time): records are taken in this
    order, so a late record (a worker that hung mid-commit, its name chosen long before) cannot take shards
    from a group accepted before it arrived."""
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def committed(layout: RunLayout, plan_hash: str) -> Committed:
    """Every shard of plan ``plan_hash`` that an accepted record names (see the module docstring)."""
    sizes = file_sizes(layout.tables)
    out = Committed({}, [], [])
    if not layout.complete.is_dir():
        return out
    names = sorted((_arrival(p), p.name, p) for p in layout.complete.iterdir()
                   if p.name.startswith("group-") and p.name.endswith(".json"))
    for *_, path in names:
        try:
            rec = json.loads(read_regular(path))  # a FIFO or a device: not accepted, never read
            if rec.get("plan_hash") != plan_hash:
                continue
            why = _problem(layout, path.name, rec, sizes, {sid: s["group"] for sid, s in out.shards.items()},
                           {g["group"] for g in out.groups})
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"unreadable ({type(e).__name__})"
        except StorageError as e:
            why = str(e)
        if why:
            out.skipped.append(f"{path.name}: {why}")
            continue
        out.groups.append(rec)
        for sid, entry in rec["shards"].items():
            out.shards[int(sid)] = dict(entry, group=rec["group"])
    if out.skipped:
        log.warning("%s: %d commit record(s) not accepted: %s", layout.root, len(out.skipped), "; ".join(out.skipped[:3]))
    return out

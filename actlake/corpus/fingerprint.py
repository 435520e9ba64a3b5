"""Fingerprints of corpus inputs, so a run never resumes (or goes on) over changed files.

A file's fingerprint is its size, its modification time and a SHA-256 of its content:

- files up to :data:`FULL_HASH_LIMIT` (64 MiB) are hashed whole (``hash_kind: full``);
- larger files hash their size and three :data:`SAMPLE_BLOCK` (1 MiB) blocks, at the head, the
  middle and the tail (``hash_kind: sampled``): a few milliseconds for a multi-GB Pile file.

A sampled hash cannot see an edit between its blocks that keeps the size, so for sampled files a
changed modification time counts as a change too, and so does a changed *change time* (``ctime``)
of a local file: any write sets it, and unlike the modification time no user can set it back, so an
edit between the blocks followed by ``touch -d`` to the old time is still seen. It is part of a
sampled file's recorded fingerprint, hence of the key of its cached count and seekable copy (a
changed file never meets its old copy), and workers check it with the size and modification time
before and after reading a shard. (A copy with the same bytes is a new input for a sampled file,
not for a fully hashed one: there the hash decides, and a file copied or touched is the same input.) Hugging Face datasets are fingerprinted
by the datasets library's own ``_fingerprint`` when the dataset has one, else by name, split and
config name (``hash_kind: name``), plus their number of rows.

Inputs may be object-store URLs (``s3://bucket/key``): their size and modification time (the
object's LastModified) come from :func:`actlake.fs.stat`, their bytes from ranged reads.
"""

from __future__ import annotations

import hashlib
import os

from actlake.corpus.readers import REMOTE_SCAN_CHUNK, is_url, open_file
from actlake.errors import CorpusError, StorageError
from actlake.fs import location, stat

FULL_HASH_LIMIT = 64 << 20
"""Files up to this size are hashed whole; larger ones by sampled blocks."""
SAMPLE_BLOCK = 1 << 20
"""Bytes of each sampled block (head, middle, tail) of a large file."""


def _hash_blocks(path: str, size: int) -> tuple[str, str]:
    """(hash kind, hex SHA-256) of the whole file, or of its size and head/middle/tail blocks."""

    h = hashlib.sha256()
    block = REMOTE_SCAN_CHUNK if is_url(path) else SAMPLE_BLOCK  # whole-object hashing: fewer requests
    with open_file(path) as f:
        if size <= FULL_HASH_LIMIT:
            while data := f.read(block):
                h.update(data)
            return "full", h.hexdigest()
        h.update(size.to_bytes(8, "little"))
        for offset in (0, size // 2 - SAMPLE_BLOCK // 2, size - SAMPLE_BLOCK):
            f.seek(offset)
            h.update(f.read(SAMPLE_BLOCK))
        return "sampled", h.hexdigest()


def _stat(path: str) -> tuple[int, int]:
    """(size, mtime in ns) of a local file or an object (its LastModified)."""

    return stat(path)


def change_time(path: str) -> int | None:
    """A local file's change time (ns), which every write moves and no user can set; None for an object
    (an object is never changed in place: a new upload has a new LastModified)."""

    return None if is_url(path) else os.stat(path).st_ctime_ns


def _why(e: Exception) -> str:
    return " ".join(str(getattr(e, "strerror", None) or e).split())


def file_fingerprint(path: str) -> dict:
    """Size, mtime and content hash of ``path``; raises CorpusError if it changes while being hashed."""
    try:
        before = _stat(path), change_time(path)
        kind, digest = _hash_blocks(path, before[0][0])
        after = _stat(path), change_time(path)
    except (OSError, StorageError) as e:
        raise CorpusError(f"{path}: cannot read corpus file ({type(e).__name__}: {_why(e)})") from None
    if before != after:
        raise CorpusError(f"{path}: the file changed while it was being fingerprinted; is something still writing it?")
    (size, mtime), ctime = after
    fp = {"size": size, "mtime_ns": mtime, "hash_kind": kind, "hash": digest}
    if kind == "sampled" and ctime is not None:
        fp["ctime_ns"] = ctime
        fp["hash"] = hashlib.sha256(f"{digest}|{ctime}".encode()).hexdigest()  # keys caches and seekable copies
    return fp


def hf_fingerprint(ds, name: str, split: str) -> dict:
    """A loaded Hugging Face dataset's own fingerprint (or its name, split and config) and row count."""
    own = getattr(ds, "_fingerprint", None)
    if own:
        return {"rows": len(ds), "hash_kind": "datasets", "hash": str(own)}
    config = getattr(getattr(ds, "info", None), "config_name", None)
    return {"rows": len(ds), "hash_kind": "name", "hash": f"{name}|{split}|{config}"}


def describe_change(old: dict, new: dict) -> str | None:
    """What differs between two fingerprints of one input, in a few words; None if it is the same input."""
    for key, unit in (("size", " bytes"), ("rows", " rows")):
        if key in old and old.get(key) != new.get(key):
            return f"{key} {old[key]:,}{unit} when planned, now {new.get(key, 0):,}{unit}"
    if old.get("hash_kind") == "sampled" and old.get("ctime_ns") != new.get("ctime_ns"):
        return "change time moved (a large file's sampled hash cannot rule out an edit)"
    if old.get("hash_kind") != new.get("hash_kind") or old.get("hash") != new.get("hash"):
        same = "number of rows" if "rows" in old else "size"
        return f"content changed (same {same}, different hash)"
    if old.get("hash_kind") == "sampled" and old.get("mtime_ns") != new.get("mtime_ns"):
        return "modification time changed (a large file's sampled hash cannot rule out an edit)"
    return None


def check_stat(path: str, size: int, mtime_ns: int, when: str, ctime_ns: int | None = None) -> None:
    """Raise CorpusError naming ``path`` unless its size and mtime are still ``size`` and ``mtime_ns`` (and its
    change time ``ctime_ns``, when the plan recorded one: a large file's)."""
    try:
        now_size, now_mtime = _stat(path)
        now_ctime = change_time(path) if ctime_ns is not None else None
    except (OSError, StorageError) as e:
        raise CorpusError(f"{path}: corpus file gone or unreadable {when} ({_why(e)})") from None
    if now_size != size:
        raise CorpusError(f"{path}: the file changed {when}: size {size:,} bytes when planned, now {now_size:,}")
    if now_mtime != mtime_ns:
        raise CorpusError(f"{path}: the file changed {when}: modification time moved since planning")
    if now_ctime != ctime_ns:
        raise CorpusError(f"{path}: the file changed {when}: its change time moved since planning (it was written)")


def first_change(recorded: dict[str, dict], current: dict[str, dict]) -> tuple[str, str] | None:
    """(input, what changed) for the first input whose fingerprint differs, or that one side lacks; None if all agree."""
    for path in sorted(recorded.keys() | current.keys()):
        if path not in current:
            return path, "no longer in the corpus"
        if path not in recorded:
            return path, "new in the corpus"
        what = describe_change(recorded[path], current[path])
        if what:
            return path, what
    return None


def current_fingerprints(recorded: dict[str, dict]) -> dict[str, dict]:
    """Fingerprints, taken now, of the files in ``recorded`` (hf datasets keep their recorded value:
    workers check their row count as they read). A file that is gone is left out."""
    now = {}
    for path, fp in recorded.items():
        if fp.get("hash_kind") in ("datasets", "name"):
            now[path] = fp
        elif file_exists(path):
            now[path] = file_fingerprint(path)
    return now


def file_exists(path: str, what: str = "corpus file") -> bool:
    """Whether a local file or an object (``s3://…``) exists; CorpusError naming ``what`` when its store
    cannot be reached."""

    if not is_url(path):
        return os.path.isfile(path)

    try:
        return location(path).is_file()
    except (OSError, StorageError) as e:
        raise CorpusError(f"{path}: cannot reach the {what} ({type(e).__name__}: {_why(e)})") from None

"""Page checksums checked before a run's files are served, once per version of each file.

Every Parquet file actlake writes carries page checksums (CRC32), which DuckDB does not check when
it reads: a flipped bit in a committed file would give a wrong number with no warning. Readers
(:func:`actlake.storage.sql.open_run`, hence ``actlake sql`` and the reports) first read each file
they serve through pyarrow with checksum verification, one row group at a time. A file that passed
is remembered by its signature (size, modification and change times, inode; an object's size and
upload time) in a per-user cache, ``$XDG_CACHE_HOME/actlake/verified.json`` (default
``~/.cache/actlake``), so later queries pay nothing until the file changes; any write to the file
changes its change time, which no user can set back. (Decay of the medium that changes no metadata
is caught only on the first read of a file by this user; remove the cache file to check again.)
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from actlake.fs import ObjectPath, write_atomic

log = logging.getLogger("actlake.verified")

MAX_ENTRIES = 200_000
"""Files remembered at most (the oldest entries are dropped first)."""


def cache_dir() -> Path:
    """actlake's per-user cache folder: ``$XDG_CACHE_HOME/actlake`` (default ``~/.cache/actlake``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "actlake"


def cache_file() -> Path:
    return cache_dir() / "verified.json"


def signature(path) -> list:
    if isinstance(path, ObjectPath):
        st = path.stat()
        return [st.st_size, st.st_mtime_ns]
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _load() -> dict:
    try:
        data = json.loads(cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def verify_files(files: list) -> int:
    """Check the page checksums of every file in ``files`` not verified in its present version
    (StorageError naming the first damaged one); returns how many were read."""
    from actlake.storage.parquet_io import verify_parquet

    known = _load()
    read = 0
    for f in files:
        key, sig = str(f), signature(f)
        if known.get(key) == sig:
            continue
        verify_parquet(f)
        known.pop(key, None)
        known[key] = sig  # newest last
        read += 1
    if read:
        entries = list(known.items())[-MAX_ENTRIES:]
        try:
            cache_file().parent.mkdir(parents=True, exist_ok=True)
            write_atomic(cache_file(), json.dumps(dict(entries)).encode())
        except OSError as e:  # a read-only home: verified again next time
            log.info("cannot remember verified files in %s (%s)", cache_file(), e)
    return read

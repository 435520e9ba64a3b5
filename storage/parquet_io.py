"""Atomic, verifiable Parquet writes: zstd, page checksums, temp name then rename."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from actlake.errors import StorageError


def write_parquet(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` in place (the caller renames it into a table later)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", write_page_checksum=True)


def write_parquet_atomic(table: pa.Table, path: Path, staging: Path) -> None:
    """Write under ``staging`` (outside every table glob), then rename onto ``path``."""
    staging.mkdir(parents=True, exist_ok=True)
    tmp = staging / f"{uuid.uuid4().hex}.parquet"
    write_parquet(table, tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)


def verify_parquet(path: Path, rows: int | None = None, size: int | None = None) -> None:
    """Check the footer magic, size and row count, and read every page (checksums verified)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise StorageError(f"{path}: missing") from None
    if size is not None and st.st_size != size:
        raise StorageError(f"{path}: size {st.st_size} bytes, completion record says {size}")
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(-4, os.SEEK_END)
        tail = f.read(4)
    if head != b"PAR1" or tail != b"PAR1":
        raise StorageError(f"{path}: not a whole Parquet file (magic bytes missing)")
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        n = pf.metadata.num_rows
        pf.read()
    except Exception as e:
        raise StorageError(f"{path}: damaged ({type(e).__name__}: {e})") from None
    if rows is not None and n != rows:
        raise StorageError(f"{path}: {n} rows, completion record says {rows}")

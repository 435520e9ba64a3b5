"""Verifiable Parquet writes (zstd, page checksums) on a disk or in an object store, and their check."""

from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from actlake.errors import StorageError
from actlake.fs import ObjectPath, arrow


def write_parquet(table: pa.Table, path) -> int:
    """Write ``table`` to ``path`` (a Path or ObjectPath) in place; returns its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fs, key = arrow(path)
    pq.write_table(table, key, filesystem=fs, compression="zstd", write_page_checksum=True)
    return path.stat().st_size


def write_parquet_atomic(table: pa.Table, path, staging) -> int:
    """``path`` holds ``table`` whole or keeps what it held: written under ``staging`` (outside every
    table glob) and renamed on a disk; uploaded in one piece to an object store. Returns the size."""
    if isinstance(path, ObjectPath):
        return write_parquet(table, path)
    staging.mkdir(parents=True, exist_ok=True)
    tmp = staging / f"{uuid.uuid4().hex}.parquet"
    size = write_parquet(table, tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return size


def read_parquet(path) -> pa.Table:
    fs, key = arrow(path)
    return pq.read_table(key, filesystem=fs)


def verify_parquet(path, rows: int | None = None, size: int | None = None) -> None:
    """Check the footer magic, size and row count, and read every page (checksums verified)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise StorageError(f"{path}: missing") from None
    if size is not None and st.st_size != size:
        raise StorageError(f"{path}: size {st.st_size} bytes, completion record says {size}")
    with path.open("rb") as f:
        head = f.read(4)
        f.seek(st.st_size - 4)
        tail = f.read(4)
    if head != b"PAR1" or tail != b"PAR1":
        raise StorageError(f"{path}: not a whole Parquet file (magic bytes missing)")
    try:
        fs, key = arrow(path)
        with fs.open_input_file(key) as f:
            pf = pq.ParquetFile(f, page_checksum_verification=True)
            n = pf.metadata.num_rows
            for i in range(pf.num_row_groups):  # a row group at a time: memory bounded by one
                pf.read_row_group(i)
    except Exception as e:
        raise StorageError(f"{path}: damaged ({type(e).__name__}: {e})") from None
    if rows is not None and n != rows:
        raise StorageError(f"{path}: {n} rows, completion record says {rows}")

"""How a table's view reads its committed files: fixed-size vectors as FLOAT[d] whatever file comes last, each
file's size and time read once per connection."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actlake.errors import StorageError
from actlake.storage.readonly_fs import ReadOnlyFiles
from actlake.storage.sql import _fixed_size_casts, _view_sql


def _vectors(path, rows: list[list[float]], d: int):
    """A file as activation_table writes it: an empty sample's column is a fixed-size list of 1."""
    flat = pa.array([v for r in rows for v in r], pa.float32())
    h = pa.FixedSizeListArray.from_arrays(flat, d) if rows else pa.array([], pa.list_(pa.float32(), 1))
    pq.write_table(pa.table({"i": pa.array(range(len(rows)), pa.int64()), "h": h}), path)
    return path


@pytest.mark.parametrize("empty_last", [True, False])
def test_an_empty_file_does_not_decide_the_vector_size(tmp_path, empty_last):
    full = _vectors(tmp_path / "a.parquet", [[1, 2, 3, 4], [5, 6, 7, 8]], 4)
    empty = _vectors(tmp_path / "b.parquet", [], 1)
    files = [full, empty] if empty_last else [empty, full]
    assert _fixed_size_casts(files) == ['CAST("h" AS FLOAT[4]) AS "h"']
    con = duckdb.connect()
    con.register_filesystem(ReadOnlyFiles(files))
    rows = con.execute(f"SELECT i, typeof(h), h FROM ({_view_sql(files)}) ORDER BY i").fetchall()
    assert rows == [(0, "FLOAT[4]", (1.0, 2.0, 3.0, 4.0)), (1, "FLOAT[4]", (5.0, 6.0, 7.0, 8.0))]


def test_files_of_one_table_with_different_vector_sizes_are_named(tmp_path):
    a = _vectors(tmp_path / "a.parquet", [[1, 2]], 2)
    b = _vectors(tmp_path / "b.parquet", [[1, 2, 3]], 3)
    with pytest.raises(StorageError, match=r"b\.parquet: column 'h' holds vectors of 3 values, .*a\.parquet of 2"):
        _fixed_size_casts([a, b])


def test_each_files_size_is_read_once_per_connection(tmp_path):
    """DuckDB asks for a file's size and time several times per query (each a HEAD request on an object store);
    a committed file never changes, so the file system answers from what it read first, and opens a file only
    when DuckDB reads from it."""
    path = _vectors(tmp_path / "a.parquet", [[1, 2]], 2)
    files = ReadOnlyFiles([path])
    before = files.info(str(path))
    path.write_bytes(b"x")  # not what a committed file does: shows the answer is the remembered one
    assert files.info(str(path)) == before and before["size"] > 1

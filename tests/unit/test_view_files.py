"""How a table's view reads its committed files: fixed-size vectors as FLOAT[d] whatever file comes last; an
object's size asked for once per connection, a local file's from the file opened."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actlake.errors import StorageError
from actlake.storage.readonly_fs import ReadOnlyFiles, url
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
    assert _fixed_size_casts([empty]) == ['CAST("h" AS FLOAT[1]) AS "h"']  # empty files only: still an array


def test_files_of_one_table_with_different_vector_sizes_are_named(tmp_path):
    a = _vectors(tmp_path / "a.parquet", [[1, 2]], 2)
    b = _vectors(tmp_path / "b.parquet", [[1, 2, 3]], 3)
    with pytest.raises(StorageError, match=r"b\.parquet: column 'h' holds vectors of 3 values, .*a\.parquet of 2"):
        _fixed_size_casts([a, b])


def test_an_objects_size_is_asked_for_once_and_it_is_opened_only_to_be_read(s3_server, tmp_path):
    """DuckDB asks for a file's size and time several times per query and opens files whose footers it has
    cached: on an object store (where a committed object is never written again) those cost one HEAD request
    in all, and an open that reads nothing costs none."""
    from actlake.fs import location

    obj = location(s3_server("view-files")) / "t" / "part-0.parquet"
    obj.write_bytes(_vectors(tmp_path / "a.parquet", [[1, 2]], 2).read_bytes())
    files, name = ReadOnlyFiles([obj]), url(obj)
    del s3_server.requests[:]
    infos = [files.info(name) for _ in range(5)] + [files.modified(name)]
    reader = files.open(name, "rb")
    assert s3_server.requests == [("HEAD", "/view-files/t/part-0.parquet")] and infos[0]["size"] > 0
    reader.seek(-4, 2)
    assert reader.read() == b"PAR1" and ("GET", "/view-files/t/part-0.parquet") in s3_server.requests
    reader.close()


def test_a_local_file_replaced_under_its_name_is_read_whole(tmp_path):
    """On a disk a reduce replaces its tables' files under the same names: a connection's next open reads the
    new file with its own size, not the size it saw before."""
    path = _vectors(tmp_path / "part-0.parquet", [[1, 2]], 2)
    files = ReadOnlyFiles([path])
    before = files.info(str(path))["size"]
    _vectors(tmp_path / "new.parquet", [[1, 2], [3, 4], [5, 6]], 2).replace(path)
    con = duckdb.connect()
    con.register_filesystem(files)
    assert files.info(str(path))["size"] != before
    assert con.execute(f"SELECT count(*) FROM ({_view_sql([path])})").fetchall() == [(3,)]


def test_duckdb_hints_survive_in_the_one_line_error():
    """`actlake sql` printed `Catalog Error: Table with name attention_mas does not exist!` without DuckDB's
    `Did you mean "attention_mass"?` (and column typos without `Candidate bindings`)."""
    import duckdb

    from actlake.storage.sql import _first_line

    con = duckdb.connect()
    con.execute("CREATE TABLE attention_mass (mass DOUBLE)")
    for sql, hint in [("SELECT * FROM attention_mas", 'Did you mean "attention_mass"?'),
                      ("SELECT mas FROM attention_mass", 'Candidate bindings: "mass"')]:
        try:
            con.execute(sql)
        except duckdb.Error as e:
            line = _first_line(e)
        assert hint in line and "\n" not in line and "LINE 1" not in line, line

"""actlake.fs against a local folder and a real S3-compatible server (moto on 127.0.0.1)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actlake.errors import StorageError
from actlake.fs import ObjectPath, arrow, glob, location, remove_tree, stat, write_atomic


def test_unknown_schemes_are_refused_and_never_become_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in ("ftp://host/x", "s4://bucket/runs", "http://example.com/a.jsonl"):
        with pytest.raises(StorageError, match=r"path: .* uses the scheme .*cannot read or write"):
            location(url)
    assert list(tmp_path.iterdir()) == []
    assert location("file://" + str(tmp_path)) == tmp_path
    assert location("gcs://b/k") == ObjectPath("gs", "b/k")


def test_object_paths_behave_like_paths_on_a_real_s3_server(s3_server):
    bucket = s3_server("fs-unit")
    root = location(bucket + "/runs/r1/")
    assert str(root) == "s3://fs-unit/runs/r1" and root.name == "r1" and str(root.parent) == "s3://fs-unit/runs"
    f = root / "_complete" / "a.json"
    assert not f.exists() and not f.is_file()
    write_atomic(f, b'{"x": 1}')
    assert f.read_text() == '{"x": 1}' and f.is_file() and (root / "_complete").is_dir()
    assert f.stat().st_size == 8 and f.stat().st_mtime_ns > 0 and stat(str(f))[0] == 8
    assert str(f.relative_to(root)) == "_complete/a.json"
    with pytest.raises(FileNotFoundError):
        (root / "missing.json").read_bytes()
    # Parquet through pyarrow.fs, and a glob over the bucket listing
    t = pa.table({"a": [1, 2, 3]})
    for name in ("tables/t/shard=00000/part-0.parquet", "tables/t/shard=00001/part-1.parquet", "tables/u/x.parquet"):
        fs, key = arrow(root / name)
        pq.write_table(t, key, filesystem=fs)
    assert glob(bucket + "/runs/r1/tables/t/*/*.parquet") == [
        f"{bucket}/runs/r1/tables/t/shard=00000/part-0.parquet", f"{bucket}/runs/r1/tables/t/shard=00001/part-1.parquet"]
    assert glob(bucket + "/runs/**/x.parquet") == [f"{bucket}/runs/r1/tables/u/x.parquet"]
    assert [p.name for p in (root / "tables").iterdir()] == ["t", "u"]
    fs, key = arrow(root / "tables/u/x.parquet")
    assert pq.read_table(key, filesystem=fs).equals(t)
    remove_tree(root / "tables")
    assert not (root / "tables").exists() and f.is_file()


def test_local_glob_and_atomic_write(tmp_path):
    (tmp_path / "a").mkdir()
    for n in ("a/1.jsonl", "a/2.jsonl", "b.jsonl"):
        (tmp_path / n).write_text("{}")
    assert glob(str(tmp_path / "**" / "*.jsonl")) == [str(tmp_path / n) for n in ("a/1.jsonl", "a/2.jsonl", "b.jsonl")]
    write_atomic(tmp_path / "x" / "y.json", b"1")
    assert (tmp_path / "x" / "y.json").read_bytes() == b"1" and [p.name for p in (tmp_path / "x").iterdir()] == ["y.json"]


@pytest.mark.parametrize("kind", ["local", "pyarrow"])
def test_the_read_only_files_keep_a_position_per_thread(tmp_path, kind):
    """DuckDB reads row groups of one file from several threads through one handle, as seek-then-read: another
    thread's seek between the two must not move this thread's read (it did, on an object store)."""
    import threading

    import pyarrow.fs as pafs

    from actlake.storage.readonly_fs import PositionalReader

    path = tmp_path / "blob"
    data = bytes(range(256)) * 64
    path.write_bytes(data)
    opened = []

    def open_file():
        opened.append(path.open("rb") if kind == "local" else pafs.LocalFileSystem().open_input_file(str(path)))
        return opened[-1]

    reader = PositionalReader(open_file, len(data))
    assert opened == []  # opened at the first read, not before
    sought, moved = threading.Event(), threading.Event()
    got = {}

    def first():
        reader.seek(100)
        sought.set()
        moved.wait(10)  # the other thread has sought elsewhere meanwhile
        got["first"] = reader.read(50)

    def second():
        sought.wait(10)
        reader.seek(9000)
        moved.set()
        got["second"] = reader.read(30)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {"first": data[100:150], "second": data[9000:9030]}
    reader.seek(-4, 2)
    assert reader.read() == data[-4:] and reader.tell() == len(data)
    assert len(opened) == 1  # once, for both threads
    reader.close()
    assert opened[0].closed

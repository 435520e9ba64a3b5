"""Corpus inputs, the corpus index and the count cache in an object store: a real S3-compatible
server (moto on 127.0.0.1, the ``s3_server`` fixture), compared with the same files on a local disk."""

from __future__ import annotations

import json

import pytest

from actlake.config import parse_config, resolve_corpus_files
from actlake.errors import ConfigError
from actlake.fs import location


def _corpus(folder):
    """Three inputs: a single-frame .jsonl.zst, a plain .jsonl (with a bad line) and a Parquet file of
    row groups of 10 rows. Returns {name: bytes}."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    folder.mkdir(parents=True, exist_ok=True)
    lines = lambda tag, n: "".join(json.dumps({"text": f"{tag} doc {i} " + "w" * (i % 13), "meta": {"pile_set_name": f"S{i % 3}"}}) + "\n"
                                   for i in range(n)).encode()
    files = {"a.jsonl.zst": zstandard.ZstdCompressor().compress(lines("a", 37)),
             "b.jsonl": lines("b", 11) + b"{not json\n" + lines("b2", 5)}
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": [f"p doc {i}" if i % 9 else " " for i in range(53)],
                             "meta": [{"pile_set_name": f"P{i % 2}"} for i in range(53)]}), buf, row_group_size=10)
    files["c.parquet"] = buf.getvalue()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _upload(bucket_url: str, prefix: str, files: dict) -> None:
    for name, data in files.items():
        location(f"{bucket_url}/{prefix}/{name}").write_bytes(data)


def _cfg(paths, out, **sharding):
    return parse_config({"corpus": {"paths": paths}, "output": {"dir": str(out)},
                         "sharding": {"docs_per_shard": 4, "plan_workers": 1, **sharding}})


def _items(shards):
    from actlake.corpus.readers import iter_range

    return [list(iter_range(s.path, s.fmt, s.start, s.end, "text", "meta.pile_set_name", entry=s.entry())) for s in shards]


RANGE = ("fmt", "start", "end", "doc_offset", "entry_offset", "entry_record", "size")


def test_a_bucket_corpus_plans_into_the_local_shards_and_reads_the_same_items(s3_server, tmp_path, monkeypatch):
    """The same files in a bucket and on disk: the same shard ranges and entry points (index built in
    two spawned processes, the index and count cache written to output.dir in the bucket), and every
    shard reads the same items; a second plan takes the cache and decodes no input."""
    from actlake.corpus import index, readers
    from actlake.corpus.fingerprint import check_stat
    from actlake.jobs.extract.plan import COUNT_CACHE, make_plan, plan_with_inputs

    monkeypatch.chdir(tmp_path)
    bucket = s3_server("corpus-same")
    files = _corpus(tmp_path / "c")
    _upload(bucket, "train", files)
    monkeypatch.setattr(index, "PARALLEL_MIN_BYTES", 0)  # index in the process pool (spawn) even for tiny files
    local = _cfg([str(tmp_path / "c" / "*")], tmp_path / "out", plan_workers=2)
    remote = _cfg([bucket + "/train/*.jsonl*", bucket + "/train/*.parquet"], bucket + "/out", plan_workers=2)
    assert resolve_corpus_files(remote) == [f"{bucket}/train/{n}" for n in sorted(files)]
    ls, rs = make_plan(local), make_plan(remote)
    assert [tuple(getattr(s, k) for k in RANGE) for s in rs] == [tuple(getattr(s, k) for k in RANGE) for s in ls]
    assert len(rs) == 10 + 5 + 14 and {s.path for s in rs} == {f"{bucket}/train/{n}" for n in files}
    zst = [s for s in rs if s.path.endswith(".zst")]
    assert all(s.entry_file.startswith(bucket + "/out/_corpus_index/") and s.entry_record == s.start for s in zst)
    assert _items(rs) == _items(ls)
    for s in rs:  # what a worker checks before and after reading a shard: the object's size and LastModified
        check_stat(s.path, s.size, s.mtime_ns, "since the run planned it")
    out = location(bucket + "/out")
    cache = json.loads((out / COUNT_CACHE).read_text())
    assert {k: v["records"] for k, v in cache.items()} == {f"{bucket}/train/a.jsonl.zst": 37, f"{bucket}/train/b.jsonl": 17,
                                                          f"{bucket}/train/c.parquet": 53}
    names = sorted(p.name for p in (out / index.INDEX_DIR).iterdir())
    assert len(names) == 3 and sum(n.endswith(".jsonl.zst") for n in names) == 1  # two indexes, one seekable copy
    assert not (tmp_path / "s3:").exists()

    # a second plan: every entry from the cache; nothing indexed, counted or decoded
    before = {p.name: p.stat().st_mtime_ns for p in out.files()}
    monkeypatch.setattr(index, "build_index", None)
    monkeypatch.setattr(readers, "decoded_chunks", None)
    monkeypatch.setattr(readers, "count_records", None)
    shards, inputs = plan_with_inputs(remote)
    assert shards == rs and {p.name: p.stat().st_mtime_ns for p in out.files()} == before  # the cache was not rewritten
    assert {k: v["size"] for k, v in inputs.items()} == {f"{bucket}/train/{n}": len(d) for n, d in files.items()}


def test_shards_of_a_bucket_read_only_their_byte_ranges(s3_server, tmp_path, monkeypatch):
    """Bytes fetched from the server, counted under the readers' file handle: a Parquet shard in the
    middle reads the footer and one row group's columns, a .jsonl.zst shard reads from its frame, both
    far less than their file; a whole-file read fetches at least the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actlake.corpus import readers
    from actlake.corpus.readers import ReadStats, iter_range
    from actlake.jobs.extract.plan import make_plan

    bucket = s3_server("corpus-ranges")
    n = 4000
    texts = [f"row {i} " + " ".join(f"w{(i * 7 + k) % 1000}" for k in range(40)) for i in range(n)]
    f = location(bucket + "/pq/big.parquet")
    fs, key = f.fs, f.key
    pq.write_table(pa.table({"text": texts, "meta": [{"pile_set_name": f"S{i % 5}"} for i in range(n)]}), key,
                   filesystem=fs, row_group_size=250, compression="none")
    import zstandard
    z = location(bucket + "/z/big.jsonl.zst")
    ztexts = [f"{i}: {texts[(i * 37) % n]}" for i in range(6 * n)]
    z.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps({"text": t}) + "\n" for t in ztexts).encode()))

    fetched = {}
    real_open = readers.open_file

    class Counting:
        """Forwards to the real pyarrow file of the object store, counting the bytes it returns."""

        def __init__(self, inner, path):
            self.inner, self.path = inner, path

        def read(self, size=-1):
            data = self.inner.read() if size is None or size < 0 else self.inner.read(size)
            fetched[self.path] = fetched.get(self.path, 0) + len(data)
            return data

        def __getattr__(self, name):
            if name in ("read_at", "read_buffer", "readall", "readinto", "download", "get_stream"):
                raise AttributeError(name)  # only read() fetches, so every fetched byte is counted
            return getattr(self.inner, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()

    monkeypatch.setattr(readers, "open_file", lambda p: Counting(real_open(p), p) if readers.is_url(p) else real_open(p))

    size = f.stat().st_size
    stats = ReadStats()
    got = list(iter_range(str(f), "parquet", 2010, 2060, "text", "meta.pile_set_name", stats=stats))
    assert [r.text for r in got] == texts[2010:2060] and stats.rows_decoded == 250
    # the footer (pyarrow reads the file's last 64 KiB for it) and one row group of 16: well under a quarter
    assert 0 < fetched[str(f)] < (64 << 10) + 2 * size / 16 < size / 4, (fetched, size)
    fetched.clear()
    assert len(list(iter_range(str(f), "parquet", 0, n, "text", "meta.pile_set_name"))) == n
    assert fetched[str(f)] >= size * 0.9

    cfg = _cfg([str(z)], bucket + "/out", docs_per_shard=250)
    shards = make_plan(cfg)
    mid = shards[len(shards) // 2]
    copy = location(mid.entry_file)
    fetched.clear()
    got = list(iter_range(mid.path, mid.fmt, mid.start, mid.end, "text", "x", entry=mid.entry()))
    assert [r.text for r in got] == ztexts[mid.start:mid.end]
    # from its frame to the end of the shard's frame, in reads of ENTRY_CHUNK: a small part of the copy
    frame = shards[len(shards) // 2 + 1].entry_offset - mid.entry_offset
    assert set(fetched) == {mid.entry_file} and fetched[mid.entry_file] <= frame + readers.ENTRY_CHUNK < copy.stat().st_size / 4, (
        fetched, frame, copy.stat())


def test_a_seekable_copy_that_fails_midway_leaves_no_object(s3_server):
    """An upload closed by an error would complete with part of the frames: the copy is deleted."""
    from actlake.corpus.index import _write_frames

    dest = location(s3_server("corpus-copy") + "/out/_corpus_index/k.jsonl.zst")

    def pieces():
        yield [b'{"text": "a"}\n']
        raise OSError("the input went away")

    with pytest.raises(OSError, match="went away"):
        _write_frames(pieces(), dest, [])
    assert not dest.exists()
    points = []
    _write_frames(iter([[b'{"text": "a"}\n'], [b'{"text": "b"}\n']]), dest, points)
    assert dest.is_file() and points[0] == 0 and 0 < points[1] < dest.stat().st_size


def test_fingerprints_of_objects_see_a_rewritten_object(s3_server):
    """Size and LastModified from the store, content hashed by ranged reads: a rewrite with other bytes
    of the same size changes the hash; another size changes the size; a deleted object is gone."""
    from actlake.corpus.fingerprint import check_stat, current_fingerprints, file_fingerprint, first_change
    from actlake.errors import CorpusError

    bucket = s3_server("corpus-fp")
    url = bucket + "/fp/a.jsonl"
    obj = location(url)
    obj.write_bytes(b'{"text": "one"}\n')
    fp = file_fingerprint(url)
    assert fp["size"] == 16 and fp["mtime_ns"] > 0 and fp["hash_kind"] == "full"
    recorded = {url: fp}
    assert first_change(recorded, current_fingerprints(recorded)) is None
    check_stat(url, fp["size"], fp["mtime_ns"], "since planning")
    obj.write_bytes(b'{"text": "two"}\n')
    assert first_change(recorded, current_fingerprints(recorded)) == (url, "content changed (same size, different hash)")
    obj.write_bytes(b'{"text": "three"}\n')
    assert first_change(recorded, current_fingerprints(recorded)) == (url, "size 16 bytes when planned, now 18 bytes")
    with pytest.raises(CorpusError, match=r"s3://corpus-fp/fp/a.jsonl: the file changed since planning: size 16"):
        check_stat(url, fp["size"], fp["mtime_ns"], "since planning")
    obj.unlink()
    assert first_change(recorded, current_fingerprints(recorded)) == (url, "no longer in the corpus")
    with pytest.raises(CorpusError, match=r"s3://corpus-fp/fp/a.jsonl: corpus file gone or unreadable"):
        check_stat(url, fp["size"], fp["mtime_ns"], "since planning")


def test_globs_over_a_bucket_and_patterns_matching_nothing(s3_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bucket = s3_server("corpus-glob")
    for key in ("pile/00.jsonl.zst", "pile/01.jsonl.zst", "pile/sub/02.jsonl.zst", "pile/readme.txt", "other/03.jsonl"):
        location(f"{bucket}/{key}").write_bytes(b"{}\n")
    out = str(tmp_path / "out")
    assert resolve_corpus_files(_cfg([bucket + "/pile/*.jsonl.zst"], out)) == [f"{bucket}/pile/0{i}.jsonl.zst" for i in (0, 1)]
    assert resolve_corpus_files(_cfg([bucket + "/**/*.jsonl*", bucket + "/pile/00.jsonl.zst"], out)) == [
        f"{bucket}/other/03.jsonl", f"{bucket}/pile/00.jsonl.zst", f"{bucket}/pile/01.jsonl.zst", f"{bucket}/pile/sub/02.jsonl.zst"]
    with pytest.raises(ConfigError, match=r"^corpus.paths\[1\]: no file matches 's3://corpus-glob/pile/\*.parquet'$"):
        resolve_corpus_files(_cfg([bucket + "/pile/00.jsonl.zst", bucket + "/pile/*.parquet"], out))
    with pytest.raises(ConfigError, match=r"^corpus.paths\[0\]: cannot tell the format of s3://corpus-glob/pile/readme.txt"):
        resolve_corpus_files(_cfg([bucket + "/pile/*"], out))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("paths,out,key", [(["ftp://host/train/*.jsonl"], "runs", "corpus.paths.0"),
                                           (["data/*.jsonl"], "s4://bucket/runs", "output.dir"),
                                           (["data/a.jsonl", "HTTP://h/b.jsonl"], "runs", "corpus.paths.1")])
def test_an_unknown_scheme_is_one_line_naming_the_key_and_makes_no_folder(tmp_path, monkeypatch, paths, out, key):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"'{key}': '[^']+' uses the scheme \w+://, which actlake cannot read or write") as e:
        parse_config({"corpus": {"paths": paths}, "output": {"dir": out}})
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []
    # the reader's own guard (a config built without the checks), naming the entry as corpus.paths[i]
    from types import SimpleNamespace

    cfg = SimpleNamespace(corpus=SimpleNamespace(format="auto", paths=["gopher://h/x.jsonl"]))
    with pytest.raises(ConfigError, match=r"^corpus.paths\[0\]: 'gopher://h/x.jsonl' uses the scheme gopher://"):
        resolve_corpus_files(cfg)
    assert list(tmp_path.iterdir()) == []

import json

import pytest
import zstandard

from actlake.corpus.readers import Record, Reject, count_records, iter_items, iter_range
from actlake.corpus.sample import write_sample
from actlake.errors import CorpusError


def test_sample_corpus_is_deterministic_and_pile_shaped(tmp_path):
    a = write_sample(tmp_path / "a", n_docs=60)
    b = write_sample(tmp_path / "b", n_docs=60)
    for pa_, pb in zip(a, b):
        assert pa_.read_bytes() == pb.read_bytes()
    rows = [json.loads(l) for p in a if p.suffix == ".jsonl" for l in p.read_text().splitlines()]
    assert len(rows) == 60
    assert len({r["meta"]["pile_set_name"] for r in rows}) >= 4
    assert all(r["text"].strip() for r in rows)
    zst = [p for p in a if p.name.endswith(".zst")][0]
    plain = zst.with_name(zst.name[:-4])
    assert zstandard.ZstdDecompressor().decompress(zst.read_bytes()) == plain.read_bytes()


def test_the_sample_is_the_shipped_bundle_on_every_machine_and_checked_before_reuse(tmp_path, capsys):
    """Issue 33: the sample was built from the machine's own files, so machines differed. Now it is cut from the
    shipped bundle (its sha256 checked), records its files, and a folder is reused, rewritten or refused."""
    import hashlib

    from actlake.corpus.sample import BUNDLE, BUNDLE_SHA256, check_sample, ensure_sample, sample_documents
    from actlake.errors import ConfigError
    from actlake.jobs.cli import main

    data = zstandard.ZstdDecompressor().decompress(BUNDLE.read_bytes(), max_output_size=64 << 20)
    assert hashlib.sha256(data).hexdigest() == BUNDLE_SHA256
    docs = sample_documents(400)
    assert docs == [json.loads(line) for line in data.decode().splitlines()[:400]]
    assert sorted({d["meta"]["pile_set_name"] for d in docs}) == ["DebianCopyright", "Docstrings", "Licenses",
                                                                    "PydocTopics", "PythonSource"]
    out = tmp_path / "sample"
    assert main(["corpus", "sample", str(out), "--docs", "50"]) == 0 and check_sample(out, 50, 2)
    record = json.loads((out / "SAMPLE.json").read_text())
    assert record["bundle_sha256"] == BUNDLE_SHA256 and sorted(record["sha256"]) == ["00.jsonl", "00.jsonl.zst",
                                                                                     "01.jsonl", "01.jsonl.zst"]
    before = (out / "00.jsonl").stat().st_mtime_ns
    assert ensure_sample(out, 50) is False and (out / "00.jsonl").stat().st_mtime_ns == before  # reused
    assert not check_sample(out, 60)  # other arguments: written again
    (out / "01.jsonl").write_text("{}\n")
    assert not check_sample(out, 50) and ensure_sample(out, 50) and check_sample(out, 50)  # a changed file: again
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a sample corpus written by"):
        ensure_sample(out, 50)
    assert (out / "notes.txt").read_text() == "mine"
    assert main(["corpus", "sample", str(tmp_path / "x"), "--docs", "1001"]) == 2
    assert "the sample corpus has 1 to 1,000 documents, not 1,001" in capsys.readouterr().err


def test_bad_lines_are_rejected_and_the_rest_of_the_file_runs(tmp_path):
    f = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": "good one", "meta": {"pile_set_name": "A"}}).encode(), b"{not json",
             b'{"text": "bad \xff\xfe utf8"}', b'{"text": "   "}', b"[1, 2]", b'{"other": 1}',
             json.dumps({"text": "good two"}).encode()]
    f.write_bytes(b"\n".join(lines) + b"\n")
    items = list(iter_items(str(f), "jsonl", 0, 100, "text", "meta.pile_set_name"))
    assert [type(i).__name__ for i in items] == ["Record", "Reject", "Reject", "Reject", "Reject", "Reject", "Record"]
    assert [i.reason for i in items if isinstance(i, Reject)] == [
        "malformed_json", "invalid_utf8", "empty_text", "not_an_object", "missing_text"]
    assert items[0] == Record(0, "good one", "A") and items[-1].source == "unknown"
    assert count_records(str(f), "jsonl") == 7
    assert [i.index for i in iter_items(str(f), "jsonl", 2, 4, "text", "meta.pile_set_name")] == [2, 3]


def test_truncated_zst_names_the_file(tmp_path):
    data = b"".join(json.dumps({"text": f"doc {i} " * 50}).encode() + b"\n" for i in range(200))
    f = tmp_path / "t.jsonl.zst"
    f.write_bytes(zstandard.ZstdCompressor().compress(data)[:-40])
    with pytest.raises(CorpusError, match="t.jsonl.zst"):
        list(iter_items(str(f), "jsonl", 0, 10**9, "text", "meta.pile_set_name"))


def test_parquet_reader_and_corrupt_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["a b", "", "c d"], "meta": [{"pile_set_name": "X"}] * 3}), f)
    items = list(iter_items(str(f), "parquet", 0, 10, "text", "meta.pile_set_name"))
    assert [(type(i).__name__, i.index) for i in items] == [("Record", 0), ("Reject", 1), ("Record", 2)]
    assert items[0].source == "X" and count_records(str(f), "parquet") == 3
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(f.read_bytes()[:-30])
    with pytest.raises(CorpusError, match="bad.parquet"):
        count_records(str(bad), "parquet")


def test_hostile_records_are_rejects_with_reasons(tmp_path):
    """Deep nesting (RecursionError), a 5,000-digit integer (ValueError), lone surrogates in the text or
    the source label (cannot be written as UTF-8): one reject each, the good records around them kept."""
    good = [json.dumps({"text": f"good {i}", "meta": {"pile_set_name": "A"}}).encode() for i in range(3)]
    hostile = [(b"[" * 100_000, "malformed_json"), (b"{" * 100_000, "malformed_json"),
               (b'{"text": "n", "n": ' + b"1" * 5000 + b"}", "malformed_json"),
               (b'{"text": "\\ud800 lone"}', "invalid_text"),
               (b'{"text": "fine", "meta": {"pile_set_name": "\\udfff"}}', "invalid_text")]
    lines = [good[0], *[h for h, _ in hostile], good[1], good[2]]
    f = tmp_path / "h.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    items = list(iter_items(str(f), "jsonl", 0, len(lines), "text", "meta.pile_set_name"))
    assert [(i.index, i.reason) for i in items if isinstance(i, Reject)] == [
        (k + 1, reason) for k, (_, reason) in enumerate(hostile)]
    assert [i.text for i in items if isinstance(i, Record)] == [json.loads(g)["text"] for g in good]
    assert all(len(i.detail) <= 200 and i.detail.encode("utf-8") for i in items if isinstance(i, Reject))


def test_a_range_beyond_the_end_of_the_file_names_it(tmp_path):
    """iter_range (a shard's reader) fails when the file has fewer records than the planned range."""
    f = tmp_path / "short.jsonl"
    f.write_text("".join(json.dumps({"text": f"d {i}"}) + "\n" for i in range(10)))
    assert [i.index for i in iter_range(str(f), "jsonl", 6, 10, "text", "meta.pile_set_name")] == [6, 7, 8, 9]
    with pytest.raises(CorpusError) as e:
        list(iter_range(str(f), "jsonl", 8, 12, "text", "meta.pile_set_name"))
    assert str(f) in str(e.value) and "8-11" in str(e.value) and "records 8-9" in str(e.value)
    with pytest.raises(CorpusError, match="no record"):
        list(iter_range(str(f), "jsonl", 12, 14, "text", "meta.pile_set_name"))


def test_fingerprints_full_and_sampled(tmp_path):
    """Small files are hashed whole; large ones by head/middle/tail blocks, whose mtime then counts."""
    import hashlib
    import os

    from actlake.corpus.fingerprint import FULL_HASH_LIMIT, SAMPLE_BLOCK, describe_change, file_fingerprint

    small = tmp_path / "small.jsonl"
    small.write_bytes(b"abc\n" * 1000)
    fp = file_fingerprint(str(small))
    assert fp["hash_kind"] == "full" and fp["hash"] == hashlib.sha256(small.read_bytes()).hexdigest()
    big = tmp_path / "big.jsonl"
    size = FULL_HASH_LIMIT + 3 * SAMPLE_BLOCK + 7
    with open(big, "wb") as out:
        out.truncate(size)  # sparse zeros
    a = file_fingerprint(str(big))
    assert a["hash_kind"] == "sampled" and a["size"] == size
    with open(big, "r+b") as out:  # an edit inside the middle block changes the hash
        out.seek(size // 2)
        out.write(b"x")
    b = file_fingerprint(str(big))
    assert b["hash"] != a["hash"] and describe_change(a, b) is not None
    st = os.stat(big)  # an edit between the blocks is only seen through the modification time
    with open(big, "r+b") as out:
        out.seek(SAMPLE_BLOCK + 10)
        out.write(b"y")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    c = file_fingerprint(str(big))
    assert "change time moved" in describe_change(b, c)  # the write moved the change time
    # the same edit with the modification time set back (touch -d): still seen, through the change time
    # (issue 31, item 3: it resumed silently, and a new run read the old seekable copy, keyed by this hash)
    with open(big, "r+b") as out:
        out.seek(SAMPLE_BLOCK + 20)
        out.write(b"z")
    os.utime(big, ns=(st.st_atime_ns, c["mtime_ns"]))
    d = file_fingerprint(str(big))
    assert (d["size"], d["mtime_ns"]) == (c["size"], c["mtime_ns"]) and d["hash"] != c["hash"]
    assert "change time moved" in describe_change(c, d)
    from actlake.corpus.fingerprint import check_stat
    from actlake.errors import CorpusError

    with pytest.raises(CorpusError, match="its change time moved since planning"):
        check_stat(str(big), c["size"], c["mtime_ns"], "since planning", c["ctime_ns"])
    touched = dict(fp, mtime_ns=fp["mtime_ns"] + 1)
    assert describe_change(fp, touched) is None  # a fully hashed file: same bytes, same input


def _pile_lines(n: int) -> list[bytes]:
    """``n`` jsonl lines of varied length, with a blank line, a malformed one and a CRLF ending among them."""
    import random

    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "résumé", "日本", "zeta"]
    lines = [json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(1, 60))) + f" #{i}",
                         "meta": {"pile_set_name": f"S{i % 5}"}}).encode() for i in range(n)]
    lines[n // 3], lines[n // 2] = b"", b"{broken"
    lines[n - 5] += b"\r"
    return lines


def _plain(items) -> list[tuple]:
    return [(type(i).__name__, i.index, getattr(i, "text", None), getattr(i, "source", None), getattr(i, "reason", None))
            for i in items]


@pytest.mark.parametrize("compressed", [True, False])
def test_a_shard_deep_in_a_file_decodes_only_its_own_records(tmp_path, compressed):
    """A single-frame .jsonl.zst (as The Pile ships) or a plain .jsonl, indexed every 16 records: a
    shard near the end decodes its own frame only (no record skipped, a small share of the bytes),
    and its records equal those of a plain decode of the whole file; the seekable copy decompresses
    to the original bytes; an entry point before the start skips just the records in between."""
    from actlake.corpus.index import build_index, load_points
    from actlake.corpus.readers import Entry, ReadStats

    lines = _pile_lines(2000)
    raw = b"\n".join(lines)  # no newline after the last record
    f = tmp_path / ("p.jsonl.zst" if compressed else "p.jsonl")
    f.write_bytes(zstandard.ZstdCompressor().compress(raw) if compressed else raw)
    built = build_index(str(f), "jsonl", 16, "h", 1 << 20, str(tmp_path / "idx"))
    points = load_points(built["index"])
    assert built["records"] == points["records"] == count_records(str(f), "jsonl") == 2000
    if compressed:
        copy = zstandard.ZstdDecompressor().stream_reader(open(points["file"], "rb"), read_across_frames=True).read()
        assert copy == raw and len(points["points"]) == 2000 // 16
    full = list(iter_items(str(f), "jsonl", 0, 2000, "text", "meta.pile_set_name"))
    for start, end in ((1600, 1616), (1984, 2000), (0, 16)):
        i = start // 16
        stats = ReadStats()
        got = list(iter_range(str(f), "jsonl", start, end, "text", "meta.pile_set_name",
                              entry=Entry(points["file"], points["points"][i], i * 16), stats=stats))
        assert _plain(got) == _plain(full[start:end])
        own = sum(len(l) + 1 for l in lines[start:end])
        assert stats.records_skipped == 0 and stats.bytes_decoded <= own + 64 * 1024 and stats.bytes_decoded < len(raw) / 8
    stats = ReadStats()
    got = list(iter_range(str(f), "jsonl", 1605, 1630, "text", "meta.pile_set_name",
                          entry=Entry(points["file"], points["points"][100], 1600), stats=stats))
    assert _plain(got) == _plain(full[1605:1630]) and stats.records_skipped == 5
    whole = ReadStats()  # without an entry point a read starts at the file's start, as before
    list(iter_range(str(f), "jsonl", 1600, 1616, "text", "meta.pile_set_name", stats=whole))
    assert whole.records_skipped == 1600


def test_an_index_counts_records_as_the_readers_do(tmp_path):
    """Trailing newline or not, blank last lines, fewer records than one piece, an empty file."""
    from actlake.corpus.index import build_index

    for i, data in enumerate([b"", b"{}\n", b"{}", b"{}\n\n", b"a\nb\nc\nd\n", b"a\nb\nc\nd\ne", b"\n\n\n"]):
        f = tmp_path / f"e{i}.jsonl"
        f.write_bytes(data)
        for every in (1, 2, 3):
            built = build_index(str(f), "jsonl", every, "h", 1 << 20, str(tmp_path / "idx"))
            n = count_records(str(f), "jsonl")
            assert built["records"] == n, (data, every)
            pts = json.loads(open(built["index"]).read())["points"]
            assert len(pts) == -(-n // every)
            for k, off in enumerate(pts):
                assert data[off:].split(b"\n")[0] == data.split(b"\n")[k * every]


def test_source_labels_listed_from_the_column_are_the_readers_labels(tmp_path):
    """analyses.max_sources is checked before Ray from the source column alone (column_labels): the labels of a
    row range equal those the reader gives the same rows (nested field, a missing struct, null, a number), for
    Parquet and a Hugging Face dataset saved to disk; jsonl has none to list."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actlake.corpus.readers import column_labels

    metas = [{"pile_set_name": "A"}, None, {"pile_set_name": "B"}, {"pile_set_name": None}, {"pile_set_name": "C"},
             {"pile_set_name": "A"}]
    rows = [{"text": f"text {i}", "meta": m, "n": i % 2} for i, m in enumerate(metas)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet", row_group_size=4)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    for path, fmt in ((str(tmp_path / "c.parquet"), "parquet"), (str(tmp_path / "hf"), "hf")):
        for field in ("meta.pile_set_name", "n", "absent", "meta.absent"):
            for start, end in ((0, 6), (2, 5), (5, 6), (3, 3)):
                read = {r.source for r in iter_items(path, fmt, start, end, "text", field)}
                assert column_labels(path, fmt, field, start, end) == read, (fmt, field, start, end)
    assert column_labels(str(tmp_path / "c.parquet"), "parquet", "meta.pile_set_name", 0, 6) == {"A", "B", "C", "unknown"}
    assert column_labels("x.jsonl", "jsonl", "meta.pile_set_name", 0, 6) is None


def test_parquet_reads_only_the_row_groups_of_its_range(tmp_path):
    """2,000 rows in row groups of 100: a range near the end decodes at most two row groups, and its
    records equal a plain read of the whole table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actlake.corpus.readers import ReadStats

    texts = [f"doc {i} " * (i % 7) for i in range(2000)]  # every 7th is empty
    f = tmp_path / "rg.parquet"
    pq.write_table(pa.table({"text": texts, "meta": [{"pile_set_name": f"S{i % 3}"} for i in range(2000)],
                             "other": list(range(2000))}), f, row_group_size=100)
    rows = pq.read_table(f).to_pylist()
    for start, end in ((1650, 1714), (1900, 2000), (0, 1)):
        stats = ReadStats()
        got = list(iter_range(str(f), "parquet", start, end, "text", "meta.pile_set_name", stats=stats))
        assert [i.index for i in got] == list(range(start, end))
        assert [(getattr(i, "text", None), getattr(i, "source", None)) for i in got] == [
            (r["text"], r["meta"]["pile_set_name"]) if r["text"].strip() else (None, None) for r in rows[start:end]]
        assert stats.rows_decoded <= 200


def test_a_streamed_hugging_face_dataset_is_planned_by_its_files_and_read_in_full(tmp_path):
    """A local folder of Parquet files opened with streaming=True: one shard per file, no row counted at
    planning; the shards' records are every row of the files, in order."""
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actlake.config import parse_config
    from actlake.corpus.readers import HF_STREAM, ReadStats
    from actlake.jobs.extract.plan import make_plan, plan_with_inputs

    folder = tmp_path / "ds" / "data"
    folder.mkdir(parents=True)
    expected = []
    for k in range(3):
        texts = [f"file {k} doc {j}" if j != 2 else " " for j in range(4 + k)]
        pq.write_table(pa.table({"text": texts, "meta": [{"pile_set_name": f"F{k}"}] * len(texts)}),
                       folder / f"train-{k:05d}-of-00003.parquet")
        expected.append([(t, f"F{k}") for t in texts])
    cfg = parse_config({"corpus": {"format": "hf", "hf_dataset": str(tmp_path / "ds"), "hf_streaming": True},
                        "output": {"dir": str(tmp_path / "runs")}})
    shards, inputs = plan_with_inputs(cfg)
    assert shards == make_plan(cfg) and [(s.fmt, s.start, s.end) for s in shards] == [(HF_STREAM, k, k + 1) for k in range(3)]
    assert inputs[str(tmp_path / "ds")]["hash_kind"] == "name"
    for s, want in zip(shards, expected):
        stats = ReadStats()
        got = list(iter_range(s.path, s.fmt, s.start, s.end, "text", "meta.pile_set_name", "train", stats=stats))
        assert [i.index for i in got] == list(range(len(want))) and stats.rows_decoded == len(want)
        assert [(getattr(i, "text", None), getattr(i, "source", None)) for i in got] == [
            (t, src) if t.strip() else (None, None) for t, src in want]


def test_a_damaged_seekable_copy_names_the_input_and_the_copy(tmp_path):
    """A flipped byte in the .zst copy fails its frame checksum; a truncated copy ends inside a frame:
    either way one CorpusError naming the input and the copy, never wrong records."""
    from actlake.corpus.index import build_index, load_points
    from actlake.corpus.readers import Entry

    raw = b"\n".join(_pile_lines(200)) + b"\n"
    f = tmp_path / "d.jsonl.zst"
    f.write_bytes(zstandard.ZstdCompressor().compress(raw))
    points = load_points(build_index(str(f), "jsonl", 16, "h", 1 << 20, str(tmp_path / "idx"))["index"])
    copy = points["file"]
    good = open(copy, "rb").read()
    for damaged in (good[: points["points"][5] + 50], good[:points["points"][5] + 30] + bytes([good[points["points"][5] + 30] ^ 1]) + good[points["points"][5] + 31:]):
        open(copy, "wb").write(damaged)
        with pytest.raises(CorpusError) as e:
            list(iter_range(str(f), "jsonl", 80, 96, "text", "meta.pile_set_name", entry=Entry(copy, points["points"][5], 80)))
        assert str(f) in str(e.value) and copy in str(e.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_a_line_over_the_cap_is_a_reject_and_never_held(tmp_path, suffix):
    """A 98 KB .jsonl.zst holding one 3 GiB line took 3.2 GB of memory to index (issue 31, item 3). Lines
    over ``corpus.max_line_bytes`` are skipped as they stream by: planning and reading hold at most the cap."""
    import subprocess
    import sys

    import zstandard

    from actlake.corpus.index import load_points
    from actlake.corpus.readers import Entry, Record, Reject, iter_jsonl

    f = tmp_path / f"c{suffix}"
    huge = 1 << 30 if suffix == ".jsonl.zst" else 8 << 20  # a plain file takes the disk's bytes
    with open(f, "wb") as raw:
        out = zstandard.ZstdCompressor(level=1).stream_writer(raw) if suffix.endswith(".zst") else raw
        out.write(b'{"text": "one"}\n{"text": "')
        block = b"a" * (1 << 20)
        for _ in range(huge >> 20):  # written a block at a time: this process holds none of it either
            out.write(block)
        out.write(b'"}\n{"text": "three"}\n{"text": "four"}')  # the last line has no newline
        out.close() if out is not raw else None
    cap = 1 << 20
    probe = ("import json\nfrom actlake.corpus.index import build_index\n"
             f"built = build_index({str(f)!r}, 'jsonl', 2, 'h', {cap}, {str(tmp_path / 'idx')!r})\n"
             "print(json.dumps(built))\n"
             "print(next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM')))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    built, peak_kib = json.loads(done.stdout.splitlines()[0]), int(done.stdout.splitlines()[1])
    assert built["records"] == 4 and peak_kib < 400 * 1024, f"{peak_kib / 1024:.0f} MiB"
    points = load_points(built["index"])
    items = []
    for k, start in enumerate(range(0, 4, 2)):
        entry = Entry(points["file"], points["points"][k], start)
        items += list(iter_jsonl(str(f), start, start + 2, "text", "src", entry, max_line=cap))
    assert [type(i) for i in items] == [Record, Reject, Record, Record]
    assert items[1].reason == "line_too_long" and items[1].detail.startswith(f"{huge + 12} bytes")
    assert [i.text for i in items if isinstance(i, Record)] == ["one", "three", "four"]
    # read from the start of the input too (no entry point)
    whole = list(iter_jsonl(str(f), 0, 4, "text", "src", max_line=cap))
    assert [getattr(i, "reason", None) for i in whole] == [None, "line_too_long", None, None]

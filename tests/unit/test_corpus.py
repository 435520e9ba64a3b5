import json

import pytest
import zstandard

from actlake.corpus.readers import Record, Reject, count_records, iter_items
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

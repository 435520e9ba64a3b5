"""The shard plan: deterministic, and record counts cached by the file's fingerprint."""

import json
import os

from actlake.config import parse_config
from actlake.jobs.extract.plan import COUNT_CACHE, make_plan, plan_hash, plan_with_inputs


def _cfg(corpus, out, **sharding):
    return parse_config({"corpus": {"paths": [str(corpus / "*.jsonl")]}, "output": {"dir": str(out)},
                         "sharding": sharding or {"docs_per_shard": 3}})


def test_plan_is_deterministic_and_covers_every_record(tmp_path):
    (tmp_path / "c").mkdir()
    for name, n in (("a.jsonl", 7), ("b.jsonl", 4)):
        (tmp_path / "c" / name).write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(n)))
    cfg = _cfg(tmp_path / "c", tmp_path / "runs")
    a, b = make_plan(cfg), make_plan(cfg)
    assert a == b and plan_hash(cfg, a) == plan_hash(cfg, b)
    assert [(s.shard_id, s.start, s.end, s.doc_offset) for s in a] == [
        (0, 0, 3, 0), (1, 3, 6, 0), (2, 6, 7, 0), (3, 0, 3, 7), (4, 3, 4, 7)]
    capped = parse_config({**cfg.to_dict(), "corpus": {**cfg.to_dict()["corpus"], "max_docs": 8}})
    assert sum(s.end - s.start for s in make_plan(capped)) == 8


def test_record_counts_are_cached_by_fingerprint(tmp_path):
    """The cache answers for an unchanged file (without reading it again), never for changed content,
    even when size and mtime are the same."""
    (tmp_path / "c").mkdir()
    f = tmp_path / "c" / "a.jsonl"
    f.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(6)))
    cfg = _cfg(tmp_path / "c", tmp_path / "runs")
    cache_file = tmp_path / "runs" / COUNT_CACHE
    assert sum(s.end - s.start for s in make_plan(cfg)) == 6
    cache = json.loads(cache_file.read_text())
    assert cache[str(f)]["records"] == 6
    written = os.stat(cache_file).st_ino  # the cache is replaced (new inode) whenever it is written
    assert sum(s.end - s.start for s in make_plan(cfg)) == 6 and os.stat(cache_file).st_ino == written  # a hit
    st = os.stat(f)
    text = f.read_text()
    f.write_text(text.replace("\n", " ", 2))  # two records joined: same size, fewer lines; mtime put back below
    assert os.path.getsize(f) == st.st_size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    expected = len(f.read_bytes().splitlines())
    assert expected != 6
    assert sum(s.end - s.start for s in make_plan(cfg)) == expected  # counted again: the content hash moved
    assert json.loads(cache_file.read_text())[str(f)]["records"] == expected


def test_plan_hash_ignores_the_files_stat_and_inputs_are_fingerprinted(tmp_path):
    """A file touched with the same bytes keeps its plan hash; every planned file has a fingerprint."""
    (tmp_path / "c").mkdir()
    f = tmp_path / "c" / "a.jsonl"
    f.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(5)))
    cfg = _cfg(tmp_path / "c", tmp_path / "runs")
    shards, inputs = plan_with_inputs(cfg)
    st = os.stat(f)
    assert set(inputs) == {str(f)} and inputs[str(f)]["size"] == st.st_size and inputs[str(f)]["hash_kind"] == "full"
    assert all((s.size, s.mtime_ns) == (st.st_size, st.st_mtime_ns) for s in shards)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again, inputs2 = plan_with_inputs(cfg)
    assert again != shards and plan_hash(cfg, again) == plan_hash(cfg, shards)
    assert inputs2[str(f)]["hash"] == inputs[str(f)]["hash"]


def test_a_hugging_face_dataset_is_fingerprinted_by_its_own_fingerprint(tmp_path):
    """A dataset saved again with other rows (same count) under the same folder is a changed input."""
    datasets = __import__("pytest").importorskip("datasets")
    from actlake.corpus.fingerprint import first_change

    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["one doc", "two doc", "three"]}).save_to_disk(folder)
    cfg = parse_config({"corpus": {"format": "hf", "hf_dataset": str(folder)}, "output": {"dir": str(tmp_path / "runs")},
                        "sharding": {"docs_per_shard": 2}})
    shards, inputs = plan_with_inputs(cfg)
    assert [(s.start, s.end, s.size) for s in shards] == [(0, 2, None), (2, 3, None)]
    assert inputs[str(folder)]["hash_kind"] == "datasets" and inputs[str(folder)]["rows"] == 3
    assert first_change(inputs, plan_with_inputs(cfg)[1]) is None
    datasets.Dataset.from_dict({"text": ["one doc", "2 doc", "three"]}).save_to_disk(str(folder) + ".new")
    __import__("shutil").rmtree(folder)
    os.replace(str(folder) + ".new", folder)
    assert first_change(inputs, plan_with_inputs(cfg)[1]) == (str(folder), "content changed (same number of rows, different hash)")


def test_jsonl_shards_start_at_entry_points_built_once_in_parallel(tmp_path, monkeypatch):
    """Every jsonl shard gets an entry point at its first record, in the file or in the seekable copy of
    a .zst; the same plan comes from two index processes and from one, and a second plan reads no
    input (the index is cached by fingerprint); a smaller shard size that the index's spacing does not
    divide gets a new index."""
    import zstandard

    from actlake.corpus import index
    from actlake.corpus.readers import Record, iter_items, iter_range

    (tmp_path / "c").mkdir()
    for name, n in (("a.jsonl", 23), ("b.jsonl.zst", 17), ("c.jsonl", 9)):
        data = "".join(json.dumps({"text": f"{name} d{i}"}) + "\n" for i in range(n)).encode()
        (tmp_path / "c" / name).write_bytes(zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data)
    corpus = {"paths": [str(tmp_path / "c" / "*.jsonl*")]}
    parallel = parse_config({"corpus": corpus, "output": {"dir": str(tmp_path / "p")}, "sharding": {"docs_per_shard": 4, "plan_workers": 2}})
    serial = parse_config({"corpus": corpus, "output": {"dir": str(tmp_path / "s")}, "sharding": {"docs_per_shard": 4, "plan_workers": 1}})
    monkeypatch.setattr(index, "PARALLEL_MIN_BYTES", 0)
    shards = make_plan(parallel)
    assert [(s.start, s.end) for s in shards] == [(s.start, s.end) for s in make_plan(serial)]
    assert plan_hash(parallel, shards) != plan_hash(serial, make_plan(serial))  # configs differ (output.dir)...
    assert [s.entry_offset for s in shards] == [s.entry_offset for s in make_plan(serial)]  # ...the entry points do not
    for s in shards:
        assert s.entry_record == s.start and s.entry_file.endswith(".jsonl.zst") == s.path.endswith(".zst")
        got = list(iter_range(s.path, s.fmt, s.start, s.end, "text", "meta.pile_set_name", entry=s.entry()))
        assert got == list(iter_items(s.path, s.fmt, 0, 10**9, "text", "meta.pile_set_name"))[s.start:s.end]
        assert all(isinstance(i, Record) for i in got)
    built = {p: os.stat(p).st_ino for p in (tmp_path / "p" / index.INDEX_DIR).iterdir()}
    monkeypatch.setattr(index, "build_index", None)  # a second plan must not index anything
    assert make_plan(parallel) == shards
    assert {p: os.stat(p).st_ino for p in (tmp_path / "p" / index.INDEX_DIR).iterdir()} == built
    monkeypatch.undo()
    eight = parse_config({**parallel.to_dict(), "sharding": {"docs_per_shard": 8, "plan_workers": 1}})
    assert all(s.entry_record == s.start for s in make_plan(eight))  # 4 divides 8: the same index
    three = parse_config({**parallel.to_dict(), "sharding": {"docs_per_shard": 3, "plan_workers": 1}})
    assert all(s.entry_record == s.start for s in make_plan(three))  # a new index, every 3 records


def test_corpus_index_command_builds_what_the_first_run_would(tmp_path, capsys, monkeypatch):
    """``actlake corpus index CONFIG`` counts and indexes the files; a plan afterwards indexes nothing."""
    from actlake.corpus import index
    from actlake.jobs.cli import main

    (tmp_path / "c").mkdir()
    f = tmp_path / "c" / "a.jsonl"
    f.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(7)))
    cfg = _cfg(tmp_path / "c", tmp_path / "runs")
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps(cfg.to_dict()))
    assert main(["corpus", "index", str(config)]) == 0
    assert f"{f}: 7 records in 3 shards" in capsys.readouterr().out
    monkeypatch.setattr(index, "build_index", None)
    assert [s.entry_record for s in make_plan(cfg)] == [0, 3, 6]

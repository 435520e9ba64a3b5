"""The shard plan: deterministic, and record counts cached by file size and mtime."""

import json
import os

from actlake.config import parse_config
from actlake.jobs.plan import COUNT_CACHE, make_plan, plan_hash


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


def test_record_counts_are_cached_by_size_and_mtime(tmp_path):
    (tmp_path / "c").mkdir()
    f = tmp_path / "c" / "a.jsonl"
    f.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(6)))
    cfg = _cfg(tmp_path / "c", tmp_path / "runs")
    assert sum(s.end - s.start for s in make_plan(cfg)) == 6
    cache = json.loads((tmp_path / "runs" / COUNT_CACHE).read_text())
    assert cache[str(f)]["records"] == 6
    st = os.stat(f)
    f.write_text(f.read_text().replace("\n", " ", 2) + "\n\n")  # same size, fewer/more lines, same mtime
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert sum(s.end - s.start for s in make_plan(cfg)) == 6  # the cache answered
    f.write_text(f.read_text() + json.dumps({"text": "new"}) + "\n")  # size changed: counted again
    assert sum(s.end - s.start for s in make_plan(cfg)) == len(f.read_text().splitlines())

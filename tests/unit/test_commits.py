"""Which commit records readers accept (storage/shards.py ``committed``), on real files."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from actlake.storage.layout import RunLayout
from actlake.storage.parquet_io import write_parquet
from actlake.storage.shards import committed


def _record(layout: RunLayout, gid: str, shards: dict, partials: dict, name: str | None = None) -> None:
    rec = {"group": gid, "plan_hash": "p", "partials": partials, "shards": shards}
    (layout.complete / (name or f"group-{gid}.json")).write_text(json.dumps(rec))


def test_only_records_that_say_what_they_are_are_accepted(tmp_path):
    layout = RunLayout(tmp_path)
    layout.complete.mkdir()
    t = pa.table({"a": [1, 2]})
    files = {}
    for sid in (0, 1):
        p = layout.shard_file("documents", sid)
        files[sid] = {"documents": {"path": layout.relative(p), "rows": 2, "bytes": write_parquet(t, p)}}
    g0, g1 = "0" * 19 + "1-" + "a" * 8, "0" * 19 + "2-" + "b" * 8
    p = layout.partial_file("x", g0)
    partial = {"x": {"path": layout.relative(p), "rows": 2, "bytes": write_parquet(t, p)}}
    _record(layout, g0, {"0": {"files": files[0], "summary": {}}}, partial)
    _record(layout, g0, {}, partial, name=f"group-{g1}.json")  # the same group again under another name, no shards
    _record(layout, "0" * 19 + "5-" + "e" * 8, {"01": {"files": files[1], "summary": {}}}, {})  # a shard id not plain
    _record(layout, "0" * 19 + "3-" + "c" * 8, {"0": {"files": files[0], "summary": {}}}, {})  # shard 0 again
    link = layout.shard_file("documents", 1)
    os.replace(link, tmp_path / "outside.parquet")
    os.symlink(tmp_path / "outside.parquet", link)  # a link in the run is no file of it
    _record(layout, "0" * 19 + "4-" + "d" * 8, {"1": {"files": files[1], "summary": {}}}, {})
    done = committed(layout, "p")
    assert sorted(done.shards) == [0] and [g["group"] for g in done.groups] == [g0]
    assert len(done.skipped) == 4, done.skipped


def test_a_late_record_cannot_take_shards_from_a_group_accepted_before_it(tmp_path):
    """A worker that hung mid-commit chose its group id (and so its record's name) before the shards were
    run again and committed by another group; its record, arriving last, sorted first by name and took
    them over (issue 31, item 3)."""
    import time

    layout = RunLayout(tmp_path)
    layout.complete.mkdir()
    t = pa.table({"a": [1, 2]})
    p = layout.shard_file("documents", 0)
    files = {"documents": {"path": layout.relative(p), "rows": 2, "bytes": write_parquet(t, p)}}
    early_name, accepted = "0" * 19 + "1-" + "a" * 8, "0" * 19 + "2-" + "b" * 8
    _record(layout, accepted, {"0": {"files": files, "summary": {}}}, {})
    assert [g["group"] for g in committed(layout, "p").groups] == [accepted]
    time.sleep(0.05)  # the hung worker's record arrives later
    _record(layout, early_name, {"0": {"files": files, "summary": {}}}, {})
    done = committed(layout, "p")
    assert [g["group"] for g in done.groups] == [accepted] and done.shards[0]["group"] == accepted
    assert done.skipped == [f"group-{early_name}.json: shard 00000 is already in group {accepted}"]


def test_malformed_records_are_named_not_tracebacks(tmp_path):
    """A record without ``rows`` killed the reduce step (KeyError); malformed run.json and reduced.json gave
    AttributeError/KeyError tracebacks (issue 31, item 3)."""
    import pytest

    from actlake.errors import StorageError
    from actlake.storage.layout import write_json_atomic
    from actlake.storage.manifest import committed_files

    layout = RunLayout(tmp_path)
    layout.complete.mkdir()
    t = pa.table({"a": [1, 2]})
    p = layout.shard_file("documents", 0)
    size = write_parquet(t, p)
    gid = "0" * 19 + "1-" + "a" * 8
    _record(layout, gid, {"0": {"files": {"documents": {"path": layout.relative(p), "bytes": size}}, "summary": {}}}, {})
    done = committed(layout, "p")
    assert done.shards == {} and done.skipped == [f"group-{gid}.json: its entry for table documents is not a path "
                                                  "with rows and bytes"]
    for run_json, message in (([1, 2], "not a run record"), ({"plan_hash": "p", "shards": [3]}, "not a run record")):
        write_json_atomic(layout.run_json, run_json)
        with pytest.raises(StorageError, match=message):
            committed_files(layout)
    write_json_atomic(layout.run_json, {"format": 2, "plan_hash": "p", "shards": [{"shard_id": 0}]})
    write_json_atomic(layout.complete / "reduced.json", {"plan_hash": "p", "files": ["tables/x/part-0.parquet"]})
    with pytest.raises(StorageError, match=r"reduced.json: its files are not table -> \{path, bytes\}"):
        committed_files(layout)


def test_a_run_format_that_is_not_a_number_is_refused_by_name(tmp_path):
    from actlake.errors import StorageError
    from actlake.storage.layout import RunLayout, write_json_atomic
    from actlake.storage.manifest import committed_files

    layout = RunLayout(tmp_path)
    for bad in ("2", None, True, 3):
        write_json_atomic(layout.run_json, {"format": bad, "plan_hash": "p", "shards": [{"shard_id": 0}]})
        with pytest.raises(StorageError, match=rf"run format {bad!r} .* reads format 2: run the job again under a new "
                                               r"run id, or delete the folder"):
            committed_files(layout)

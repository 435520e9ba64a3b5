"""Fault injection on real Ray: killed workers, out-of-memory batches, damaged files, bad input.

Every test compares with a clean run of the same corpus: results must be equal row for row.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import zstandard

from actlake.errors import ActlakeError, StorageError
from actlake.jobs.extract.run import run_job
from actlake.storage.sql import open_run
from tests.conftest import job_config, own_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TABLES = ("tokens", "residual_norms", "documents", "dim_moments", "attention_mass", "contributions",
          "attention_geometry", "attention_by_distance")


def snapshot(run_dir, tables=TABLES) -> dict:
    con = open_run(run_dir)
    out = {}
    for t in tables:
        cols = [d[0] for d in con.execute(f"SELECT * FROM {t} LIMIT 0").description if d[0] not in ("shard", "file")]
        out[t] = con.execute(f"SELECT {', '.join(cols)} FROM {t} ORDER BY ALL").fetchall()
    return out


def assert_same(a: dict, b: dict, rtol: float = 1e-9) -> None:
    """Equal row for row; float columns to ``rtol`` of the column's largest magnitude (1e-9: same
    batches; looser when batches differ, since a window's activations then differ at float32
    rounding, which sums with cancellation amplify)."""
    import numpy as np

    for t in a:
        assert len(a[t]) == len(b[t]), t
        if not a[t]:
            continue
        for i, (ca, cb) in enumerate(zip(zip(*a[t]), zip(*b[t]))):
            if isinstance(ca[0], float):
                x, y = np.array(ca, dtype=float), np.array(cb, dtype=float)
                scale = max(1e-12, float(np.nanmax(np.abs(x))))
                assert np.allclose(x, y, rtol=rtol, atol=rtol * scale, equal_nan=True), (t, i, np.abs(x - y).max(), scale)
            else:
                assert ca == cb, (t, i)


@pytest.fixture(scope="module")
def clean(minilm_path, sample_corpus, tmp_path_factory, ray_local):
    out = tmp_path_factory.mktemp("clean")
    cfg = job_config(minilm_path, sample_corpus, out, **{"corpus.max_docs": 20, "sharding.docs_per_shard": 2})
    res = run_job(cfg)
    return res, snapshot(res.run_dir)


def _shard_workers():
    return own_processes("ShardWorker")


def test_killed_workers_leave_the_same_tables_and_readers_see_whole_shards(minilm_path, sample_corpus, tmp_path, clean,
                                                                           ray_local):
    clean_res, clean_tables = clean
    cfg = job_config(minilm_path, sample_corpus, tmp_path,
                     **{"corpus.max_docs": 20, "sharding.docs_per_shard": 2, "resources.max_retries": 6,
                        "sharding.commit_seconds": 2.0,  # groups of a few shards: kills land before and after commits
                        "resources.read_ahead": True,  # two shards in hand: both go back to the queue
                        "resources.read_in_process": True})  # read by a process of each worker's own
    kills, seen, reader_errors = [], [], []
    done = threading.Event()
    rng = random.Random(7)

    def killer():
        time.sleep(3)
        while not done.is_set() and len(kills) < 3:
            pids = _shard_workers()
            if pids:
                pid = rng.choice(pids)
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(rng.uniform(1.5, 4.0))

    def reader():
        while not done.is_set():
            try:
                if any((Path(cfg.run_dir) / "_complete").glob("group-*.json")):  # views show committed shards only
                    con = open_run(cfg.run_dir)
                    seen.append(dict(con.execute("SELECT shard, count(*) FROM tokens GROUP BY shard").fetchall()))
                    con.close()
            except Exception as e:  # noqa: BLE001 - any error is a failure of the guarantee
                reader_errors.append(repr(e))
            time.sleep(0.2)

    threads = [threading.Thread(target=killer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    try:
        res = run_job(cfg)
    finally:
        done.set()
        for t in threads:
            t.join()
    assert len(kills) >= 2, "the job finished before the workers could be killed"
    assert reader_errors == []
    final = dict(open_run(res.run_dir).execute("SELECT shard, count(*) FROM tokens GROUP BY shard").fetchall())
    assert any(seen) and all(counts[s] == final[s] for counts in seen for s in counts)  # whole shards only
    con = open_run(res.run_dir)
    n, distinct = con.execute("SELECT count(*), count(DISTINCT (doc_id, window_index, position)) FROM tokens").fetchall()[0]
    assert n == distinct
    assert_same(snapshot(res.run_dir), clean_tables)
    # the cluster is whole again: every CPU free once the job's actors are gone
    deadline = time.monotonic() + 30
    while ray_local.available_resources().get("CPU", 0) < ray_local.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_local.available_resources().get("CPU", 0) == ray_local.cluster_resources()["CPU"]


def _process_in_process(cfg, ex) -> list[dict]:
    """Plan, process every shard with ``ex`` in this process, commit, reduce: a job without Ray."""
    from actlake.analysis.registry import enabled
    from actlake.jobs.extract.group import OpenGroup as Group
    from actlake.jobs.extract.plan import make_plan, plan_hash
    from actlake.jobs.extract.reduce import reduce_run
    from actlake.jobs.extract.run import prepare_run_dir
    from actlake.storage.layout import RunLayout

    shards = make_plan(cfg)
    phash = plan_hash(cfg, shards)
    layout = RunLayout(cfg.run_dir)
    prepare_run_dir(cfg, layout, shards, phash)
    group = Group(layout, phash)
    summaries = [ex.process(s, layout, group) for s in shards]
    assert group.commit() == [s.shard_id for s in shards]
    reduce_run(layout, [s.shard_id for s in shards], phash, [cls for cls, _ in enabled(cfg)])
    return summaries


def test_out_of_memory_batches_are_split_and_give_the_same_numbers(minilm_path, sample_corpus, tmp_path, clean):
    """Inject torch.OutOfMemoryError for batches of more than 3 windows, in-process."""
    from actlake.jobs.extract.driver import Extractor
    from actlake.model import load_model

    _, clean_tables = clean
    cfg = job_config(minilm_path, sample_corpus, tmp_path, **{"corpus.max_docs": 20, "sharding.docs_per_shard": 2})
    ex = Extractor(cfg, load_model(cfg.model))
    real_forward = ex.lm.model.forward

    def forward(*args, **kwargs):
        if kwargs["input_ids"].shape[0] > 3:
            raise torch.OutOfMemoryError("injected: out of memory")
        return real_forward(*args, **kwargs)

    ex.lm.model.forward = forward
    summaries = _process_in_process(cfg, ex)
    assert ex.forward.oom_splits > 0 and sum(s["oom_splits"] for s in summaries) == ex.forward.oom_splits
    assert_same(snapshot(cfg.run_dir), clean_tables, rtol=1e-4)


def test_a_failed_device_check_reruns_its_batch_strictly_and_the_tables_equal_a_strict_run(
        minilm_path, sample_corpus, tmp_path, caplog):
    """The GPU's way on a CPU (``Extractor.strict = False``: checks counted on the device and read once per
    batch, each batch queued before the previous one's results are read). A NaN in the final hidden state
    of the first real token of every window whose second token id is even fails those batches' checks;
    they run again strictly, which leaves the token out of that layer's moments, and every table equals
    that of a run that was strict throughout."""
    from actlake.architectures import blocks
    from actlake.jobs.extract.driver import Extractor
    from actlake.model import load_model

    def run(strict: bool, out):
        cfg = job_config(minilm_path, sample_corpus, out, **{"corpus.max_docs": 12, "sharding.docs_per_shard": 4,
                                                              "batching.max_tokens": 192})
        ex = Extractor(cfg, load_model(cfg.model))
        ex.forward.strict = strict
        ids_of_call = {}

        def keep_ids(module, args, kwargs):
            ids_of_call["ids"] = kwargs["input_ids"]

        def poison(module, args, output):  # the last block's output: hidden state L (BERT has no final norm)
            h = output[0] if isinstance(output, tuple) else output
            rows = (ids_of_call["ids"][:, 1] % 2 == 0).nonzero().flatten()
            h[rows, 1] = float("nan")

        ex.lm.model.register_forward_pre_hook(keep_ids, with_kwargs=True)
        blocks(ex.lm.model, ex.lm.family)[-1].register_forward_hook(poison)
        _process_in_process(cfg, ex)
        return snapshot(cfg.run_dir), cfg.run_dir

    with caplog.at_level("WARNING", logger="actlake.extract"):
        lenient, _ = run(False, tmp_path / "lenient")
    reruns = [r for r in caplog.records if "running the batch again strictly" in r.message]
    caplog.clear()
    with caplog.at_level("WARNING", logger="actlake.extract"):
        strict, run_dir = run(True, tmp_path / "strict")
    assert reruns and not [r for r in caplog.records if "again strictly" in r.message]
    assert_same(lenient, strict, rtol=1e-12)
    nonfinite = open_run(run_dir).execute("SELECT layer, sum(nonfinite_tokens) FROM dim_moments WHERE scheme = 'all' "
                                          "AND nonfinite_tokens > 0 GROUP BY layer").fetchall()
    assert len(nonfinite) == 1 and nonfinite[0][0] == 6 and nonfinite[0][1] > 0, nonfinite


def test_a_flipped_byte_is_named_and_no_report_is_published(minilm_path, sample_corpus, tmp_path, ray_local):
    cfg = job_config(minilm_path, sample_corpus, tmp_path, **{"corpus.max_docs": 4, "sharding.docs_per_shard": 2,
                                                              "sharding.commit_seconds": 0.001})  # a group per shard
    res = run_job(cfg)
    victim = sorted((Path(res.run_dir) / "tables" / "residual_norms").rglob("*.parquet"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    report = Path(res.run_dir) / "report"
    with pytest.raises(StorageError, match=str(victim.name)):
        run_job(cfg, report=True)
    assert not (report / "report.html").exists()
    victim.write_bytes(victim.read_bytes()[:-100])  # truncated: size no longer matches the record
    again = run_job(cfg)  # the shard (its group) is rerun and the tables repaired
    assert again.shards_run == 1


def test_truncated_zst_is_named_before_any_work_and_nothing_is_marked_complete(minilm_path, sample_corpus, tmp_path,
                                                                               ray_local):
    """Planning reads every file once (to count records), so a truncated file stops the job before
    any shard runs, naming the file; a rerun after fixing the file runs everything."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    good = (sample_corpus / "00.jsonl.zst").read_bytes()
    (corpus / "a.jsonl.zst").write_bytes(good)
    (corpus / "b.jsonl.zst").write_bytes(good[: len(good) // 2])  # cut mid-frame
    cfg = job_config(minilm_path, corpus, tmp_path / "runs", **{"corpus.max_docs": None, "sharding.docs_per_shard": 50})
    with pytest.raises(ActlakeError) as e:
        run_job(cfg)
    assert "b.jsonl.zst" in str(e.value) and "truncated" in str(e.value)
    assert not list((Path(cfg.run_dir) / "_complete").glob("*.json"))
    (corpus / "b.jsonl.zst").write_bytes(good)
    res = run_job(cfg)
    assert res.shards_run == res.shards_total == 2


def test_bad_records_are_counted_and_the_rest_equals_a_clean_corpus(minilm_path, sample_corpus, tmp_path, ray_local):
    lines = (sample_corpus / "00.jsonl").read_bytes().splitlines()[:12]
    bad = {2: b"{not json", 5: b'{"text": "caf\xe9 au lait"}', 7: b'{"text": ""}', 9: b'{"text": "   \\n "}'}
    long_doc = json.dumps({"text": "word " * 20000, "meta": {"pile_set_name": "Long"}}).encode()
    dirty, clean_lines = [], []
    for i, line in enumerate(lines):
        dirty.append(bad.get(i, line))
        if i not in bad:
            clean_lines.append(line)
    dirty.append(long_doc)
    clean_lines.append(long_doc)
    (tmp_path / "dirty").mkdir()
    (tmp_path / "clean").mkdir()
    (tmp_path / "dirty" / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(dirty) + b"\n"))
    (tmp_path / "clean" / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(clean_lines) + b"\n"))
    over = {"corpus.max_docs": None, "sharding.docs_per_shard": 4}
    d = run_job(job_config(minilm_path, tmp_path / "dirty", tmp_path / "rd", **over))
    c = run_job(job_config(minilm_path, tmp_path / "clean", tmp_path / "rc", **over))
    assert d.totals["rejects"] == {"malformed_json": 1, "invalid_utf8": 1, "empty_text": 2}
    rejects = open_run(d.run_dir).execute("SELECT record, reason FROM rejects ORDER BY record").fetchall()
    assert rejects == [(2, "malformed_json"), (5, "invalid_utf8"), (7, "empty_text"), (9, "empty_text")]
    # the over-long document is cut into at most max_windows_per_doc windows, not dropped
    assert open_run(d.run_dir).execute("SELECT n_windows, cut FROM documents WHERE source = 'Long'").fetchall()[0] == (2, True)
    assert d.totals["cut_docs"] == open_run(d.run_dir).execute("SELECT count(*) FROM documents WHERE cut").fetchall()[0][0] >= 1
    # same documents (ids differ by the skipped lines): compare text-level results
    q = "SELECT source, window_index, position, token_id FROM tokens ORDER BY ALL"
    assert open_run(d.run_dir).execute(q).fetchall() == open_run(c.run_dir).execute(q).fetchall()
    for table in ("dim_moments", "attention_mass", "contributions"):
        assert_same(snapshot(d.run_dir, (table,)), snapshot(c.run_dir, (table,)), rtol=1e-4)


def test_losing_nodes_mid_job_leaves_the_same_tables(minilm_path, sample_corpus, tmp_path, clean, own_ray_env):
    """A 4-node ray.cluster_utils.Cluster (head without CPUs, three 1-CPU nodes, one worker each); one node is
    lost as the workers start, another after two shards are committed (``node_loss_job.py``). A node lost
    while its worker started left the job waiting for good with 9 of 10 shards done (seen in CI, then
    reproduced): the call sent to that worker waited for a restart that found no room."""
    import subprocess
    import sys

    _, clean_tables = clean
    cfg = job_config(minilm_path, sample_corpus, tmp_path,
                     **{"corpus.max_docs": 20, "sharding.docs_per_shard": 2, "resources.num_workers": 3,
                        "sharding.commit_seconds": 0.001})  # a group per shard: the node goes mid-job
    cfg_file, out_file = tmp_path / "cfg.json", tmp_path / "result.json"
    cfg_file.write_text(json.dumps(cfg.to_dict()))
    root = Path(__file__).resolve().parents[2]
    try:  # about 30-50 s
        proc = subprocess.run([sys.executable, "-m", "tests.integration.node_loss_job", str(cfg_file), str(out_file)],
                              check=False, cwd=root, capture_output=True, text=True, timeout=300, env=own_ray_env)
    except subprocess.TimeoutExpired as e:  # say where it hung: the job's stage lines and Ray's last words
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        stages = [line for line in err.splitlines() if line.startswith("node_loss_job:")]
        commits = len(list((Path(cfg.run_dir) / "_complete").glob("group-*.json")))
        pytest.fail(f"the node-loss job hung: stages {stages}, {commits} groups committed, result written: "
                    f"{out_file.exists()}\n{err[-4000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out_file.read_text())
    assert result["removed_after_shards"] >= 2 and result["shards_run"] == result["shards_total"] == 10
    assert result["alive_nodes"] == 2 and result["cpu_available"] == result["cpu_total"] == 1
    assert_same(snapshot(cfg.run_dir), clean_tables)

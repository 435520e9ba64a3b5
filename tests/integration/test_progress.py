"""Progress from the first batch (issue 33): workers report every batch to the driver, which shows documents,
tokens, tokens/s and an ETA while a shard is still running, and one line per finished shard. The same job,
with neither residual norms nor dimension moments, has a report."""

from __future__ import annotations

import logging
import re
import time

import pytest

pytestmark = pytest.mark.integration


def test_progress_moves_batch_by_batch_inside_a_shard(minilm_path, sample_corpus, tmp_path, ray_local, caplog,
                                                      monkeypatch):
    """Two jobs one after the other, counted by one actor: the second's progress counts only its own batches."""
    from actlake.config import parse_config
    from actlake.jobs.extract import dispatch, progress
    from actlake.jobs.extract.run import run_job

    monkeypatch.setattr(dispatch, "TICK_S", 0.05)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    data = {"name": "progress", "model": {"name_or_path": minilm_path},
            "corpus": {"paths": [str(sample_corpus / "*.jsonl.zst")], "max_docs": 16},
            "tokenization": {"max_length": 64, "max_windows_per_doc": 2}, "sharding": {"docs_per_shard": 16},
            "batching": {"max_tokens": 128},
            "analyses": {"contributions": False, "geometry": False, "residual_norms": False, "dim_moments": False},
            "output": {"dir": str(tmp_path / "runs"), "run_id": "p", "report": False},
            "resources": {"num_workers": 1, "cpus_per_worker": 1}}
    with caplog.at_level(logging.INFO, logger="actlake.progress"):
        first = run_job(parse_config(data | {"output": data["output"] | {"run_id": "p0"}}))
        counter = progress._counter[1]
        caplog.clear()
        res = run_job(parse_config(data))
    assert progress._counter[1] == counter  # the jobs of one Ray session count with one actor
    assert res.totals["tokens"] == first.totals["tokens"]  # ... each job its own batches (checked below)
    lines = [r.getMessage() for r in caplog.records if r.name == "actlake.progress"]
    moving = [ln for ln in lines if ln.startswith("documents ")]
    done = [ln for ln in lines if ln.startswith("shard ")]
    assert res.shards_total == 1 and len(done) == 1, lines
    assert done[0].startswith(f"shard 00000 done (1/1): {res.totals['tokens']:,} tokens of 16 documents"), done
    tokens = [int(re.search(r"  ([\d,]+) tokens,", ln).group(1).replace(",", "")) for ln in moving]
    assert tokens == sorted(tokens) and tokens[-1] == res.totals["tokens"], moving
    assert any(0 < t < res.totals["tokens"] for t in tokens), moving  # seen inside the one shard: per batch
    assert moving[-1].startswith("documents 16/16") and "tokens/s" in moving[-1]
    assert any("ETA" in ln for ln in moving if not ln.startswith("documents 16/16")), moving

    # a job with neither residual norms nor dimension moments still has a report (issue 33: it exited 2)
    from actlake.jobs.extract.report import build_report

    page = build_report(res.run_dir).read_text()
    assert "attention_mass" in page and "residual_norms" not in page

    # the summary records what the numbers depend on besides the config (issue 33): the corpus and the versions
    import hashlib
    import json
    from importlib import metadata
    from pathlib import Path

    run = Path(res.run_dir)
    recorded = json.loads((run / "summary.json").read_text())["provenance"]
    files = json.loads((run / "run.json").read_text())["inputs"]
    assert files and all(Path(f).stat().st_size < 1 << 20 for f in files)  # small: hashed whole
    want = hashlib.sha256("\n".join(sorted(hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in files)).encode())
    assert recorded["corpus_fingerprint"] == want.hexdigest()
    assert {k: recorded["versions"][k] for k in ("actlake", "torch", "transformers", "tokenizers")} == {
        k: metadata.version(k) for k in ("actlake", "torch", "transformers", "tokenizers")}


def test_a_killed_progress_counter_does_not_fail_the_job(ray_local, caplog):
    """Killing the counter actor (bookkeeping only) failed the whole job with ActorDiedError: the driver's read of
    its totals now keeps the last totals, says so once, and goes on."""
    import logging

    import ray

    from actlake.jobs.extract.progress import job_counter

    counter = job_counter()
    counter.add(2.0, 10)
    for _ in range(100):  # the call is not waited for: read until it has landed
        if counter.totals()[1] == 10:
            break
    assert counter.totals()[1:] == (10, 1)
    ray.kill(counter.actor)  # asynchronous: a call sent right after it may still run (CI saw (15, 2))
    for _ in range(600):
        try:
            ray.get(counter.actor.totals.remote(counter.job), timeout=60)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the killed counter actor kept answering for a minute")
    counter.add(1.0, 5)  # a worker's batch after the kill: nothing raised
    with caplog.at_level(logging.WARNING, logger="actlake.progress"):
        assert counter.totals()[1:] == (10, 1)
        assert counter.totals()[1:] == (10, 1)
    assert sum("progress counter stopped answering" in r.message for r in caplog.records) == 1
    counter.close()
    assert job_counter().totals() == (0.0, 0, 0)  # the next job gets a counter of its own again

"""Corpus and results in a real S3-compatible store (moto's server on 127.0.0.1), as on a cluster.

The jobs here read the corpus from a bucket and write the run to a bucket, from an empty working
folder: nothing may land on the local disk. Their tables must equal those of the same job over local
files, exactly once, also after a worker is killed mid-job and after a resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from actlake.fs import location
from actlake.jobs.extract.run import run_job
from tests.conftest import job_config
from tests.integration.test_faults import assert_same, snapshot

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SETTINGS = {"corpus.max_docs": 16, "sharding.docs_per_shard": 4}
TABLES = ("documents", "tokens", "residual_norms", "dim_moments", "contributions", "attention_mass")


def upload_corpus(src: Path, bucket: str) -> str:
    for p in sorted(src.glob("*.jsonl.zst")):
        location(f"{bucket}/pile/{p.name}").write_bytes(p.read_bytes())
    return f"{bucket}/pile/*.jsonl.zst"


@pytest.fixture(scope="module")
def reference(minilm_path, sample_corpus, tmp_path_factory, ray_local):
    """The job's tables over the local copy of the corpus."""
    out = tmp_path_factory.mktemp("local")
    res = run_job(job_config(minilm_path, sample_corpus, out, **SETTINGS))
    return snapshot(res.run_dir, TABLES)


@pytest.fixture(scope="module")
def corpus_url(s3_server, sample_corpus):
    return upload_corpus(sample_corpus, s3_server("corpus"))


def test_a_job_reads_and_writes_only_the_bucket(minilm_path, sample_corpus, corpus_url, s3_server, reference, ray_local,
                                                tmp_path, monkeypatch, capsys):
    from actlake.jobs.cli import main

    runs = s3_server("runs-a")
    monkeypatch.chdir(tmp_path)
    cfg = job_config(minilm_path, sample_corpus, runs, **SETTINGS, **{"corpus.paths": [corpus_url], "output.run_id": "r1"})
    res = run_job(cfg)
    assert res.run_dir == f"{runs}/r1" and res.shards_run == res.shards_total == 4
    assert list(tmp_path.iterdir()) == []  # nothing local: no run folder, no corpus index, no spill
    assert_same(snapshot(res.run_dir, TABLES), reference)
    keys = location(runs).sizes()
    assert "r1/run.json" in keys and any(k.startswith("_corpus_index/") for k in keys)
    assert not any(k.startswith("r1/_staging") for k in keys)  # no rename in a bucket, so nothing is staged
    # the CLI queries the run where it lies
    del s3_server.requests[:]
    assert main(["sql", f"{runs}/r1", "SELECT count(*) AS n FROM tokens", "--format", "csv"]) == 0
    n = capsys.readouterr().out.strip().splitlines()[-1]
    assert int(n) == len(reference["tokens"])
    # a HEAD request per read of a file (pyarrow's open) and at most three more (its checksum check's look,
    # the run's reduce record's, and the connection's file system's first); DuckDB asks for a file's size and
    # time many times per query: those are answered from the first (24-34 HEADs for 6-8 reads before)
    heads, gets = ({path: n for (m, path), n in Counter(s3_server.requests).items() if m == method and
                    path.endswith(".parquet")} for method in ("HEAD", "GET"))
    files = {f"/runs-a/{k}" for k in keys if k.startswith("r1/tables/") and k.endswith(".parquet")}
    assert set(heads) == set(gets) == files
    assert all(heads[p] <= gets[p] + 3 for p in files), {p: (heads[p], gets[p]) for p in files}
    assert main(["report", f"{runs}/r1"]) == 0  # and its report, read and written there
    assert "r1/report/report.html" in location(runs).sizes() and list(tmp_path.iterdir()) == []


def test_no_credential_reaches_rays_files(minilm_path, sample_corpus, corpus_url, s3_server, ray_local, tmp_path):
    """On the embedded Ray the workers get the driver's credentials as their actor's argument, never as a
    runtime_env, whose variables Ray writes in plain text to ``runtime_env_agent.log`` (issue 31, item 3)."""
    import ray

    runs = s3_server("runs-secret")
    cfg = job_config(minilm_path, sample_corpus, runs, **{"corpus.max_docs": 4, "corpus.paths": [corpus_url],
                                                          "output.run_id": "s1"})
    assert run_job(cfg).shards_run == 1
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    files = [p for p in session.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.name.startswith("runtime_env_agent") for p in files)  # the log that used to hold it is there
    assert [str(p) for p in files if secret in p.read_bytes()] == []


def test_a_killed_worker_and_a_resume_keep_every_row_exactly_once(minilm_path, sample_corpus, corpus_url, s3_server,
                                                                  reference, ray_local, tmp_path, monkeypatch):
    import ray

    from actlake.storage.layout import RunLayout
    from actlake.storage.shards import committed

    runs = s3_server("runs-b")
    monkeypatch.chdir(tmp_path)
    cfg = job_config(minilm_path, sample_corpus, runs, **SETTINGS,
                     **{"corpus.paths": [corpus_url], "output.run_id": "r2", "sharding.commit_seconds": 0.001})
    killed = []

    def kill_after_first_commit(summary):
        if not killed:
            killed.append(summary["pid"])
            os.kill(summary["pid"], 9)  # the worker dies between shards; Ray restarts it

    res = run_job(cfg, on_shard=kill_after_first_commit)
    assert killed and res.shards_total == 4
    assert_same(snapshot(res.run_dir, TABLES), reference)
    layout = RunLayout(location(res.run_dir))
    plan_hash = json.loads(layout.run_json.read_text())["plan_hash"]
    records = sorted(layout.complete.glob("group-*.json"))
    assert sorted(committed(layout, plan_hash).shards) == [0, 1, 2, 3]
    # resume: drop one group's record, as if its worker had died before writing it
    dropped = json.loads(records[-1].read_text())
    records[-1].unlink()
    again = run_job(cfg)
    assert again.shards_run == len(dropped["shards"])
    assert_same(snapshot(again.run_dir, TABLES), reference)
    assert ray.is_initialized()


def test_workers_on_other_nodes_share_nothing_but_the_store(minilm_path, sample_corpus, corpus_url, s3_server, reference,
                                                            tmp_path, own_ray_env):
    """Two worker nodes and the driver, each in its own empty working folder; corpus and results in buckets."""
    runs = s3_server("runs-c")
    driver, workers = tmp_path / "driver", tmp_path / "workers"
    driver.mkdir(), workers.mkdir()
    cfg = job_config(minilm_path, sample_corpus, runs, **SETTINGS,
                     **{"corpus.paths": [corpus_url], "output.run_id": "r3", "resources.num_workers": 2,
                        "sharding.commit_seconds": 0.001})
    cfg_file, out_file = tmp_path / "cfg.json", tmp_path / "result.json"
    cfg_file.write_text(json.dumps(cfg.to_dict()))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.integration.multi_node_job", str(cfg_file), str(out_file),
                           str(driver), str(workers)], cwd=root, capture_output=True, text=True, timeout=600,
                          env=dict(own_ray_env, PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out_file.read_text())
    assert result["shards_run"] == 4 and len(set(result["nodes"])) == 2  # both nodes ran shards
    assert list(driver.iterdir()) == [] and list(workers.iterdir()) == []
    assert_same(snapshot(f"{runs}/r3", TABLES), reference)

"""``actlake submit`` against a real Ray head started here on 127.0.0.1 (Jobs API over HTTP)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from actlake.jobs.cli import main
from actlake.storage.sql import query

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(s3_server):
    """A Ray head on 127.0.0.1, as ``ray start --head`` starts one. Started after the S3 server, so the
    node has the store's variables, as a cluster node brings its own (``cluster.yaml``)."""
    temp = tempfile.mkdtemp(prefix="rayh", dir="/tmp")
    gcs, dash = _free_port(), _free_port()
    # every fixed default port gets a free one: another Ray on this machine (the test session's own)
    # may hold the defaults, and a job agent that cannot bind never accepts jobs
    extra = [f"--{name}={_free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
        "runtime-env-agent-port", "ray-client-server-port", "node-manager-port", "object-manager-port")]
    ray_bin = str(Path(sys.executable).with_name("ray"))
    proc = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true", "--num-cpus=2",
         "--disable-usage-stats", f"--temp-dir={temp}", *extra],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        # the job's entrypoint runs `python` from the head's PATH: make it this environment's
        env=dict(os.environ, RAY_ADDRESS="", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"),
    )
    address = f"http://127.0.0.1:{dash}"
    try:
        from actlake.jobs.extract.submit import client

        deadline = time.monotonic() + 120
        while True:
            try:
                client(address).list_jobs()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"Ray head did not come up on {address}")
                time.sleep(1)
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(temp, ignore_errors=True)


def wait_until_finished(sid: str, address: str, capsys, timeout_s: float = 400) -> tuple[str, str]:
    """Poll ``actlake status`` until the job ends; return (state, logs)."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        assert main(["status", sid, "--address", address]) == 0
        state = capsys.readouterr().out.strip()
        if state in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        time.sleep(2)
    main(["logs", sid, "--address", address])
    return state, capsys.readouterr().out


@pytest.mark.parametrize("command", ["submit", "run"])
def test_a_job_with_a_home_relative_output_dir_lands_there(command, ray_local, ray_head, minilm_path, sample_corpus,
                                                            tmp_path, monkeypatch, capsys):
    """``output.dir: ~/runs`` means the user's home on the machine that reads the config, for ``run`` and
    ``submit`` alike (the cluster's job runs elsewhere, with another home): the run folder and the corpus
    index both land there, nothing in the working folder (no ``~`` folder)."""
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir(), here.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    cfg = here / "job.yaml"
    cfg.write_text(
        f"name: submitted\nmodel:\n  name_or_path: {minilm_path}\n"
        f"corpus:\n  paths: ['{sample_corpus}/*.jsonl.zst']\n  max_docs: 6\n"
        f"tokenization:\n  max_length: 32\n  max_windows_per_doc: 1\n"
        f"output:\n  dir: ~/runs\n  run_id: sub\n  report: false\n"
        f"resources:\n  cpus_per_worker: 1\n"
    )
    if command == "run":
        assert main(["run", "job.yaml"]) == 0
    else:
        assert main(["submit", "job.yaml", "--address", ray_head]) == 0
        sid = capsys.readouterr().out.strip().splitlines()[-1]
        assert sid.startswith("raysubmit_")
        state, logs = wait_until_finished(sid, ray_head, capsys)
        assert state == "SUCCEEDED", logs[-3000:]
        assert "shards ran" in logs
    n = query(home / "runs" / "sub", "SELECT count(DISTINCT doc_id) AS n FROM tokens").to_pylist()[0]["n"]
    assert n == 6
    assert (home / "runs" / "_corpus_index").is_dir() and sorted(p.name for p in here.iterdir()) == ["job.yaml"]


def test_a_stopped_job_resubmitted_with_the_same_run_id_finishes_like_a_clean_run(
        ray_local, ray_head, minilm_path, sample_corpus, tmp_path, capsys):
    from actlake.jobs.extract.run import run_job
    from tests.conftest import job_config
    from tests.integration.test_faults import assert_same, snapshot

    over = {"corpus.max_docs": 16, "sharding.docs_per_shard": 2, "output.run_id": "stopped", "sharding.commit_seconds": 0.001}
    cfg = job_config(minilm_path, sample_corpus, tmp_path / "runs", **over)
    job_file = tmp_path / "job.yaml"
    import yaml

    job_file.write_text(yaml.safe_dump(dict(cfg.to_dict(), name="stopped")))
    assert main(["submit", str(job_file), "--address", ray_head]) == 0
    sid = capsys.readouterr().out.strip().splitlines()[-1]
    complete = Path(cfg.run_dir) / "_complete"
    deadline = time.monotonic() + 300
    while len(list(complete.glob("group-*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert main(["stop", sid, "--address", ray_head]) == 0
    wait_until_finished(sid, ray_head, capsys)
    done_before = len(list(complete.glob("group-*.json")))
    assert 2 <= done_before < 8, "the job was not stopped midway"
    assert main(["submit", str(job_file), "--address", ray_head]) == 0
    sid2 = capsys.readouterr().out.strip().splitlines()[-1]
    state, logs = wait_until_finished(sid2, ray_head, capsys)
    assert state == "SUCCEEDED", logs[-3000:]
    assert f"({8 - done_before} of 8 shards ran)" in logs
    clean = run_job(job_config(minilm_path, sample_corpus, tmp_path / "clean", **over))
    assert_same(snapshot(cfg.run_dir), snapshot(clean.run_dir))


def test_the_readme_cluster_recipe_with_object_storage(ray_local, ray_head, s3_server, minilm_path, sample_corpus,
                                                       tmp_path, monkeypatch, capsys):
    """README, *Running on a cluster*, as written: corpus and output are ``s3://`` URLs, ``actlake submit``
    from a folder of the user's, ``actlake status`` until it ends, ``actlake sql s3://…``. The tables equal
    a local run's; nothing lands in the submitting folder; no object holds a credential."""
    from actlake.fs import location
    from actlake.jobs.extract.run import run_job
    from tests.conftest import job_config
    from tests.integration.test_faults import assert_same, snapshot
    from tests.integration.test_object_store import upload_corpus

    corpus = upload_corpus(sample_corpus, s3_server("recipe-corpus"))
    runs = s3_server("recipe-results")
    here = tmp_path / "submitting"
    here.mkdir()
    (here / "my_job.yaml").write_text(
        f"name: recipe\nmodel:\n  name_or_path: {minilm_path}\n"
        f'corpus:\n  paths: ["{corpus}"]\n  max_docs: 8\n'
        f"tokenization:\n  max_length: 32\n  max_windows_per_doc: 1\n"
        f"sharding:\n  docs_per_shard: 8\nbatching:\n  max_tokens: 512\n"  # as job_config's local run below
        f"output:\n  dir: {runs}/runs\n  report: false\n"
        f"resources:\n  num_workers: 1\n  cpus_per_worker: 1\n")
    monkeypatch.chdir(here)
    assert main(["submit", "my_job.yaml", "--address", ray_head]) == 0
    sid = capsys.readouterr().out.strip().splitlines()[-1]
    state, logs = wait_until_finished(sid, ray_head, capsys)
    assert state == "SUCCEEDED", logs[-3000:]
    assert sorted(p.name for p in here.iterdir()) == ["my_job.yaml"]  # no s3:/ folder, no index, no spill
    run_id = next(k.split("/")[0] for k in location(f"{runs}/runs").sizes() if k.endswith("/run.json"))
    run_url = f"{runs}/runs/{run_id}"
    assert main(["sql", run_url, "SELECT count(DISTINCT doc_id) AS n FROM tokens", "--format", "csv"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "8"
    local = run_job(job_config(minilm_path, sample_corpus, tmp_path / "local",
                               **{"corpus.max_docs": 8, "tokenization.max_length": 32,
                                  "tokenization.max_windows_per_doc": 1}))
    tables = ("documents", "tokens", "residual_norms", "dim_moments", "attention_mass")
    assert_same(snapshot(run_url, tables), snapshot(local.run_dir, tables))
    secrets = [os.environ["AWS_SECRET_ACCESS_KEY"].encode(), os.environ["AWS_ACCESS_KEY_ID"].encode()]
    for bucket in ("recipe-corpus", "recipe-results"):
        for key in location(f"s3://{bucket}").sizes():
            data = location(f"s3://{bucket}/{key}").read_bytes()
            assert not any(s in data for s in secrets), f"s3://{bucket}/{key} holds a credential"

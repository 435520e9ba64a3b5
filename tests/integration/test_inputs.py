"""Input safety on real Ray and real files, through the command line (``actlake.jobs.cli.main``):
a changed or shrunk corpus is refused with one line naming the file, hostile records become
rejects, and the embedded Ray listens on loopback only."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from actlake.jobs.cli import main
from actlake.storage.sql import open_run
from tests.conftest import committed_ids, drop_commits, job_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("kept_workers")]

LIGHT = {"analyses.contributions": False, "analyses.geometry": False, "analyses.attention_by_distance": False,
         "analyses.residual_norms": False, "corpus.max_docs": None}
"""Analyses these tests do not look at: off, to keep the jobs small on a 2-core machine."""


def _corpus(sample_corpus: Path, folder: Path, n: int) -> tuple[Path, list[bytes]]:
    """A plain .jsonl file of the first ``n`` sample documents (lines of 00.jsonl and 01.jsonl)."""
    lines = [l for name in ("00.jsonl", "01.jsonl") for l in (sample_corpus / name).read_bytes().splitlines()][:n]
    assert len(lines) == n
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / "c.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    return f, lines


def _config_file(tmp_path: Path, model: str, corpus_dir: Path, **overrides) -> Path:
    """A job YAML (JSON is YAML) for ``corpus_dir/*.jsonl``."""
    cfg = job_config(model, corpus_dir, tmp_path / "runs", **{**LIGHT, "corpus.paths": [str(corpus_dir / "*.jsonl")],
                                                              "output.run_id": "inputs", **overrides})
    p = tmp_path / "job.yaml"
    p.write_text(json.dumps(cfg.to_dict()))
    return p


def _run(capsys, config: Path) -> tuple[int, str, str]:
    """``actlake run CONFIG``: (exit status, stdout, stderr)."""
    code = main(["run", str(config), "--no-report"])
    out, err = capsys.readouterr()
    return code, out, err


def _error_line(err: str) -> str:
    """The ``actlake: error:`` lines of stderr (log lines are not errors); exactly one expected."""
    lines = [l for l in err.splitlines() if l.startswith("actlake: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_a_changed_corpus_is_refused_and_the_same_bytes_resume(minilm_path, sample_corpus, tmp_path, capsys, ray_local):
    """Rewritten with the same number of lines and the same size, mtime put back: only the content
    hash can tell, and the rerun (finished run, then with shards missing) is refused naming the file."""
    f, lines = _corpus(sample_corpus, tmp_path / "corpus", 12)
    config = _config_file(tmp_path, minilm_path, f.parent, **{"sharding.docs_per_shard": 2, "sharding.commit_seconds": 0.001})
    code, out, err = _run(capsys, config)
    assert code == 0, err[-3000:]
    n_shards = -(-len(lines) // 2)
    assert f"({n_shards} of {n_shards} shards ran)" in out
    original, st = f.read_bytes(), os.stat(f)
    changed = b"\n".join(reversed(lines)) + b"\n"  # same lines, same size, other order: other documents per doc_id
    assert len(changed) == len(original) and changed != original
    f.write_bytes(changed)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, out, err = _run(capsys, config)
    line = _error_line(err)
    assert code == 2 and str(f) in line and "content changed" in line and "run_id" in line
    run_dir = tmp_path / "runs" / "inputs"
    killed = drop_commits(run_dir, range(n_shards // 2, n_shards))  # as if the job had died after half of its shards
    assert killed and committed_ids(run_dir) == set(range(n_shards)) - killed
    code, out, err = _run(capsys, config)
    assert code == 2 and str(f) in _error_line(err)
    assert committed_ids(run_dir) == set(range(n_shards)) - killed  # nothing ran
    f.write_bytes(original)  # the same bytes again (a newer mtime): the same input, so the run resumes
    code, out, err = _run(capsys, config)
    assert code == 0, err[-3000:]
    assert f"({len(killed)} of {n_shards} shards ran)" in out
    docs = open_run(str(run_dir)).execute("SELECT record FROM documents ORDER BY record").fetchall()
    assert [r for (r,) in docs] == list(range(len(lines)))


def test_a_file_that_shrinks_after_planning_fails_the_job_naming_it(minilm_path, sample_corpus, tmp_path, capsys,
                                                                   ray_local):
    """24 records cut to 10 once the first shard has committed: the job fails with one line naming
    the file, instead of publishing what it read."""
    f, lines = _corpus(sample_corpus, tmp_path / "corpus", 24)
    config = _config_file(tmp_path, minilm_path, f.parent, **{"sharding.docs_per_shard": 2, "sharding.commit_seconds": 0.001})
    complete = tmp_path / "runs" / "inputs" / "_complete"
    cut, stop = [], threading.Event()

    def first():
        return any(complete.glob("group-*.json"))

    def cutter():
        while not stop.is_set() and not first():
            time.sleep(0.02)
        if first():
            f.write_bytes(b"\n".join(lines[:10]) + b"\n")
            cut.append(len(list(complete.glob("group-*.json"))))

    t = threading.Thread(target=cutter)
    t.start()
    try:
        code, out, err = _run(capsys, config)
    finally:
        stop.set()
        t.join()
    assert cut and cut[0] < -(-len(lines) // 2), "the job finished before the file could be cut"
    line = _error_line(err)
    assert code == 2 and str(f) in line and "size" in line, err[-3000:]
    assert not (tmp_path / "runs" / "inputs" / "tables" / "documents" / "part-0.parquet").exists()


def test_hostile_records_become_rejects_and_the_shard_goes_on(minilm_path, sample_corpus, tmp_path, capsys, ray_local):
    """A line of 100,000 '[', a 5,000-digit integer and a lone surrogate: three rejects, every good
    document present."""
    _, good = _corpus(sample_corpus, tmp_path / "tmp", 9)
    hostile = {1: (b"[" * 100_000, "malformed_json"),
               4: (b'{"text": "a number", "n": ' + b"7" * 5000 + b"}", "malformed_json"),
               7: (b'{"text": "\\ud800"}', "invalid_text")}
    lines, expected_docs, g = [], [], iter(good)
    for i in range(len(good) + len(hostile)):
        if i in hostile:
            lines.append(hostile[i][0])
        else:
            lines.append(next(g))
            expected_docs.append(i)
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "c.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    code, out, err = _run(capsys, _config_file(tmp_path, minilm_path, folder, **{"sharding.docs_per_shard": 4}))
    assert code == 0, err[-3000:]
    con = open_run(str(tmp_path / "runs" / "inputs"))
    rejects = con.execute("SELECT record, reason FROM rejects ORDER BY record").fetchall()
    assert rejects == [(i, reason) for i, (_, reason) in sorted(hostile.items())]
    assert [r for (r,) in con.execute("SELECT record FROM documents ORDER BY record").fetchall()] == expected_docs


def test_tokenizer_errors_become_rejects(minilm_path, sample_corpus, tmp_path):
    """A record the tokenizer raises on (injected: no real text is known to break it once the reader
    has refused unencodable text) is a ``tokenizer_error`` reject; the shard's other records are read."""
    from actlake.batching import special_affixes
    from actlake.jobs.extract.driver import Extractor
    from actlake.jobs.extract.plan import make_plan
    from actlake.model import load_model

    f, lines = _corpus(sample_corpus, tmp_path / "corpus", 6)
    victim = 3
    lines[victim] = json.dumps({"text": "REFUSE this one"}).encode()
    f.write_bytes(b"\n".join(lines) + b"\n")
    cfg = job_config(minilm_path, f.parent, tmp_path / "runs", **{**LIGHT, "corpus.paths": [str(f)],
                                                                   "sharding.docs_per_shard": 10})
    ex = Extractor(cfg, load_model(cfg.model))
    real = ex.lm.tokenizer

    class Refusing:
        """The real tokenizer, raising on one marked text."""
        _actlake_affixes = special_affixes(real)

        def __call__(self, text, **kwargs):  # records are tokenised many to a call, then one by one where a call fails
            if any("REFUSE" in t for t in ([text] if isinstance(text, str) else text)):
                raise TypeError("injected tokenizer failure")
            return real(text, **kwargs)

    ex.lm.tokenizer = Refusing()
    (shard,) = make_plan(cfg)
    windows, docs, rejects = ex.read_shard(shard)
    assert [(r["record"], r["reason"]) for r in rejects] == [(victim, "tokenizer_error")]
    assert "injected" in rejects[0]["detail"]
    assert [d["record"] for d in docs] == [i for i in range(len(lines)) if i != victim]
    ex.lm.tokenizer = real  # the other records' windows are those the real tokenizer gives
    kept = {d["doc_id"] for d in docs}
    assert [(w.doc_id, w.window, w.ids) for w in ex.read_shard(shard)[0] if w.doc_id in kept] == \
        [(w.doc_id, w.window, w.ids) for w in windows]


def _documents(run_dir) -> list[tuple]:
    con = open_run(str(run_dir))
    return con.execute("SELECT doc_id, file, record, source, n_chars FROM documents ORDER BY doc_id").fetchall()


def test_a_job_reads_shards_from_entry_points_and_resumes_only_missing_shards(minilm_path, sample_corpus, tmp_path,
                                                                              ray_local):
    """Two single-frame .jsonl.zst files in shards of 6 (most start deep in their file, read from the
    seekable copies): the documents table holds exactly the records of a plain read of the files;
    after deleting two completion records, a rerun runs those two shards only and the table is the same."""
    from actlake.corpus.readers import Record, iter_items
    from actlake.jobs.extract.run import run_job

    cfg = job_config(minilm_path, sample_corpus, tmp_path / "runs", **{**LIGHT, "sharding.docs_per_shard": 6,
                                                                       "output.run_id": "entry", "sharding.commit_seconds": 0.001})
    first = run_job(cfg)
    files = sorted(str(p) for p in sample_corpus.glob("*.jsonl.zst"))
    expected, offset = [], 0
    for f in files:
        items = list(iter_items(f, "jsonl", 0, 10**9, "text", "meta.pile_set_name"))
        expected += [(offset + i.index, f, i.index, i.source, len(i.text)) for i in items if isinstance(i, Record)]
        offset += len(items)
    docs = _documents(first.run_dir)
    assert docs == expected and first.shards_run == first.shards_total > 4
    planned = json.loads((Path(first.run_dir) / "run.json").read_text())["shards"]
    assert all(s["entry_record"] == s["start"] and "_corpus_index" in s["entry_file"] for s in planned)
    gone = drop_commits(first.run_dir, (1, first.shards_total - 2))
    again = run_job(cfg)
    assert again.shards_run == len(gone) >= 2 and _documents(again.run_dir) == docs


def test_a_streamed_hugging_face_dataset_runs_one_shard_per_file(minilm_path, sample_corpus, tmp_path, ray_local):
    """A local folder of two Parquet files, ``hf_streaming: true``: two shards, and the documents are the
    files' rows, numbered within their file."""
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actlake.jobs.extract.run import run_job

    rows = [json.loads(l) for l in (sample_corpus / "00.jsonl").read_text().splitlines()][:7]
    folder = tmp_path / "ds" / "data"
    folder.mkdir(parents=True)
    parts = [rows[:4], rows[4:]]
    for k, part in enumerate(parts):
        pq.write_table(pa.Table.from_pylist(part), folder / f"train-{k:05d}-of-00002.parquet")
    cfg = job_config(minilm_path, sample_corpus, tmp_path / "runs", **{**LIGHT, "corpus.format": "hf",
                     "corpus.hf_dataset": str(tmp_path / "ds"), "corpus.hf_streaming": True, "output.run_id": "stream"})
    result = run_job(cfg)
    assert result.shards_total == 2
    from actlake.jobs.extract.plan import HF_STREAM_STRIDE

    assert [(d, r, src, n) for d, _, r, src, n in _documents(result.run_dir)] == [
        (k * HF_STREAM_STRIDE + j, j, row["meta"]["pile_set_name"], len(row["text"]))
        for k, part in enumerate(parts) for j, row in enumerate(part)]


LISTENERS = r"""
import json, sys, time
import psutil, ray
from actlake.jobs.common import ray_env
from actlake.jobs.common.ray_env import init_ray

def listeners():
    me = psutil.Process()
    procs = {p.pid: p for p in me.children(recursive=True)}
    procs[me.pid] = me
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.pid in procs and (c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr)):
            try:
                name = " ".join(procs[c.pid].cmdline())[:120]
            except psutil.Error:
                name = "?"
            out.append({"ip": c.laddr.ip, "port": c.laddr.port, "type": int(c.type), "process": name})
    return out

import os
result, waits = {}, {}
for dashboard in (False, True):
    if dashboard:
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"  # a user's own setting reaches the workers
    assert init_ray(None, dashboard=dashboard)
    chosen = ray_env.workers_env.get("OMP_WAIT_POLICY")  # spinning (None), or passive beside another Ray
    waits[str(dashboard)] = [chosen, ray.get(ray.remote(lambda: os.environ.get("OMP_WAIT_POLICY")).remote())]
    time.sleep(8)  # agents and monitors open their ports after start-up
    result[str(dashboard)] = listeners()
    ray.shutdown()
print("RESULT " + json.dumps(result))
print("WAITS " + json.dumps(waits))
"""


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def test_the_embedded_ray_is_new_and_listens_on_loopback_only(own_ray_env):
    """``init_ray(None)`` (and with the dashboard, as the training jobs start it) starts its own Ray even
    where Ray's temp folder names a cluster (``ray start``'s record, here a dead one, as a killed test
    leaves it), and every TCP listener and bound UDP socket of the driver and every process Ray started is
    on 127.0.0.1 / ::1. Its workers get the OpenMP wait policy the driver chose (spinning, or passive beside
    another Ray), and the user's own OMP_WAIT_POLICY when set."""
    own_ray_env = {k: v for k, v in own_ray_env.items() if k != "OMP_WAIT_POLICY"}  # tests/conftest.py sets it
    record = Path(own_ray_env["RAY_TMPDIR"], "ray", "ray_current_cluster")
    record.parent.mkdir()
    record.write_text("192.0.2.1:6379")  # TEST-NET-1: nobody answers
    proc = subprocess.run([sys.executable, "-c", LISTENERS], capture_output=True, text=True, timeout=300,
                          env=own_ray_env, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].split("\n", 1)[0])
    waits = json.loads(proc.stdout.split("WAITS ", 1)[1])
    assert waits["True"] == ["ACTIVE", "ACTIVE"] and waits["False"][0] in (None, "PASSIVE"), waits
    assert waits["False"][1] == waits["False"][0], waits  # what the driver chose is what the worker has
    for dashboard, socks in result.items():
        names = " ".join(s["process"] for s in socks)
        assert "gcs_server" in names and "raylet" in names, (dashboard, socks)
        exposed = [s for s in socks if not _is_loopback(s["ip"])]
        assert exposed == [], (dashboard, exposed)


def test_another_ray_on_the_machine_is_seen_by_its_raylet():
    """other_rays names the raylet of a real Ray started here in another process."""
    import psutil

    from actlake.jobs.common.ray_env import other_rays

    proc = subprocess.Popen([sys.executable, "-c", "import ray, sys; ray.init(address='local', include_dashboard=False);"
                             " print('up', flush=True); sys.stdin.read(); ray.shutdown()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        raylets = {c.pid for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == "raylet"}
        assert raylets and raylets <= set(other_rays())
    finally:
        proc.communicate("", timeout=120)


def test_a_ray_this_process_started_is_not_another_ray():
    """A job's second Ray in one process (a redispatch, the exports after a job) starts while the first may still be
    exiting: the raylet this process started is never 'another Ray' (which would make the workers passive), before
    its shutdown nor after it, when the next Ray starts."""
    code = ("import psutil\n"
            "from actlake.jobs.common import ray_env\n"
            "ray_env.init_ray(None)\n"
            "mine = [c.pid for c in psutil.Process().children() if c.name() == 'raylet']\n"
            "alive = not set(mine) & set(ray_env.other_rays())\n"
            "ray_env.release_ray(background=True)\n"
            "ray_env.init_ray(None)  # joins the shutdown, which does not wait for every process to exit\n"
            "again = not set(mine) & set(ray_env.other_rays())\n"
            "print(len(mine) == 1 and alive and again)\n"
            "ray_env.release_ray()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1:] == ["True"], done.stdout + done.stderr[-3000:]

"""Reading shards in a process of the worker's own (``resources.read_in_process``): the same windows,
documents and rejects as reading in the worker, the same errors, and no process left behind by a killed
worker. (A whole job with it equals a clean run: ``test_faults.py``.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import zstandard

from actlake.errors import CorpusError
from actlake.jobs.extract.plan import make_plan
from actlake.jobs.extract.read import ReaderProcess, read_shard
from tests.conftest import job_config

pytestmark = pytest.mark.integration


def _corpus(folder):
    """Two files: prose, code, a line that is not JSON and a record without text (rejects), an empty text."""
    folder.mkdir()
    lines = [json.dumps({"text": f"Document {i}: " + "def f(x):\n    return x * 2  # twice\n" * (i % 4 + 1),
                         "meta": {"pile_set_name": "Code" if i % 2 else "Prose"}}) for i in range(30)]
    lines[7], lines[12], lines[20] = "{not json", json.dumps({"meta": {}}), json.dumps({"text": ""})
    for k in range(2):
        (folder / f"part{k}.jsonl.zst").write_bytes(zstandard.compress("\n".join(lines[k::2]).encode() + b"\n"))
    return folder


def test_a_reader_process_reads_what_the_worker_would(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    corpus = _corpus(tmp_path / "corpus")
    cfg = job_config(tiny_models["gpt2"], corpus, tmp_path / "runs", **{"sharding.docs_per_shard": 4,
                                                                         "tokenization.max_length": 16})
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["gpt2"])
    shards = make_plan(cfg)
    reader = ReaderProcess(cfg, tokenizer)
    try:
        here = [read_shard(s, cfg, tokenizer, threading.Lock()) for s in shards]
        there = [reader.read(s) for s in shards]
        assert there == here
        # it tokenises without torch (about 0.2 GB of memory and 1 s of start-up less)
        loaded = "sorted({m.split('.')[0] for m in __import__('sys').modules} & {'torch', 'ray'})"
        assert reader.pool.submit(eval, loaded).result() == []
        # a reader killed (for memory, say) is replaced and the shard read again
        (child,) = reader.pool._processes
        os.kill(child, signal.SIGKILL)
        time.sleep(0.5)
        assert reader.read(shards[1]) == here[1] and child not in reader.pool._processes
        assert sum(len(r) for _, _, r in there) == 3 and sum(len(w) for w, _, _ in there) > len(shards)
        # a file changed since the plan: the reader's CorpusError, naming the file, as the worker would raise it
        changed = shards[0].path
        os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
        with pytest.raises(CorpusError, match="since the run planned it") as e:
            reader.read(shards[0])
        assert changed in str(e.value)
    finally:
        reader.close()


def test_the_reader_process_exits_with_a_killed_worker(tiny_models, tmp_path):
    """A worker killed by Ray (SIGKILL) never shuts its pool down: the reader notices its parent is gone."""
    import psutil

    cfg = job_config(tiny_models["gpt2"], _corpus(tmp_path / "corpus"), tmp_path / "runs").to_dict()
    script = textwrap.dedent(f"""
        import json, os, signal
        from transformers import AutoTokenizer
        from actlake.config import parse_config
        from actlake.jobs.extract.read import ReaderProcess
        reader = ReaderProcess(parse_config(json.loads({json.dumps(cfg)!r})),
                               AutoTokenizer.from_pretrained({str(tiny_models["gpt2"])!r}))
        reader.pool.submit(os.getpid).result()
        (child,) = reader.pool._processes
        print(child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert done.returncode == -9, done.stderr
    child = int(done.stdout.split()[-1])
    deadline = time.time() + 15
    while time.time() < deadline and psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.2)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_reader_process_killed_while_it_starts_is_replaced(minilm_path, tmp_path):
    """Issue 50: a reader killed before it had read its start-up data (the tokenizer, megabytes: more than a pipe
    holds) left the worker blocked for ever in multiprocessing's start-up, which writes that data while holding the
    pipe's read end itself. Caught as it appears (stopped, then killed), it is replaced and the shard read."""
    import psutil
    from transformers import AutoTokenizer

    cfg = job_config(minilm_path, _corpus(tmp_path / "corpus"), tmp_path / "runs", **{"sharding.docs_per_shard": 4})
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)  # BERT's vocabulary: 0.85 MB pickled
    shard = make_plan(cfg)[0]
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    out: dict = {}

    def start_and_read():
        try:
            out["reader"] = ReaderProcess(cfg, tokenizer)
            out["read"] = out["reader"].read(shard)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            out["error"] = e

    thread = threading.Thread(target=start_and_read, daemon=True)
    thread.start()
    victim, deadline = None, time.time() + 60
    while victim is None and time.time() < deadline:
        for c in me.children(recursive=True):
            try:
                if c.pid not in before and "spawn_main" in " ".join(c.cmdline()):
                    victim = c.pid
                    os.kill(victim, signal.SIGSTOP)  # as it starts, before it reads what it is sent
                    break
            except psutil.Error:
                continue
    assert victim is not None
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    thread.join(90)
    try:
        assert not thread.is_alive(), "the worker's reading is blocked"
        assert "error" not in out, out.get("error")
        assert out["read"] == read_shard(shard, cfg, tokenizer, threading.Lock())
    finally:
        if "reader" in out:
            out["reader"].close()

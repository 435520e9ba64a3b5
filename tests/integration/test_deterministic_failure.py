"""Failures that repeat on every try (a model that cannot load) are reported once, reason first, and not retried;
failures that need not repeat (a killed worker) keep their retries and the advice to rerun. Both count shards."""

from __future__ import annotations

import os
import shutil

import pytest
import ray

from actlake.errors import ActlakeError, ModelLoadError
from actlake.jobs.extract.dispatch import Dispatcher
from actlake.jobs.extract.plan import Shard
from tests.conftest import job_config

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
class UnloadableWorker:
    """A worker whose constructor fails as a model that cannot load does, writing a line to ``log`` per try."""

    def __init__(self, log: str):
        with open(log, "a") as f:
            f.write("constructed\n")
        raise ModelLoadError("model m: cannot load (SafetensorError: header too large)")

    def process(self, shard: dict, last: bool = False) -> dict:
        raise AssertionError("never reached")

    def get_pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class KilledWorker:
    """A worker killed under every shard it is handed (out of memory, say): Ray restarts it."""

    def process(self, shard: dict, last: bool = False) -> dict:
        os._exit(1)

    def get_pid(self) -> int:
        return os.getpid()


def _shards(n: int) -> list[Shard]:
    return [Shard(i, f"f{i}.jsonl", "jsonl", 0, 1, i) for i in range(n)]


def test_workers_that_cannot_start_are_not_retried_and_the_reason_comes_first(ray_local, tmp_path):
    """Two workers whose constructor fails the same way, Ray allowed to restart each 3 times: each is constructed
    once, and the job's error is one line, the model's error first, counting the 3 shards, with no advice to rerun."""
    log = tmp_path / "constructed.txt"
    workers = [UnloadableWorker.options(max_restarts=3).remote(str(log)) for _ in range(2)]
    dispatcher = Dispatcher(workers, max_retries=3)
    _, failures = dispatcher.run(_shards(3))
    assert len(failures) == 3 and all("no worker left" in f for f in failures), failures
    err = dispatcher.error()
    assert isinstance(err, ModelLoadError)
    assert str(err) == ("every worker failed to start: model m: cannot load (SafetensorError: header too large) "
                        "(3 shard(s) not run; the same error would repeat on a rerun)")
    assert log.read_text().count("constructed") == 2  # once a worker: at most max_retries + 1 each
    for w in workers:
        ray.kill(w)


def test_a_model_error_while_running_a_shard_ends_the_job_at_once(ray_local):
    """A worker that cannot load the model when handed a shard (a kept worker taking on another job): the
    same would happen on every shard, so the job ends with that error, not a failure a shard."""
    @ray.remote(num_cpus=0)
    class Refusing:
        def __init__(self):
            self.calls = 0

        def process(self, shard: dict, last: bool = False) -> dict:
            self.calls += 1
            raise ModelLoadError(f"model m: cannot load (call {self.calls})")

        def count(self) -> int:
            return self.calls

    worker = Refusing.remote()
    with pytest.raises(ModelLoadError, match=r"^model m: cannot load \(call 1\)$"):
        Dispatcher([worker], max_retries=3).run(_shards(3))
    assert ray.get(worker.count.remote()) == 1
    ray.kill(worker)


def test_a_killed_worker_is_retried_and_its_shards_get_the_advice_to_rerun(ray_local):
    """A worker killed under every shard: restarted (max_restarts), its shard retried; the error counts the 2
    shards, not the line that says how the last worker failed, and advises a rerun."""
    worker = KilledWorker.options(max_restarts=1).remote()
    dispatcher = Dispatcher([worker], max_retries=1)
    _, failures = dispatcher.run(_shards(2))
    err = dispatcher.error()
    assert type(err) is ActlakeError
    head, *lines = str(err).splitlines()
    assert head == "2 shard(s) failed; rerun the same run id to retry them:"
    assert len(failures) == 2 and lines[:2] == [f"  {f}" for f in failures], lines
    assert "shard 00000" in lines[0] and "its worker died, 2 times" in lines[0]  # retried once, then given up
    assert "shard 00001" in lines[1] and "no worker left" in lines[1]
    assert len(lines) == 3 and lines[2].startswith("the last worker failed with: ")
    ray.kill(worker)


def test_a_job_whose_model_cannot_load_fails_once_with_the_reason_and_the_shard_count(tiny_models, sample_corpus,
                                                                                      tmp_path, ray_local):
    """A model folder that passes the driver's checks (its config.json is fine) but whose weights are not a
    safetensors file: every worker's constructor fails. With no retries allowed (``max_retries: 0``) this
    ended with '2 shard(s) failed; rerun the same run id' and no reason; now one line leads with the reason."""
    from ray._private import state

    from actlake.jobs.extract.run import run_job

    folder = tmp_path / "broken"
    shutil.copytree(tiny_models["gpt2"], folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    cfg = job_config(folder, sample_corpus, tmp_path / "out", **{"corpus.max_docs": 16, "resources.num_workers": 2,
                                                                 "resources.max_retries": 0})
    before = set(state.actors())
    with pytest.raises(ModelLoadError) as e:
        run_job(cfg)
    msg = str(e.value)
    assert msg.startswith(f"every worker failed to start: model {folder}: cannot load (") and "\n" not in msg, msg
    assert msg.endswith("(2 shard(s) not run; the same error would repeat on a rerun)") and "rerun the same" not in msg
    started = [a for k, a in state.actors().items() if k not in before and a["ActorClassName"] == "ShardWorker"]
    assert len(started) == 2 and all(a["NumRestarts"] == 0 for a in started), started  # each constructed once

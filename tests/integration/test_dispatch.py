"""The dispatcher's bookkeeping of commit groups, on real Ray actors whose groups behave as scripted.

The actors stand in for ``ShardWorker`` only in what they compute (nothing): they keep a group of
shard ids and commit it as the real worker does (at ``last``, on ``flush``), so the dispatcher's
handling of lost groups and of commits that arrive before a shard's own result is tested exactly.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray

from actlake.jobs.extract.dispatch import Dispatcher, Events
from actlake.jobs.extract.plan import Shard

pytestmark = pytest.mark.integration


@ray.remote
class ScriptedWorker:
    def __init__(self, fail_at: int | None = None, hold_first: bool = False, fail_flushes: int = 0):
        self.group, self.calls, self.fail_at, self.hold_first = [], 0, fail_at, hold_first
        self.fail_flushes = fail_flushes
        self.at_last = not fail_flushes  # a worker whose flushes fail commits only on flush
        self.lock, self.second_added = threading.Lock(), threading.Event()

    def process(self, shard: dict, last: bool = False) -> dict:
        sid = shard["shard_id"]
        with self.lock:
            self.calls += 1
            call = self.calls
            self.group.append(sid)
            if call == self.fail_at:  # the commit fails: like Group.commit, the group is emptied
                self.group = []
                raise RuntimeError("the store refused the commit")
        if self.hold_first and call == 1:  # commit once the other slot's shard is in the group
            self.second_added.wait(10)
            with self.lock:
                committed, self.group = self.group, []
            return {"shard_id": sid, "committed": committed, "tokens": 1}
        if self.hold_first and call == 2:
            self.second_added.set()
            time.sleep(1.0)  # its result arrives after the first slot committed it
            return {"shard_id": sid, "committed": [], "tokens": 1}
        with self.lock:
            committed = []
            if last and self.at_last:
                committed, self.group = self.group, []
        return {"shard_id": sid, "committed": committed, "tokens": 1}

    def flush(self) -> list[int]:
        with self.lock:
            committed, self.group = self.group, []
            if self.fail_flushes:
                self.fail_flushes -= 1
                raise RuntimeError("the store refused the commit")
        return committed

    def get_pid(self) -> int:
        return os.getpid()


def _shards(n: int) -> list[Shard]:
    return [Shard(i, f"f{i}.jsonl", "jsonl", 0, 1, i) for i in range(n)]


def test_shards_of_a_group_lost_to_a_failed_commit_run_again(ray_local):
    done = []
    worker = ScriptedWorker.remote(fail_at=3)
    summaries, failures = Dispatcher([worker], max_retries=2, events=Events(done=done.append)).run(_shards(5))
    assert len(failures) == 1 and "shard 00002" in failures[0] and "refused" in failures[0]
    assert sorted(s["shard_id"] for s in done) == [0, 1, 3, 4]  # 0 and 1 ran again, each counted once
    assert sorted(s["shard_id"] for s in summaries) == [0, 1, 3, 4]
    ray.kill(worker)


def test_a_group_whose_commit_fails_runs_again_until_retries_run_out(ray_local):
    done = []
    worker = ScriptedWorker.remote(fail_flushes=1)
    dispatcher = Dispatcher([worker], max_retries=2, events=Events(done=done.append))
    _, failures = dispatcher.run(_shards(3))
    assert failures == [] and sorted(s["shard_id"] for s in done) == [0, 1, 2]  # each counted once, after the rerun
    ray.kill(worker)
    worker = ScriptedWorker.remote(fail_flushes=10)
    _, failures = Dispatcher([worker], max_retries=1, events=Events(done=done.append)).run(_shards(3))
    assert len(failures) == 3 and all("could not be committed" in f and "2 times" in f for f in failures)
    ray.kill(worker)


def test_a_commit_that_arrives_before_the_shards_own_result_counts_it_once(ray_local):
    done = []
    worker = ScriptedWorker.options(max_concurrency=2).remote(hold_first=True)
    summaries, failures = Dispatcher([worker], max_retries=2, events=Events(done=done.append), slots=2).run(_shards(2))
    assert failures == [] and sorted(s["shard_id"] for s in done) == [0, 1]
    ray.kill(worker)


def test_shards_waiting_on_a_worker_that_never_comes_up_run_on_the_free_one(ray_local):
    """A worker Ray cannot place (here: it asks for a resource no node has; on a cluster, a restart after its
    node was lost, with no room left) never runs the shard sent to it; once the other worker has nothing
    left, the shard is taken back and runs there (the job waited for good before)."""
    done = []
    up = ScriptedWorker.remote()
    never = ScriptedWorker.options(resources={"no-such-node": 1}).remote()
    out = []
    run = threading.Thread(target=lambda: out.append(
        Dispatcher([never, up], max_retries=2, events=Events(done=done.append), tick_s=0.2).run(_shards(4))), daemon=True)
    run.start()
    run.join(300)  # a hang fails the test instead of the suite
    assert not run.is_alive(), "the dispatcher still waits on the worker that is not up"
    summaries, failures = out[0]
    assert failures == [] and sorted(s["shard_id"] for s in done) == [0, 1, 2, 3]
    assert sorted(s["shard_id"] for s in summaries) == [0, 1, 2, 3]
    ray.kill(never)
    ray.kill(up)


def test_a_workers_state_reads_the_same_in_a_task_as_in_the_driver(ray_local):
    """The lookup of :meth:`Dispatcher._watch` runs in a task for a driver on Ray Client (``ray://``)."""
    from actlake.jobs.extract.dispatch import read_actor_states

    up = ScriptedWorker.remote()
    never = ScriptedWorker.options(resources={"no-such-node": 1}).remote()
    ray.get(up.get_pid.remote())
    keys = [up._actor_id.hex(), never._actor_id.hex(), "ff" * 16]  # the last: no such actor
    here, there = read_actor_states(keys), ray.get(ray.remote(num_cpus=0)(read_actor_states).remote(keys))
    assert here == there == {keys[0]: ("ALIVE", 0), keys[1]: ("PENDING_CREATION", 0)}
    ray.kill(never)
    ray.kill(up)


@ray.remote(max_restarts=0)
class DyingWorker(ScriptedWorker.__ray_actor_class__):
    def process(self, shard: dict, last: bool = False) -> dict:
        time.sleep(1.0)  # the other worker is free by then, with nothing left to hand out
        os._exit(1)


def test_a_worker_dying_at_the_tail_with_another_free_is_counted_once(ray_local, monkeypatch):
    """The shard of a worker that dies when nothing else is left runs on the free worker; its death reaches the
    dispatcher both as the call's error and in Ray's actor table, looked up here at every tick: the job ended
    with a KeyError when the lookup took the call's result away first."""
    from actlake.jobs.extract import dispatch

    monkeypatch.setattr(dispatch, "WATCH_S", 0.0)
    done = []
    up, dying = ScriptedWorker.remote(), DyingWorker.remote()
    ray.get([up.get_pid.remote(), dying.get_pid.remote()])
    dispatcher = Dispatcher([dying, up], max_retries=2, events=Events(done=done.append), tick_s=0.1)
    summaries, failures = dispatcher.run(_shards(2))
    assert failures == [] and sorted(s["shard_id"] for s in done) == [0, 1] and dispatcher.deaths == 1
    assert sorted(s["shard_id"] for s in summaries) == [0, 1]
    ray.kill(up)

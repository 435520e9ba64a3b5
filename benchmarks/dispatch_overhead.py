"""What handing out a shard costs: the extraction dispatcher against ``ray.util.ActorPool.map_unordered``.

    .venv/bin/python benchmarks/dispatch_overhead.py [--shards 400] [--sleep-ms 0 10] [--repeats 3]

On an embedded Ray of 2 CPUs, two actors (one CPU each) run trivial shards: a method that sleeps ``--sleep-ms``
(0: returns at once) and, for the dispatcher, keeps the shard in its group and commits the group when told a shard
is its last or on ``flush`` (as ``ShardWorker`` does, without writing anything). Both schedulers run the same
shards on the same two actors, one shard per actor at a time (the dispatcher's ``slots=1``, a CPU worker's), in
turns, ``--repeats`` times each; the best run of each is kept. Prints, per sleep, the wall time per shard of each
and their ratio, and the overhead per shard: a worker's time per shard beyond the sleep (wall x workers / shards
- sleep), which is what the scheduler, Ray's calls and the driver's bookkeeping add. No model, no files: the
figure is the dispatcher's own cost, to set against a real shard's seconds."""

from __future__ import annotations

import argparse
import os
import time

import ray

WORKERS = 2


@ray.remote(num_cpus=1)
class TrivialWorker:
    def __init__(self, sleep_s: float):
        self.sleep_s, self.group = sleep_s, []

    def process(self, shard: dict, last: bool = False) -> dict:
        """The dispatcher's call: run (sleep), keep the shard in the group, commit the group when ``last``."""
        if self.sleep_s:
            time.sleep(self.sleep_s)
        self.group.append(shard["shard_id"])
        committed = []
        if last:
            committed, self.group = self.group, []
        return {"shard_id": shard["shard_id"], "committed": committed}

    def flush(self) -> list[int]:
        committed, self.group = self.group, []
        return committed

    def run(self, shard: dict) -> int:
        """ActorPool's call: run (sleep) and return."""
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return shard["shard_id"]

    def get_pid(self) -> int:
        return os.getpid()


def ours(workers: list, shards: list) -> float:
    from actlake.jobs.extract.dispatch import Dispatcher, Events

    done = []
    t = time.perf_counter()
    summaries, failures = Dispatcher(workers, max_retries=0, events=Events(done=done.append)).run(shards)
    wall = time.perf_counter() - t
    assert not failures and len(done) == len(shards) == len(summaries)
    return wall


def actor_pool(workers: list, shards: list) -> float:
    from dataclasses import asdict

    from ray.util import ActorPool

    t = time.perf_counter()
    out = list(ActorPool(workers).map_unordered(lambda a, s: a.run.remote(asdict(s)), shards))
    wall = time.perf_counter() - t
    assert sorted(out) == [s.shard_id for s in shards]
    return wall


def main() -> None:
    from actlake.jobs.extract.plan import Shard

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=400)
    p.add_argument("--sleep-ms", type=float, nargs="+", default=[0.0, 10.0])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    ray.init(address="local", num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    print(f"Ray {ray.__version__}, {WORKERS} workers, {a.shards} shards, best of {a.repeats}; ms per shard")
    print(f"{'sleep':>6} | {'dispatcher':>10} | {'ActorPool':>9} | {'ratio':>5} | {'overhead: dispatcher':>20} | "
          f"{'ActorPool':>9}")
    for sleep_ms in a.sleep_ms:
        workers = [TrivialWorker.remote(sleep_ms / 1000) for _ in range(WORKERS)]
        ray.get([w.get_pid.remote() for w in workers])  # up before the clock starts
        shards = [Shard(i, f"f{i}.jsonl", "jsonl", 0, 1, i) for i in range(a.shards)]
        ours(workers, shards[:20]), actor_pool(workers, shards[:20])  # warm both paths
        best = {"ours": float("inf"), "pool": float("inf")}
        for _ in range(a.repeats):
            best["ours"] = min(best["ours"], ours(workers, shards))
            best["pool"] = min(best["pool"], actor_pool(workers, shards))
        per = {k: 1000 * v / a.shards for k, v in best.items()}
        over = {k: v * WORKERS - sleep_ms for k, v in per.items()}
        print(f"{sleep_ms:>4g}ms | {per['ours']:>10.2f} | {per['pool']:>9.2f} | {per['ours'] / per['pool']:>5.2f} | "
              f"{over['ours']:>20.2f} | {over['pool']:>9.2f}")
        for w in workers:
            ray.kill(w)
    ray.shutdown()


if __name__ == "__main__":
    main()

"""Hands shards to worker actors, one at a time each, and survives workers that die.

A shard whose worker dies (killed, out of host memory, node removed) goes back to the
front of the queue and runs again on whichever worker is free, up to ``max_retries``
times; the dead actor is pinged and rejoins the pool once Ray has restarted it. A
shard that fails with an error of its own (a corrupt file) is not retried: that error
is deterministic. Shard commits are idempotent, so a retried shard never duplicates rows.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import asdict

log = logging.getLogger("actlake.dispatch")


def _is_worker_death(exc: Exception) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


class Dispatcher:
    def __init__(self, workers: list, max_retries: int, on_done=lambda summary: None):
        self.workers = list(workers)
        self.max_retries = max_retries
        self.on_done = on_done

    def run(self, shards: list) -> tuple[list[dict], list[str]]:
        """Run every shard; return (summaries, failure messages)."""
        import ray

        idle = deque(self.workers)
        queue = deque(shards)
        attempts: Counter = Counter()
        in_flight: dict = {}  # ref -> ("shard", worker, shard) | ("ping", worker, None)
        summaries, failures = [], []
        alive = len(self.workers)
        last_death = ""
        while queue or any(kind == "shard" for kind, _, _ in in_flight.values()):
            while idle and queue:
                w, s = idle.popleft(), queue.popleft()
                in_flight[w.process.remote(asdict(s))] = ("shard", w, s)
            if alive == 0:
                failures += [f"shard {s.shard_id:05d} ({s.path}): no worker left to run it" for s in queue]
                failures.append(f"the last worker failed with: {last_death}")
                break
            ref = ray.wait(list(in_flight), num_returns=1)[0][0]
            kind, w, s = in_flight.pop(ref)
            try:
                result = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - sorted below
                if kind == "ping" or not _is_worker_death(e):
                    if kind == "ping":  # the actor is gone for good
                        alive -= 1
                        last_death = str(getattr(e, "cause", None) or e).strip().splitlines()[-1][:500]
                        log.warning("a worker could not be restarted: %s", last_death)
                        continue
                    cause = getattr(e, "cause", None) or e
                    failures.append(f"shard {s.shard_id:05d} ({s.path} records {s.start}-{s.end}): {cause}")
                    log.error("%s", failures[-1])
                    idle.append(w)
                    continue
                attempts[s.shard_id] += 1
                if attempts[s.shard_id] > self.max_retries:
                    failures.append(f"shard {s.shard_id:05d} ({s.path}): its worker died {attempts[s.shard_id]} times")
                    log.error("%s", failures[-1])
                else:
                    log.warning("worker died running shard %05d (attempt %d); requeued", s.shard_id, attempts[s.shard_id])
                    queue.appendleft(s)
                in_flight[w.get_pid.remote()] = ("ping", w, None)
                continue
            if kind == "shard":
                summaries.append(result)
                self.on_done(result)
            idle.append(w)
        return summaries, failures

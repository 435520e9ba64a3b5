"""Hands shards to worker actors, one at a time each, and survives workers that die.

A shard whose worker dies (killed, out of host memory, node removed) goes back to the
front of the queue and runs again on whichever worker is free, up to ``max_retries``
times; the dead actor is pinged and rejoins the pool once Ray has restarted it. A
shard that fails with an error of its own (a corrupt file) is not retried: that error
is deterministic. Shard commits are idempotent, so a retried shard never duplicates rows.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import asdict

log = logging.getLogger("actlake.dispatch")


def _is_worker_death(exc: Exception) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def _is_temporary(exc: Exception) -> bool:
    """The actor is restarting (it will answer again), as opposed to dead for good."""
    from ray.exceptions import ActorUnavailableError

    return isinstance(exc, ActorUnavailableError)


class Dispatcher:
    def __init__(self, workers: list, max_retries: int, on_done=lambda summary: None):
        self.workers = list(workers)
        self.max_retries = max_retries
        self.on_done = on_done

    def run(self, shards: list) -> tuple[list[dict], list[str]]:
        """Run every shard; return (summaries, failure messages)."""
        import ray

        self.idle, self.queue = deque(self.workers), deque(shards)
        self.attempts: Counter = Counter()
        self.in_flight: dict = {}  # ref -> ("shard", worker, shard) | ("ping", worker, None)
        self.summaries, self.failures = [], []
        self.alive, self.last_death = len(self.workers), ""
        while self.queue or any(kind == "shard" for kind, _, _ in self.in_flight.values()):
            while self.idle and self.queue:
                w, s = self.idle.popleft(), self.queue.popleft()
                self.in_flight[w.process.remote(asdict(s))] = ("shard", w, s)
            if self.alive == 0:
                self.failures += [f"shard {s.shard_id:05d} ({s.path}): no worker left to run it" for s in self.queue]
                self.failures.append(f"the last worker failed with: {self.last_death}")
                break
            ref = ray.wait(list(self.in_flight), num_returns=1)[0][0]
            kind, w, s = self.in_flight.pop(ref)
            try:
                result = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - sorted by the handlers
                if kind == "ping":
                    self._ping_failed(w, e)
                elif _is_worker_death(e):
                    self._worker_died(w, s)
                else:
                    self._shard_failed(w, s, e)
                continue
            if kind == "shard":
                self.summaries.append(result)
                self.on_done(result)
            self.idle.append(w)
        return self.summaries, self.failures

    def _ping(self, w) -> None:
        self.in_flight[w.get_pid.remote()] = ("ping", w, None)

    def _worker_died(self, w, s) -> None:
        """The worker died under the shard: requeue the shard, ping the worker until it is back."""
        self.attempts[s.shard_id] += 1
        if self.attempts[s.shard_id] > self.max_retries:
            self.failures.append(f"shard {s.shard_id:05d} ({s.path}): its worker died {self.attempts[s.shard_id]} times")
            log.error("%s", self.failures[-1])
        else:
            log.warning("worker died running shard %05d (attempt %d); requeued", s.shard_id, self.attempts[s.shard_id])
            self.queue.appendleft(s)
        self._ping(w)

    def _ping_failed(self, w, e: Exception) -> None:
        if _is_temporary(e):  # still restarting: ask again shortly
            time.sleep(0.5)
            self._ping(w)
            return
        self.alive -= 1  # gone for good (constructor failed, restarts exhausted)
        self.last_death = str(getattr(e, "cause", None) or e).strip().splitlines()[-1][:500]
        log.warning("a worker could not be restarted: %s", self.last_death)

    def _shard_failed(self, w, s, e: Exception) -> None:
        """An error of the shard's own (a corrupt file): deterministic, so not retried."""
        cause = getattr(e, "cause", None) or e
        self.failures.append(f"shard {s.shard_id:05d} ({s.path} records {s.start}-{s.end}): {cause}")
        log.error("%s", self.failures[-1])
        self.idle.append(w)

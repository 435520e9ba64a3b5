"""Hands shards to worker actors, one at a time each, and survives workers that die.

A worker commits the shards it ran a group at a time (:mod:`actlake.storage.shards`): when its
group is due, with the last shard the queue holds, or when told to (``flush``) once nothing is left
to hand out. A shard is done when its group is committed. When a worker dies (killed, out of host
memory, node removed), the shard it held and the uncommitted shards of its group go back to the
front of the queue and run again on whichever worker is free, up to ``max_retries`` times each;
the dead actor is pinged and rejoins the pool once Ray has restarted it. A shard waiting on a worker
that is not up runs on a free one once nothing else is left (:meth:`Dispatcher._watch`). A shard that fails with
an error of its own (a corrupt file) is not retried: that error is deterministic. A worker whose constructor raised
a :func:`deterministic` error (a model that cannot load) is out at once: Ray does not restart it, and the job ends
when no worker is left (:meth:`Dispatcher.error`). A retried shard never duplicates rows: readers take only what
accepted commit records name.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from actlake.errors import ActlakeError

log = logging.getLogger("actlake.dispatch")


def _is_worker_death(exc: Exception) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def _is_temporary(exc: Exception) -> bool:
    """The actor is restarting (it will answer again), as opposed to dead for good."""
    from ray.exceptions import ActorUnavailableError

    return isinstance(exc, ActorUnavailableError)


TICK_S = 2.0
"""While shards run, progress is read this often (seconds)."""
WATCH_S = 2.0
"""How often the workers holding shards are looked up in Ray's actor table (:meth:`Dispatcher._watch`)."""


def _actor_states(workers: list) -> dict:
    """{worker: (state, restarts)} of the workers' actors in Ray's actor table (ALIVE, RESTARTING, DEAD...). A
    driver connected through Ray Client (``ray://``) has no access to the table: there one task reads it."""
    import ray

    # private _actor_id: the public get_runtime_context().get_actor_id() answers only in the actor, once it is up
    keys = {w._actor_id.hex(): w for w in workers}
    if ray.util.client.ray.is_connected():
        states = ray.get(ray.remote(num_cpus=0)(read_actor_states).remote(list(keys)), timeout=60)
    else:
        states = read_actor_states(list(keys))
    return {keys[k]: v for k, v in states.items()}


def read_actor_states(actor_ids: list[str]) -> dict[str, tuple[str, int]]:
    """:func:`_actor_states` in a process of the cluster: read from Ray's control store (one call an actor). An
    actor the table does not hold is left out."""
    # private: the public ray.util.state needs the dashboard, which jobs do not start (ServerUnavailable without it)
    from ray._private import state

    out = {}
    for actor_id in actor_ids:
        info = state.actors(actor_id=actor_id)
        if info:
            out[actor_id] = (info["State"], int(info["NumRestarts"]))
    return out


def init_error(e: Exception) -> Exception | None:
    """The actlake error a worker's constructor raised, rebuilt from Ray's ActorDiedError (which keeps only its
    text: ``actlake.errors.ModelLoadError: model …`` on its last line), or None."""
    import re

    from actlake import errors

    if not getattr(e, "actor_init_failed", False):
        return None
    last = str(e).strip().splitlines()[-1]
    m = re.match(r"actlake\.errors\.(\w+): (.*)", last)
    cls = getattr(errors, m.group(1), None) if m else None
    if not (isinstance(cls, type) and issubclass(cls, errors.ActlakeError)):
        return None
    try:
        return cls(m.group(2))
    except TypeError:  # a class whose constructor takes more than a message
        return None


def cause_of(e: BaseException) -> BaseException:
    """The error behind Ray's wrappers: a task's (``RayTaskError.cause``) or a constructor's (the ActorDiedError of
    an actor whose creation task raised holds that task's RayTaskError as its argument; :func:`init_error` reads its
    text where it does not); else ``e``."""
    if getattr(e, "actor_init_failed", False):
        task = next((a for a in e.args if isinstance(getattr(a, "cause", None), BaseException)), None)
        e = task if task is not None else (init_error(e) or e)
    while isinstance(getattr(e, "cause", None), BaseException):  # Ray's RayTaskError(ModelLoadError) is one too
        e = e.cause
    return e


def deterministic(e: BaseException) -> bool:
    """Whether ``e`` (as Ray raised it) repeats on every try (``ActlakeError.deterministic``: a bad setting, a model
    that cannot load, an analysis's bug, a failed first-batch self-check), so that no retry can help."""
    return getattr(cause_of(e), "deterministic", False) is True


def reason(cause: BaseException) -> str:
    """One line for a worker's error: an actlake error's whole message, else the last line of its text."""
    text = str(cause).strip()
    if not isinstance(cause, ActlakeError):
        text = text.splitlines()[-1] if text else type(cause).__name__
    return " ".join(text.split())[:1000]


@dataclass(frozen=True)
class Events:
    """What the dispatcher tells its job, and asks it. ``done(summary)``: a shard is committed; ``ran(summary)``: a
    shard's work is done (its group may commit later); ``tick()``: called every ``tick_s`` seconds while shards run
    (progress); ``committed()``: {shard id: summary} of the shards the store's records hold now (asked when a worker
    dies: it may have committed its group and died before saying so)."""

    done: Callable[[dict], None] = lambda summary: None
    ran: Callable[[dict], None] = lambda summary: None
    tick: Callable[[], None] = lambda: None
    committed: Callable[[], dict] = dict


class Dispatcher:
    def __init__(self, workers: list, max_retries: int, events: Events = Events(), slots: int = 1,
                 tick_s: float | None = None, target=None):
        """``slots``: shards each worker holds at once (2: it reads one while the model runs the other).
        ``target``: sent with every call (:class:`~actlake.jobs.extract.worker.Target`: the job a worker kept from
        another job, or restarted, takes on)."""
        self.extra = () if target is None else (target,)
        self.deaths = 0  # workers that died during the run
        self.events, self.tick_s = events, TICK_S if tick_s is None else tick_s
        self.workers = list(workers)
        self.max_retries = max_retries
        self.slots = slots

    def run(self, shards: list) -> tuple[list[dict], list[str]]:
        """Run and commit every shard; return (summaries, failure messages)."""
        import ray

        self.idle, self.queue = deque(w for w in self.workers for _ in range(self.slots)), deque(shards)
        self.attempts: Counter = Counter()
        self.in_flight: dict = {}  # ref -> ("shard", worker, shard) | ("flush", worker, None) | ("ping", worker, None)
        self.open: dict = {}  # worker (its handle, Ray's equality) -> shards it ran, their group not committed yet
        self.summaries: dict[int, dict] = {}
        self.early: set[int] = set()  # committed (by the worker's other slot) before their own result came back
        self.failed: dict[int, str] = {}  # shard id -> why it failed (one line)
        self.alive = len(self.workers)
        self.gone: dict = {}  # worker out for good -> its error
        self.restarts: dict = {}  # worker -> restarts whose waiting shards were taken back (_watch)
        self.answered: set = set()  # workers that returned a result: up at least once
        self.finished: set[int] = set()  # shards counted done (on_done)
        self.watched_at = time.monotonic()
        while True:
            while self.idle and self.queue:
                w, s = self.idle.popleft(), self.queue.popleft()
                self.in_flight[w.process.remote(asdict(s), not self.queue, *self.extra)] = ("shard", w, s)
            if not self.queue:  # nothing left to hand out: idle workers commit what they hold
                busy = {x for kind, x, _ in self.in_flight.values() if kind == "shard"}
                for w in dict.fromkeys(w for w in self.idle if self.open.get(w) and w not in busy):  # once each
                    self.idle.remove(w)
                    self.in_flight[w.flush.remote(*self.extra)] = ("flush", w, None)
            if not self.queue and not any(kind != "ping" for kind, _, _ in self.in_flight.values()):
                break  # all committed (a worker still restarting is not waited for)
            if self.alive == 0 or not self.in_flight:
                held = [s for kind, _, s in self.in_flight.values() if kind == "shard"]  # by workers gone
                for s in list(self.queue) + [s for ss in self.open.values() for s in ss] + held:
                    self._fail(s, f"shard {s.shard_id:05d} ({s.path}): no worker left to run it")
                break
            self._watch()  # before the wait: no result is in hand that it could take away
            if self.queue and self.idle:
                continue  # shards it took back: handed out now
            ready = ray.wait(list(self.in_flight), num_returns=1, timeout=self.tick_s)[0]
            self.events.tick()
            if not ready:
                continue
            ref = ready[0]
            kind, w, s = self.in_flight.pop(ref)
            try:
                result = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - sorted by the handlers
                if kind == "ping":
                    self._ping_failed(w, e)
                elif _is_worker_death(e):
                    self._worker_died(w, s, e)
                elif kind == "flush":
                    self._commit_failed(w, e)
                else:
                    self._shard_failed(w, s, e)
                continue
            self.answered.add(w)
            if kind == "shard":
                self.summaries[s.shard_id] = result
                self.events.ran(result)
                if s.shard_id in self.early:  # its group is already committed
                    self.early.discard(s.shard_id)
                    self._done(result)
                else:
                    self.open.setdefault(w, []).append(s)
                self._committed(w, result["committed"])
            elif kind == "flush":
                self._committed(w, result)
                self._requeue(self.open.pop(w, []), "its worker's group was lost (a failed commit or a restart)")
            self.idle.append(w)
        return [self.summaries[i] for i in sorted(self.summaries)], list(self.failed.values())

    def error(self) -> ActlakeError:
        """The job's error for its failed shards, each counted once. When every worker is gone with a
        :func:`deterministic` error (its constructor failed): that error's class, its reason first, and no advice
        to rerun. Else the count, the advice (a lost node or a killed worker does not repeat) and a line a shard."""
        n, causes = len(self.failed), [self.gone.get(w) for w in self.workers]
        if causes and all(c is not None and deterministic(c) for c in causes):
            cause = list(self.gone.values())[-1]
            kind = next(c for c in type(cause).__mro__ if "deterministic" in vars(c))  # ModelLoadError, ConfigError...
            return kind(f"every worker failed to start: {reason(cause)} ({n} shard(s) not run; the same error would "
                        "repeat on a rerun)")
        last = f"\nthe last worker failed with: {reason(list(self.gone.values())[-1])}" if self.gone else ""
        return ActlakeError(f"{n} shard(s) failed; rerun the same run id to retry them:\n  "
                            + "\n  ".join(self.failed.values()) + last)

    def _fail(self, s, line: str) -> None:
        """Shard ``s`` failed for good: ``line`` says why (the first reason given stands)."""
        self.failed.setdefault(s.shard_id, line)

    def _committed(self, w, ids: list[int]) -> None:
        """The worker committed the shards ``ids``: they count as done."""
        if not ids:
            return
        done = set(ids)
        self.open[w] = [s for s in self.open.get(w, []) if s.shard_id not in done]
        for sid in sorted(done):
            if sid in self.summaries:
                self._done(self.summaries[sid])
            else:  # the worker's other slot: its result is on the way
                self.early.add(sid)

    def _done(self, summary: dict) -> None:
        """A shard is committed: ``on_done`` once per shard (a copy taken back by :meth:`_watch` may still run
        where it was sent and commit too, in a record readers refuse)."""
        if summary["shard_id"] not in self.finished:
            self.finished.add(summary["shard_id"])
            self.events.done(summary)

    def _ping(self, w) -> None:
        self.in_flight[w.get_pid.remote()] = ("ping", w, None)

    def _worker_died(self, w, s, e: Exception) -> None:
        """The worker died (under shard ``s``, or committing): requeue ``s`` and the shards of its open group,
        which died with it; ping the worker until it is back. One whose constructor raised a :func:`deterministic`
        error is out for good (Ray does not restart it), and its shards, which did not run, keep their retries."""
        self.deaths += 1
        lost = ([s] if s is not None else []) + self.open.pop(w, [])
        if getattr(e, "actor_init_failed", False) and deterministic(e):
            self._requeue(lost, "its worker could not start", count=False)
            self._out(w, e)
            return
        self._requeue(lost, "its worker died")
        self._ping(w)

    def _watch(self) -> None:
        """With nothing left to hand out and a worker free that has answered before, take back the shards
        waiting on a worker that is not up (looked up in Ray's actor table before the dispatcher waits, at
        most every :data:`WATCH_S` seconds).

        A call sent to an actor that is not up waits for it: a worker still loading its model, being restarted,
        or not placed yet. That may never come: a node lost while its worker was starting left the job waiting
        for good with every other shard done, the restart finding no room while the surviving workers held the
        rest of the cluster. The shards run on the free workers instead (a copy that runs where it was sent
        after all commits a record that readers refuse: the shard is committed already); a taking from a worker
        that never died does not count as a retry. A restarted worker's open group went with it. The worker's
        slots come back when it answers."""
        import ray

        if (self.queue or not any(x in self.answered for x in self.idle)
                or time.monotonic() - self.watched_at < WATCH_S):
            return
        self.watched_at = time.monotonic()
        holding: dict = {}  # worker -> the refs of the shards it holds
        for ref, (kind, w, _) in self.in_flight.items():
            if kind == "shard":
                holding.setdefault(w, []).append(ref)
        if not holding:
            return
        try:
            states = _actor_states(list(holding))
        except Exception as e:  # noqa: BLE001 - the lookup is an aid: the job goes on waiting as before
            log.warning("could not read the workers' states from Ray (%s: %s)", type(e).__name__, e)
            return
        for w, refs in holding.items():
            state, restarts = states.get(w, ("ALIVE", 0))
            if state == "ALIVE":
                continue
            lost = [self.in_flight.pop(ref)[2] for ref in refs]
            for ref in refs:
                ray.cancel(ref)  # still waiting for the worker: it need not run there
            died = restarts > self.restarts.get(w, 0) or state == "DEAD"
            if died:  # so did its open group
                self.restarts[w] = restarts
                self.deaths += 1
                lost += self.open.pop(w, [])
            slots = len(refs) + sum(x == w for x in self.idle)
            self.idle = deque(x for x in self.idle if x != w)
            (log.warning if died else log.info)(
                "%d shard(s) waiting on a worker that is not up (%s, %d restart(s)) go to the free workers",
                len(refs), state.lower(), restarts)
            self._requeue(lost, f"its worker was not up ({state.lower()})", count=died)
            for _ in range(slots):
                self._ping(w)

    def _requeue(self, lost: list, why: str, count: bool = True) -> None:
        """Shards a worker held uncommitted and no longer holds: done if the store has them (committed just
        before), else back to the front of the queue (up to ``max_retries`` times each; ``count``: this time
        counts as one)."""
        stored = self.events.committed() if lost else {}
        for shard in [x for x in lost if x.shard_id in stored]:
            self.early.discard(shard.shard_id)
            self.summaries.setdefault(shard.shard_id, stored[shard.shard_id])
            self._done(self.summaries[shard.shard_id])
        for shard in reversed([x for x in lost if x.shard_id not in stored]):
            self.attempts[shard.shard_id] += count
            if self.attempts[shard.shard_id] > self.max_retries:
                self._fail(shard, f"shard {shard.shard_id:05d} ({shard.path}): {why}, "
                                  f"{self.attempts[shard.shard_id]} times")
                log.error("%s", self.failed[shard.shard_id])
            else:
                if count:
                    log.warning("shard %05d requeued (attempt %d): %s", shard.shard_id, self.attempts[shard.shard_id], why)
                else:
                    log.info("shard %05d goes to another worker: %s", shard.shard_id, why)
                self.queue.appendleft(shard)

    def _commit_failed(self, w, e: Exception) -> None:
        """Writing a group failed (the store refused): its shards go back to the queue like a dead worker's.
        An analysis that failed writing its tables ends the job, as does any :func:`deterministic` error."""
        if deterministic(e):
            raise cause_of(e) from None
        cause = str(cause_of(e)).strip().splitlines()[-1][:500]
        log.error("a group could not be committed: %s", cause)
        self._requeue(self.open.pop(w, []), f"its group could not be committed ({cause})")
        self.idle.append(w)

    def _ping_failed(self, w, e: Exception) -> None:
        if _is_temporary(e):  # still restarting: ask again shortly
            time.sleep(0.5)
            self._ping(w)
            return
        self._out(w, e)

    def _out(self, w, e: Exception) -> None:
        """The worker is gone for good (its constructor failed, its restarts ran out): its slots leave the pool."""
        if w in self.gone:  # a second slot of a worker already counted out
            return
        self.gone[w] = cause_of(e)
        self.alive -= 1
        self.idle = deque(x for x in self.idle if x != w)
        log.warning("a worker is out for good (its constructor failed, or its restarts ran out): %s",
                    reason(self.gone[w]))

    def _shard_failed(self, w, s, e: Exception) -> None:
        """An error of the shard's own (a corrupt file): deterministic, so not retried. A :func:`deterministic`
        error (an analysis's bug, a model the worker cannot load) would fail every shard: it ends the job at once."""
        cause = cause_of(e)
        if deterministic(cause):
            raise cause from None
        self._fail(s, f"shard {s.shard_id:05d} ({s.path} records {s.start}-{s.end}): {cause}")
        log.error("%s", self.failed[s.shard_id])
        self.idle.append(w)

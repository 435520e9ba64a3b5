"""A job's progress, from the first batch: documents, tokens and shards done, tokens/s and an ETA.

Workers report every batch they finish to a :class:`BatchCounter` actor (a call they do not wait for);
the driver reads it every few seconds while it waits for shards (:meth:`Progress.tick`) and draws a tqdm
bar over the planned documents on a terminal, or logs a line at most every :data:`LOG_EVERY_S` seconds
otherwise. Each finished shard is one log line that stays. A shard that is run again (its worker died)
reports its batches again, so the counts may run ahead of the shards until it is done; they never pass
the planned total.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from actlake.jobs.common.clock import hms

log = logging.getLogger("actlake.progress")

LOG_EVERY_S = 10.0
"""Without a terminal, a progress line at most this often (and only when something moved)."""


class BatchCounter:
    """Totals the workers add to, batch by batch, per job (a Ray actor: :func:`job_counter`)."""

    def __init__(self):
        self.jobs: dict[str, tuple[float, int, int]] = {}

    def start(self, job: str) -> None:
        self.jobs[job] = (0.0, 0, 0)

    def add(self, job: str, docs: float, tokens: int) -> None:
        if job in self.jobs:  # not a late batch of a job that has ended (Ray orders calls per caller only)
            d, t, b = self.jobs[job]
            self.jobs[job] = (d + docs, t + tokens, b + 1)

    def totals(self, job: str) -> tuple[float, int, int]:
        return self.jobs.get(job, (0.0, 0, 0))

    def forget(self, job: str) -> None:
        self.jobs.pop(job, None)


TOTALS_TIMEOUT_S = 30
"""Seconds the driver waits for the counter's totals before it goes on without progress."""


@dataclass(frozen=True)
class JobCounter:
    """One job's totals in the driver's :class:`BatchCounter` (what a worker holds: a batch is one call it does
    not wait for)."""

    actor: object
    job: str
    last: dict = field(default_factory=dict, compare=False)
    """The totals read last, and whether the actor is gone: progress is bookkeeping, and a counter that died
    (killed, out of memory) must not fail or stall the job; its progress line then stops moving."""

    def add(self, docs: float, tokens: int) -> None:
        self.actor.add.remote(self.job, docs, tokens)  # a dead actor's call fails only when its result is read

    def totals(self) -> tuple[float, int, int]:
        import ray

        if not self.last.get("gone"):
            try:
                self.last["totals"] = ray.get(self.actor.totals.remote(self.job), timeout=TOTALS_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - dead, unreachable or slow: the job goes on without it
                self.last["gone"] = True
                log.warning("the progress counter stopped answering (%s); the job goes on without progress",
                            type(e).__name__)
        return self.last.get("totals", (0.0, 0, 0))

    def close(self) -> None:
        self.actor.forget.remote(self.job)


_counter: tuple | None = None
"""(Ray session, actor): the driver's :class:`BatchCounter`, made by the first job of its Ray session."""
_counter_lock = threading.Lock()


def job_counter() -> JobCounter:
    """A new job's totals in the driver's :class:`BatchCounter` actor, which lives on the driver's node and takes no
    CPU of the workers': the driver reads it every tick, so a worker node lost mid-job must not take it along
    (the job would end with it). The jobs of one Ray session share the actor (a sweep's checkpoints, a notebook's
    jobs): each one would otherwise start a Python process of its own to count its batches."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    global _counter
    ctx = ray.get_runtime_context()
    session, job = (ctx.get_job_id(), ctx.get_node_id()), uuid.uuid4().hex
    with _counter_lock:
        if _counter is not None and _counter[0] == session:
            try:
                ray.get(_counter[1].start.remote(job), timeout=60)
                return JobCounter(_counter[1], job)
            except Exception:  # noqa: BLE001 - gone (killed, or its node lost): a new one
                log.info("the progress counter is gone; starting another")
        here = NodeAffinitySchedulingStrategy(ctx.get_node_id(), soft=False)
        _counter = (session, ray.remote(num_cpus=0)(BatchCounter).options(scheduling_strategy=here).remote())
        # sent before the job's workers exist (their first batch follows the model's load); a batch that still
        # came first would only be missing from the progress shown, never from the job
        _counter[1].start.remote(job)
        return JobCounter(_counter[1], job)


class Progress:
    """``total_docs``: documents of the shards to run (None when unknown: streamed Hugging Face datasets);
    ``shards``: shards to run; ``skipped``: shards committed by an earlier run."""

    def __init__(self, total_docs: int | None, shards: int, skipped: int = 0, stream=None):
        from tqdm import tqdm

        self.shards, self.skipped, self.ran, self.start = shards, skipped, 0, time.monotonic()
        self.docs = self.tokens = 0
        self.first: tuple[float, float] | None = None
        """(time, documents) when the first documents were counted: the ETA's rate is measured from there, leaving
        out the start-up (Ray, the workers, the model's load), which is not paid again."""
        self.last_log, self.logged = 0.0, (0, 0)
        # disable=None: a bar only when the stream is a terminal
        self.bar = tqdm(total=total_docs, unit="doc", file=stream or sys.stderr, disable=None, dynamic_ncols=True,
                        desc="documents", smoothing=0.1)

    def tick(self, totals: tuple[float, int, int]) -> None:
        """The counter's totals (docs, tokens, batches) as the workers reported them so far."""
        docs, self.tokens, _ = totals
        if self.bar.total is not None:
            docs = min(docs, self.bar.total)
        self.bar.update(docs - self.docs)
        self.docs = docs
        self.bar.set_postfix_str(self._status(), refresh=True)
        now = time.monotonic()
        if self.first is None and docs > 0:
            self.first = (now, docs)
        if self.bar.disable and (int(self.docs), self.tokens) != self.logged and now - self.last_log >= LOG_EVERY_S:
            self.last_log, self.logged = now, (int(self.docs), self.tokens)
            total = f"/{self.bar.total:,}" if self.bar.total is not None else ""
            eta = self._eta()
            log.info("documents %s%s  %s%s", f"{self.docs:,.0f}", total, self._status(), f"  ETA {eta}" if eta else "")

    def shard_ran(self, summary: dict) -> None:
        """One log line per finished shard."""
        self.ran += 1
        line = (f"shard {summary.get('shard_id', -1):05d} done ({self.ran + self.skipped}/{self.shards + self.skipped}): "
                f"{summary.get('tokens', 0):,} tokens of {summary.get('docs', 0):,} documents in {summary.get('seconds', 0.0):.1f}s")
        if self.bar.disable:
            log.info("%s", line)
        else:  # above the bar, which stays at the bottom
            self.bar.write(f"{time.strftime('%H:%M:%S')} actlake.progress: {line}", file=self.bar.fp)

    def close(self) -> None:
        self.bar.close()

    def _status(self) -> str:
        elapsed = time.monotonic() - self.start
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return f"{self.tokens:,} tokens, {rate:,.0f} tokens/s, shards {self.ran + self.skipped}/{self.shards + self.skipped}"

    def _eta(self) -> str:
        """Time left at the rate since the first documents were counted (none before a second count)."""
        if not self.bar.total or self.first is None:
            return ""
        (t0, d0), now = self.first, time.monotonic()
        if self.docs <= d0 or now <= t0:
            return ""
        left = (now - t0) * (self.bar.total - self.docs) / (self.docs - d0)
        return hms(left)

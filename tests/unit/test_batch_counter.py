"""The driver's batch counter keeps each job's totals apart and drops batches of a job that has ended."""

from __future__ import annotations

from actlake.jobs.extract.progress import BatchCounter


def test_jobs_are_counted_apart_and_late_batches_are_dropped():
    c = BatchCounter()
    c.start("a"), c.start("b")
    c.add("a", 1.0, 10), c.add("b", 0.5, 7), c.add("a", 2.0, 20)
    assert c.totals("a") == (3.0, 30, 2) and c.totals("b") == (0.5, 7, 1)
    c.forget("a")
    c.add("a", 1.0, 5)  # a worker's batch arriving after its job ended (Ray orders calls per caller only)
    assert c.jobs == {"b": (0.5, 7, 1)} and c.totals("a") == (0.0, 0, 0)

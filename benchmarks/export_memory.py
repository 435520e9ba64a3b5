"""Memory of the token export's shuffle (jobs/export.py) against what it states, on synthetic rows.

    .venv/bin/python benchmarks/export_memory.py

1,000,000 rows of width 256 (996 MiB of activations and index) through both passes with ``--memory-mb 100``;
prints the bucket count, the estimate the export logs, and the peak of Python-tracked memory (tracemalloc: numpy's
arrays) in each pass.
"""

import math
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np

from actlake.jobs.export import _spread, _pass_two, INDEX, READ_ROWS
rows, d, memory_mb, shard_rows = 1_000_000, 256, 100, 65_536
row_bytes = 4 * d + np.dtype(list(INDEX)).itemsize
buckets = max(10, math.ceil(rows * row_bytes / (memory_mb * 2**20 / 2)))
def batches():
    rng = np.random.default_rng(0)
    for s in range(0, rows, READ_ROWS):
        n = min(READ_ROWS, rows - s)
        idx = np.zeros(n, np.dtype(list(INDEX))); idx["doc_id"] = np.arange(s, s + n)
        yield idx, rng.standard_normal((n, d), dtype=np.float32)
with tempfile.TemporaryDirectory() as t:
    st = Path(t); (st / "buckets").mkdir()
    tracemalloc.start()
    _spread(batches(), st / "buckets", buckets, np.random.default_rng([0, 1, 0]), 0)
    p1 = tracemalloc.get_traced_memory()[1]; tracemalloc.reset_peak()
    m = _pass_two(st, buckets, d, shard_rows, "float32", "npy", 0)
    p2 = tracemalloc.get_traced_memory()[1]
    bucket_mb = rows / buckets * row_bytes / 2**20
    print(f"data {rows*row_bytes/2**20:.0f} MiB, {buckets} buckets of {bucket_mb:.0f} MiB; estimate "
          f"{2.4*bucket_mb + (READ_ROWS+shard_rows)*row_bytes/2**20:.0f} MiB; peak pass1 {p1/2**20:.0f} MiB (incl. the generator's batch), pass2 {p2/2**20:.0f} MiB; rows {m['rows']}")

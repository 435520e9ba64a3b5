"""Memory of the token export's shuffle (jobs/export/tokens.py) against ``--memory-mb``, on synthetic store files.

    .venv/bin/python benchmarks/export_memory.py [--rows 1000000] [--d 256] [--memory-mb 100]

Writes store-like Parquet files (1,000,000 rows of width 256 by default: 996 MiB of activations and index, ten times
the bound), then runs both passes as ``actlake export --format tokens`` does and prints, per pass, the peak of
numpy's arrays (tracemalloc), Arrow's pool peak (Parquet's page buffers) and the process's peak RSS (libraries and
the interpreter included), against the data's size.
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from actlake.jobs.export.store import INDEX_DTYPE

MEASURE = """
import json, resource, sys, time, tracemalloc
from pathlib import Path
import pyarrow as pa, pyarrow.compute, pyarrow.parquet, safetensors.torch, torch
from actlake.jobs.export import tokens
files, rows, d, mb, staging = json.loads(sys.argv[1])
plan = tokens.Plan.make(rows, d, mb, None)
next(tokens.batches(files[0], 3, 64))
pool, got, pass_two = pa.default_memory_pool(), {}, tokens._pass_two  # pass 1's peaks taken as pass 2 starts
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
got["rss_before"] = rss()
def traced(*a):
    got.update(pass1=tracemalloc.get_traced_memory()[1], arrow1=pool.max_memory(), rss1=rss(), t1=time.perf_counter() - t0)
    tracemalloc.reset_peak()
    return pass_two(*a)
tokens._pass_two = traced
tracemalloc.start()
t0 = time.perf_counter()
m = tokens.shuffle(files, 3, Path(staging), plan, "float32", "safetensors", 0, rows)
got.update(pass2=tracemalloc.get_traced_memory()[1], arrow2=pool.max_memory(), rss2=rss(), t2=time.perf_counter() - t0 - got["t1"], rows=m["rows"],
           buckets=plan.buckets, shard_rows=plan.shard_rows, read_rows=plan.read_rows)
print(json.dumps(got))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--memory-mb", type=float, default=100)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--json", help="write the measurements here")
    a = ap.parse_args()
    row_bytes = 4 * a.d + INDEX_DTYPE.itemsize
    with tempfile.TemporaryDirectory() as t:
        files, per = [], a.rows // a.files
        for f in range(a.files):
            rng = np.random.default_rng(f)
            h = rng.standard_normal((per, a.d), dtype=np.float32)
            table = pa.table({"doc_id": np.arange(f * per, (f + 1) * per) // 128, "window_index": np.zeros(per, np.int32),
                              "position": np.arange(per, dtype=np.int32) % 128, "token_id": np.arange(per, dtype=np.int32),
                              "role": ["other"] * per, "layer": np.full(per, 3, np.int16)})
            files.append(str(Path(t) / f"part-{f}.parquet"))
            pq.write_table(table.append_column("h", pa.FixedSizeListArray.from_arrays(pa.array(h.ravel()), a.d)),
                           files[-1], compression="zstd", write_page_checksum=True)
            del h, table
        (Path(t) / "staging").mkdir()
        out = subprocess.run([sys.executable, "-c", MEASURE,
                              json.dumps([files, per * a.files, a.d, a.memory_mb, str(Path(t) / "staging")])],
                             capture_output=True, text=True, check=True)
    g = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    print(f"data {per * a.files * row_bytes / mib:,.0f} MiB ({per * a.files:,} rows of width {a.d}), --memory-mb "
          f"{a.memory_mb:g}: {g['buckets']} buckets, shards of {g['shard_rows']:,} rows, read batches of "
          f"{g['read_rows']:,} rows")
    print(f"pass 1: numpy peak {g['pass1'] / mib:.1f} MiB, Arrow pool peak {g['arrow1'] / mib:.1f} MiB, {g['t1']:.1f} s")
    print(f"pass 2: numpy peak {g['pass2'] / mib:.1f} MiB, {g['t2']:.1f} s")
    print(f"process peak RSS {g['rss2'] / mib:.0f} MiB (after imports, before pass 1: {g['rss_before'] / mib:.0f} MiB)")
    print(f"rows {g['rows']:,}; {per * a.files / (g['t1'] + g['t2']):,.0f} rows/s")
    if a.json:
        Path(a.json).write_text(json.dumps(g | {"data": per * a.files * row_bytes, "memory_mb": a.memory_mb}))


if __name__ == "__main__":
    main()

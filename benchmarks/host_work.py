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
"""

from __future__ import annotations

import sys
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
    from actlake.jobs.extract import Extractor, ShardResults

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
        result = ex.run_batch(batch, strict=False)
    sync()
    plain()  # warm-up

    def collect():
        acc = ShardResults(ex.new_stats())
        acc.add(result)  # the statistics' merges are queued on the device, not waited for
        return acc

    parts = {
        "collate ids and mask": lambda: collate(batch, lm.tokenizer.pad_token_id),
        "role and type8 ids (warm vocabulary)": lambda: ex.cats.batch(ids.numpy(), lengths),
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's GPU table rows from benchmarks/gpu_suite.py's JSON files.

    python benchmarks/gpu_table.py benchmarks/results/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

NAMES = {"minilm": "all-MiniLM-L6-v2", "pythia-410m": "Pythia-410m", "llama-1b": "Llama-1B-style, GQA 32/8",
         "pythia-6.9b": "Pythia-6.9b"}


def row(r: dict) -> str:
    v = dict(r["variants"])
    if "graphs" in v:  # measured before layer graphs were the GPU's default: suite was eager, graphs the default
        v["eager"], v["suite"] = v.pop("suite", None), v.pop("graphs")
        v = {k: x for k, x in v.items() if x is not None}
    ratio = lambda n: f"{v[n]['vs_plain']:.2f}×" if n in v else "—"
    cell = lambda key, fmt: " / ".join(fmt(v[n][key]) if n in v and key in v[n] else "—" for n in ("plain", "suite"))
    return (f"| {NAMES.get(r['model'], r['model'])} ({r['seq_len']}, {r['tokens_per_batch']:,}) "
            f"| {v['plain']['tokens_per_s']:,.0f} | {ratio('suite')} | {ratio('eager')} | {ratio('torch')} | {ratio('attention')} | {ratio('fused')} "
            f"| {ratio('habit')} | {cell('peak_mib', lambda x: f'{x:,.0f}')} | {cell('syncs', str)} "
            f"| {cell('ops_per_batch', lambda x: format(x / r.get('layers', float('nan')), '.1f'))} |")


def main(argv=None) -> int:
    files = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    results = [json.loads(p.read_text()) for p in files]
    results = [r for r in results if "variants" in r and "plain" in r["variants"]]
    if not results:
        print("no gpu_suite results with a plain variant", file=sys.stderr)
        return 1
    print(f"{results[0].get('gpu', '?')}")
    print("| config (T, tokens per batch) | plain tokens/s | suite | suite without layer graphs | suite without Triton kernels "
          "| attention only | fused | habit "
          "| peak MiB plain / suite | syncs per batch plain / suite | operations per layer plain / suite |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(row(r))
    for r in results:
        if "shard" in r:
            s = r["shard"]
            if "read_ahead_s" in s:
                print(f"shards ({r['model']}): Extractor.process on {s['shards']} shards, {s['tokens']:,} tokens "
                      f"({s['docs']} docs): {s['process_s']:.2f} s = {s['process_s'] / s['batches_s']:.2f}× their batches "
                      f"alone ({s['batches_s']:.2f} s; reading {s['read_s']:.2f}, under the compute lock "
                      f"{s['compute_s']:.2f}, writing {s['write_s']:.2f}, one commit {s['commit_s']:.2f}); with read-ahead "
                      f"{s['read_ahead_s']:.2f} s = {s['read_ahead_s'] / s['batches_s']:.2f}×")
            else:
                print(f"shard ({r['model']}): Extractor.process {s['process_s']:.2f} s for {s['tokens']:,} tokens "
                      f"({s['docs']} docs) vs its batches alone {s['batches_s']:.2f} s ({s['process_s'] / s['batches_s']:.2f}×)")
            print(f"  queued vs alone: statistics {s.get('stats_rel_diff', float('nan')):.1e}, "
                  f"written residual norms {s.get('norms_rel_diff', float('nan')):.1e}")
        for key, variant in (("graphs_rel_diff", "graphs"), ("eager_rel_diff", "eager")):
            if key in r:
                print(f"layer graphs on vs off ({r['model']}): statistics, largest difference {r[key]:.1e}; "
                      f"peak MiB of '{variant}' {r['variants'][variant]['peak_mib']:,.0f}")
        if "check" in r:
            worst = sorted(r["check"].items(), key=lambda kv: -kv[1])[:4]
            print(f"check ({r['model']}): largest relative differences " + ", ".join(f"{k} {x:.1e}" for k, x in worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())

